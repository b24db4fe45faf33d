"""``LLM``: the offline API. Tokenizes, runs ``EngineCore`` to completion, and turns its
outputs into text through the server's own ``OutputProcessor`` (detokenizing, stop strings with
``include_stop_str_in_output``, logprobs' text), as vLLM's in-process client does.

Bad input: ``generate`` validates every prompt before it adds any, and raises ``ValueError``
naming the prompt's index for an empty prompt or one longer than ``max_model_len`` (nothing
runs then). Requests the core itself rejects (e.g. one that could never fit the KV cache) come
back as outputs with ``finish_reason="error"`` and an ``error`` message; the others are served.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from inference_engine.config import EngineConfig
from inference_engine.core import EngineCore
from inference_engine.output_processor import OutputProcessor
from inference_engine.protocol import SamplingParams, TokenLogprobs
from inference_engine.tokenization import render_chat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]


@dataclass
class RequestOutput:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    # with ``prompt_logprobs``: one entry per prompt token, the first with its text alone
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    def __init__(self, model: str, skip_tokenizer_init: bool = False, **options: Any) -> None:
        """``options`` are ``EngineConfig``'s fields (``dtype``, ``max_num_seqs``,
        ``enforce_eager`` ...), with its defaults; another name raises ``TypeError``.
        ``skip_tokenizer_init`` loads no tokenizer: prompts must be token ids, texts stay empty
        and stop strings are ignored."""
        from transformers import AutoTokenizer

        names = {option.name for option in fields(EngineConfig)} - {"model"}
        if unknown := sorted(options.keys() - names):
            raise TypeError(f"LLM() got unknown options {unknown}; it takes {sorted(names)}")
        config = EngineConfig(model=model, **options)
        self.tokenizer: PreTrainedTokenizerBase | None = (
            None if skip_tokenizer_init else AutoTokenizer.from_pretrained(model)
        )
        self.core = EngineCore(config, tokenizer=self.tokenizer)
        self._req_counter = itertools.count()

    def close(self) -> None:
        """Give back the model's memory (weights, KV cache, CUDA graphs) now; this ``LLM``
        generates nothing after it."""
        self.core.close()

    def chat(
        self,
        conversations: list[list[dict[str, str]]] | list[dict[str, str]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to each conversation (a list of role/content
        messages), rendered with the tokenizer's chat template (and ``tools``, OpenAI's
        function tool objects, where the template shows them)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=False)")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            render_chat(self.tokenizer, conversation, tools) for conversation in conversations
        ]
        return self.generate(prompts, params)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")

        outputs = [self._new_output(prompt) for prompt in prompts]
        for index, output in enumerate(outputs):
            error = self.core.validate_prompt(output.prompt_token_ids)
            if error is not None:
                raise ValueError(f"prompt {index}: {error[1]}")
        by_id = {output.req_id: output for output in outputs}
        processor = OutputProcessor(self.tokenizer, abort=self.core.abort_requests)
        for output, request_params in zip(outputs, params, strict=True):
            if request_params.logprobs is not None:
                output.logprobs = []
            processor.add_request(
                output.req_id, b"", output.req_id, output.prompt_token_ids, request_params
            )
            self.core.add_request(
                output.req_id,
                output.prompt_token_ids,
                request_params,
                priority=priority,
                cache_salt=cache_salt,
            )
        while self.core.has_unfinished_requests():
            for _, delta in processor.deltas(self.core.step(), time.time()):
                output = by_id[delta.request_id]
                output.token_ids.extend(delta.token_ids)
                output.text += delta.text
                if delta.logprobs and output.logprobs is not None:
                    output.logprobs.extend(delta.logprobs)
                if delta.prompt_logprobs is not None:
                    output.prompt_logprobs = delta.prompt_logprobs
                if delta.usage is not None:
                    output.num_cached_tokens = delta.usage.cached_tokens
                if delta.finish_reason is not None:
                    output.finish_reason = str(delta.finish_reason)
                    output.error = delta.error_message
        return outputs

    def _new_output(self, prompt: Prompt) -> RequestOutput:
        req_id = f"llm-{next(self._req_counter)}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=False)")
            token_ids = list(self.tokenizer(prompt)["input_ids"]) if prompt else []
            return RequestOutput(req_id, prompt, token_ids)
        return RequestOutput(req_id, None, list(prompt))
