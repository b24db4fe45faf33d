"""Turns the core's per-step ``EngineOutput``s into the clients' ``GenerateDelta`` frames.

Per request: incremental detokenization, stop strings, usage and timings on the last delta.
The text of a delta never contains a stop string: characters that could still grow into one
are held back until they cannot. A stop-string hit ends the text at once and asks the core to
abort the request; the last delta (finish reason ``stop``, usage and timings) goes out when the
core's final output for the request arrives, one step later, unless the core finished it in the
same step. A failure while processing one request's output fails that request only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from inference_engine.metrics import EngineMetrics
from inference_engine.protocol import (
    EngineOutput,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    ResponseType,
    SamplingParams,
    TokenLogprobs,
    Usage,
)
from inference_engine.tokenization import (
    IncrementalDetokenizer,
    TokenBytes,
    find_stop_string,
    token_text,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    identity: bytes
    request_id: str
    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer, ids only
    stop: list[str] | None
    # characters kept back so that a stop string is never sent in part
    holdback: int
    wants_logprobs: bool
    include_stop: bool
    # stop strings count only once more tokens than this exist (as vLLM's)
    min_tokens: int = 0
    text: str = ""
    num_sent_chars: int = 0
    num_tokens: int = 0
    last_token_time: float = 0.0
    # a stop string was hit; waiting for the core's final output
    is_stopped: bool = False
    tenant_id: str = ""
    # kept where the first delta echoes the prompt: its text, its tokens' logprobs' text
    prompt_token_ids: list[int] | None = None
    return_prompt_text: bool = False


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        abort: Callable[[list[str]], None],
        metrics: EngineMetrics | None = None,
    ) -> None:
        """``abort(req_ids)`` asks the core to abort requests (through the busy loop in the
        server, directly in ``LLM``). With ``tokenizer=None`` deltas carry token ids only."""
        self.tokenizer = tokenizer
        self.abort = abort
        self.metrics = metrics
        # req_id -> state; written by the input thread (add) and this processor (remove)
        self.states: dict[str, RequestState] = {}
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        """Set at start, and again by a model swap (the server's): its tokens' bytes go with
        it."""
        self._tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer) if tokenizer is not None else None

    def add_request(
        self,
        req_id: str,
        identity: bytes,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant_id: str = "",
        *,
        return_prompt_text: bool = False,
    ) -> None:
        """Track a request; ``return_prompt_text``: its first delta carries the prompt decoded
        (``GenerateRequest.return_prompt_text``)."""
        stop = params.stop or None
        echoes = return_prompt_text or params.prompt_logprobs is not None
        self.states[req_id] = RequestState(
            identity=identity,
            request_id=request_id,
            detokenizer=(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                )
                if self.tokenizer is not None
                else None
            ),
            stop=stop,
            holdback=max(map(len, stop)) - 1 if stop else 0,
            wants_logprobs=params.logprobs is not None,
            include_stop=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            tenant_id=tenant_id,
            prompt_token_ids=list(prompt_token_ids) if echoes else None,
            return_prompt_text=return_prompt_text,
        )

    def process(self, outputs: list[EngineOutput], step_time: float) -> list[list[bytes]]:
        """Frames ``[identity, OUTPUTS, payload]``: one per client, with its deltas of this
        step. ``step_time`` is when the step's tokens were sampled."""
        by_identity: dict[bytes, list[GenerateDelta]] = {}
        for identity, delta in self.deltas(outputs, step_time):
            by_identity.setdefault(identity, []).append(delta)
        return [
            [identity, ResponseType.OUTPUTS.value, self._encoder.encode(deltas)]
            for identity, deltas in by_identity.items()
        ]

    def deltas(
        self, outputs: list[EngineOutput], step_time: float
    ) -> list[tuple[bytes, GenerateDelta]]:
        """The step's deltas with the identity of the client each is for."""
        deltas = []
        for output in outputs:
            state = self.states.get(output.req_id)
            if state is None:
                continue  # finished here already (stop string, failure)
            try:
                delta = self._process_one(output, state, step_time)
            except Exception as exc:  # noqa: BLE001 - one request's failure fails it alone
                logger.exception("processing the output of %s failed", output.req_id)
                delta = self._finish(
                    output.req_id,
                    state,
                    GenerateDelta(
                        state.request_id,
                        finish_reason=FinishReason.ERROR,
                        error=ErrorCode.ENGINE_ERROR,
                        error_message=f"output processing failed: {type(exc).__name__}: {exc}",
                    ),
                )
                if not output.is_finished:
                    self.abort([output.req_id])
            if delta is not None:
                deltas.append((state.identity, delta))
        return deltas

    def _process_one(
        self, output: EngineOutput, state: RequestState, step_time: float
    ) -> GenerateDelta | None:
        token_ids = output.new_token_ids
        if token_ids and self.metrics is not None:
            self.metrics.record_tokens(len(token_ids))
            if state.last_token_time:
                self.metrics.record_inter_token_latency(step_time - state.last_token_time)
            state.last_token_time = step_time
        if state.is_stopped:
            if not output.is_finished:
                return None  # computed after the stop string, before the core's abort
            return self._finish(
                output.req_id, state, self._last_delta(output, state, FinishReason.STOP)
            )

        is_first_token = state.num_tokens == 0 and bool(token_ids)
        state.num_tokens += len(token_ids)
        detokenizer = state.detokenizer
        text_ids = token_ids
        if output.finish_reason == FinishReason.STOP and not state.include_stop:
            text_ids = token_ids[:-1]  # the stop token (EOS, stop_token_ids) is no text, as vLLM
        new_text = detokenizer.push(text_ids) if text_ids and detokenizer is not None else ""
        if output.is_finished and detokenizer is not None:
            new_text += detokenizer.flush()
        state.text += new_text
        stop_at = (
            find_stop_string(state.text, state.stop, len(new_text))
            if state.stop and state.num_tokens > state.min_tokens
            else None
        )
        if stop_at is not None:
            start, end = stop_at
            state.text = state.text[: end if state.include_stop else start]
        if stop_at is not None or output.is_finished:
            send_upto = len(state.text)
        else:
            send_upto = max(state.num_sent_chars, len(state.text) - state.holdback)
        delta = GenerateDelta(
            state.request_id,
            text=state.text[state.num_sent_chars : send_upto],
            token_ids=token_ids,
            # the stop token's, like its text, left out: the tokens spell the text
            logprobs=self._with_text(output, text_ids) if state.wants_logprobs else None,
        )
        if is_first_token:
            delta.usage = Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=state.num_tokens,
                cached_tokens=output.num_cached_tokens,
            )
            self._echo_prompt(output, state, delta)
        state.num_sent_chars = send_upto
        if stop_at is not None and not output.is_finished:
            state.is_stopped = True
            self.abort([output.req_id])
        elif output.is_finished:
            reason = FinishReason.STOP if stop_at is not None else output.finish_reason
            last = self._last_delta(output, state, reason)
            delta.finish_reason = last.finish_reason
            delta.error, delta.error_message = last.error, last.error_message
            delta.error_param = last.error_param
            delta.usage, delta.timings = last.usage, last.timings
            return self._finish(output.req_id, state, delta)
        return delta

    def _echo_prompt(self, output: EngineOutput, state: RequestState, delta: GenerateDelta) -> None:
        """The prompt on the first delta, where asked for: its text, its tokens' logprobs
        (the first token's entry carries its text alone: nothing comes before it)."""
        prompt_ids = state.prompt_token_ids
        if prompt_ids is None:
            return
        state.prompt_token_ids = None
        if state.return_prompt_text and self.tokenizer is not None:
            delta.prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if output.prompt_logprobs is not None:
            entries = [TokenLogprobs(0.0), *output.prompt_logprobs]
            delta.prompt_logprobs = self._add_text(prompt_ids, entries)

    def _with_text(self, output: EngineOutput, token_ids: list[int]) -> list | None:
        """The logprobs of ``token_ids`` (the step's, or all but its stop token) with each
        token's text, as OpenAI's API reports them."""
        if output.new_logprobs is None:
            return None
        return self._add_text(token_ids, output.new_logprobs[: len(token_ids)])

    def _add_text(self, token_ids: list[int], entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
        """``entries``, the logprobs of ``token_ids``, with each token's and alternative's
        text and bytes."""
        if self.token_bytes is None:
            return entries
        token_bytes = self.token_bytes
        for token_id, entry in zip(token_ids, entries, strict=False):
            entry.token_bytes = token_bytes(token_id)
            entry.token = token_text(entry.token_bytes)
            entry.top_token_bytes = [token_bytes(top_id) for top_id in entry.top_token_ids]
            entry.top_tokens = [token_text(raw) for raw in entry.top_token_bytes]
        return entries

    @staticmethod
    def _last_delta(
        output: EngineOutput, state: RequestState, reason: FinishReason
    ) -> GenerateDelta:
        return GenerateDelta(
            state.request_id,
            finish_reason=FinishReason.ERROR if output.error_code is not None else reason,
            error=output.error_code,
            error_message=output.error_message,
            error_param=output.error_param,
            usage=Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=state.num_tokens,
                cached_tokens=output.num_cached_tokens,
            ),
            timings=output.timings,
        )

    def _finish(self, req_id: str, state: RequestState, delta: GenerateDelta) -> GenerateDelta:
        self.states.pop(req_id, None)
        if self.metrics is not None:
            usage = delta.usage or Usage()
            self.metrics.record_finished(
                delta.finish_reason,
                delta.timings,
                usage.prompt_tokens,
                usage.cached_tokens,
                tenant_id=state.tenant_id,
                num_output_tokens=usage.completion_tokens,
            )
        return delta
