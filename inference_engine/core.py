"""EngineCore: the in-process engine loop, shared by ``LLM`` and the server.

``step()`` never raises for a bad request: rejections, aborts and runner failures come back as
``EngineOutput``s with a finish reason (and an error code where it is an error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from inference_engine.config import EngineConfig
from inference_engine.guided import GrammarCompiler, InvalidGrammar
from inference_engine.protocol import EngineOutput, ErrorCode, FinishReason, SamplingParams
from inference_engine.request import NO_TOKEN, UNDRAWABLE, Request
from inference_engine.scheduler import RequestRejected, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from inference_engine.model_runner import PendingStep

# constraints whose output is JSON: steered to close near their token limit
JSON_KINDS = ("json", "json_object")
# why a request had no next token, by the sampler's stand-in for it
STUCK = {
    NO_TOKEN: "the output's grammar allows no token at this point",
    UNDRAWABLE: "the sampling parameters leave no token with any probability (every token "
    "banned until min_tokens, or a penalty past float32's range)",
}


class Refusal(NamedTuple):
    """Why a request is refused before it runs, and the field of it at fault where one is."""

    code: ErrorCode
    message: str
    param: str | None = None


class EngineCore:
    def __init__(
        self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        """Loads the model: builds its ``ModelRunner``, which sizes the KV cache. Structured
        outputs need the model's ``tokenizer`` (without one they are refused)."""
        from inference_engine.model_runner import ModelRunner  # torch, only once a core is built

        self.config = config
        self.runner = runner = ModelRunner(config)
        model_max_len = runner.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's {model_max_len}"
            )
        self.max_model_len = config.max_model_len or model_max_len
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = runner.spec.eos_token_ids
        self.grammars = (
            GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
            if tokenizer is not None
            else None
        )
        self.scheduler = Scheduler(
            num_blocks=runner.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
        )
        self._pending: list[EngineOutput] = []
        # async scheduling: the next step is scheduled and launched before the step in flight's
        # tokens are back, so the host's work overlaps the device's
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.on_accelerator
        )
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # mid-step admission (admit_mid_step)
        self._take_inputs: Callable[[], bool] | None = None
        self._deliver: Callable[[list[EngineOutput]], None] | None = None

    @property
    def on_accelerator(self) -> bool:
        """True when the model runs on a GPU (or another device that is not the CPU)."""
        return self.runner.device.type != "cpu"

    def close(self) -> None:
        """Give back the model's memory now (weights, KV cache, CUDA graphs); the core
        serves nothing after this."""
        self._in_flight = None
        self.runner.close()

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        tenant_id: str = "",
        tenant_weight: float = 1.0,
        max_model_len: int | None = None,
        grammar: xgrammar.CompiledGrammar | None = None,
    ) -> None:
        """Queue a request (``max_model_len``: the caller's context length, where lower than
        the engine's; ``grammar``: its constraint as ``compile_structured_outputs`` gave it,
        else compiled here). A request that cannot be served gets an error output from the
        next ``step()`` instead of an exception."""
        request = Request(
            req_id,
            prompt_token_ids,
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival_time,
            max_model_len=min(self.max_model_len, max_model_len or self.max_model_len),
            tenant_id=tenant_id,
            weight=tenant_weight,
        )
        error = self.validate_prompt(prompt_token_ids) or self.validate_params(sampling_params)
        if error is None and sampling_params.structured_outputs is not None:
            error = self._attach_grammar(request, grammar)
        if error is None:
            try:
                self.scheduler.add_request(request)
            except RequestRejected as exc:
                error = Refusal(ErrorCode.CONTEXT_LENGTH_EXCEEDED, str(exc))
            except ValueError as exc:
                error = Refusal(ErrorCode.INVALID_REQUEST, str(exc))
        if error is not None:
            request.timings.finished = time.time()
            self._pending.append(self._output(request, FinishReason.ERROR, *error))

    def validate_params(self, params: SamplingParams) -> Refusal | None:
        """The bounds that depend on the model: ``top_k`` and stop token ids within its
        vocabulary."""
        if params.top_k > self.vocab_size:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"top_k must be at most the vocabulary size {self.vocab_size}, got {params.top_k}",
                "top_k",
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= self.vocab_size:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"stop_token_ids must be in [0, {self.vocab_size})",
                "stop_token_ids",
            )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"logit_bias keys must be token ids in [0, {self.vocab_size})",
                "logit_bias",
            )
        return None

    def cached_grammar(
        self, params: SamplingParams, cache_salt: str | None = None
    ) -> xgrammar.CompiledGrammar | None:
        """``params``' grammar as compiled before for ``cache_salt``'s requests; None where it
        is not in the cache (``compile_structured_outputs`` then compiles: tens of
        milliseconds, or far more for a schema written to be slow) or there is none."""
        spec = params.structured_outputs
        if spec is None or self.grammars is None:
            return None
        return self.grammars.cached(spec, cache_salt)

    def compile_structured_outputs(
        self, params: SamplingParams, cache_salt: str | None = None
    ) -> xgrammar.CompiledGrammar | Refusal | None:
        """``params``' constraint compiled (from or into the cache of the requests sharing
        ``cache_salt``), a ``Refusal`` where it cannot be, None where there is none. The
        server calls this off the busy loop (on its compile queue) and hands the grammar on
        with the request (``add_request(grammar=)``)."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            return Refusal(
                ErrorCode.INVALID_REQUEST, "structured outputs need the model's tokenizer"
            )
        if params.structured_outputs.kind() in JSON_KINDS:
            # built before the grammar enters the cache: a request that takes it from there
            # goes to the busy loop at once, which finds them built
            self.grammars.closing_tokens()
        try:
            return self.grammars.compile(params.structured_outputs, cache_salt)
        except InvalidGrammar as exc:
            return Refusal(ErrorCode.INVALID_REQUEST, str(exc), "structured_outputs")

    def _attach_grammar(
        self, request: Request, compiled: xgrammar.CompiledGrammar | None
    ) -> Refusal | None:
        if compiled is None:  # compiled here (the offline ``LLM``'s requests)
            compiled = self.compile_structured_outputs(request.sampling_params, request.cache_salt)
            if isinstance(compiled, Refusal):
                return compiled
        import xgrammar

        request.grammar = xgrammar.GrammarMatcher(compiled)
        if request.sampling_params.structured_outputs.kind() in JSON_KINDS:
            request.closing_tokens = self.grammars.closing_tokens()
        # the request ends where its language does
        request.eos_token_ids = request.eos_token_ids | self.grammars.stop_token_ids
        return None

    def context_refusal(
        self,
        num_prompt_tokens: int,
        params: SamplingParams,
        max_model_len: int | None = None,
        *,
        at_least: bool = False,
    ) -> Refusal | None:
        """A served request's prompt and ``max_tokens`` must fit the context together (the
        caller's ``max_model_len``, where lower than the engine's), as vLLM's server refuses
        them, rather than be cut short; ``LLM`` stops such a request at the context instead.
        ``at_least``: ``num_prompt_tokens`` is a bound, counted before tokenizing."""
        limit = min(self.max_model_len, max_model_len or self.max_model_len)
        head = f"This model's maximum context length is {limit} tokens. However, "
        count = f"at least {num_prompt_tokens}" if at_least else f"{num_prompt_tokens}"
        if num_prompt_tokens > limit:
            return Refusal(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"{head}your messages resulted in {count} tokens. Please reduce the length of "
                "the messages.",
            )
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            total = num_prompt_tokens + params.max_tokens
            return Refusal(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"{head}you requested {'at least ' if at_least else ''}{total} tokens "
                f"({count} in the messages, {params.max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
            )
        return None

    def validate_prompt(self, prompt_token_ids: list[int]) -> Refusal | None:
        if not prompt_token_ids:
            return Refusal(ErrorCode.INVALID_REQUEST, "the prompt is empty", "prompt")
        if len(prompt_token_ids) > self.max_model_len:
            return Refusal(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(prompt_token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}",
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"prompt token ids must be in [0, {self.vocab_size})",
                "prompt",
            )
        return None

    def abort_requests(self, req_ids: list[str]) -> None:
        aborted = self.scheduler.abort_requests(req_ids)
        self.runner.release([request.req_id for request in aborted])
        self._pending.extend(self._output(request, FinishReason.ABORT) for request in aborted)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or self._in_flight is not None
        )

    def admit_mid_step(
        self,
        take_inputs: Callable[[], bool],
        deliver: Callable[[list[EngineOutput]], None],
    ) -> bool:
        """Let a newcomer's first chunk run inside a step under way, between two of the
        model's layers, instead of after it: at each layer boundary ``take_inputs()`` adds the
        requests that arrived meanwhile (True when it added any; nothing else may change the
        core then: aborts wait for the step's end), and when the scheduler finds a newcomer
        (``Scheduler.schedule_newcomers``) its step runs at once and ``deliver`` gets its
        outputs. At most one such step inside another. Only where the runner pauses between
        layers (the CPU: a GPU's host runs ahead of its kernels), under ``fair`` and without
        async scheduling; returns whether it is on."""
        if self.async_scheduling or not (
            self.runner.has_layer_boundaries and self.scheduler.waiting.is_fair
        ):
            return False
        self._take_inputs, self._deliver = take_inputs, deliver
        return True

    def step(self) -> list[EngineOutput]:
        """Schedule, run the model and return one delta per request that got a token or
        finished (including queued errors and aborts).

        With async scheduling the step scheduled here is launched and left in flight, and the
        deltas are those of the step launched by the call before: its tokens come back while
        the device runs this one. Where a request's sampling needs its last token on the host
        (``Request.needs_host_tokens``), the step's forward is launched and its sampling only
        once the step before is read back (``PendingStep.launch_sampling``)."""
        outputs, self._pending = self._pending, []
        scheduler_output = self.scheduler.schedule()
        launched = None
        if not scheduler_output.is_empty:
            if self._take_inputs is not None:
                self.runner.layer_boundary = partial(self._at_layer_boundary, scheduler_output)
            try:
                launched = self._launch(scheduler_output, outputs)
            finally:
                self.runner.layer_boundary = None
        if self._in_flight is not None:
            outputs.extend(self._finish(*self._in_flight))
            self._in_flight = None
        if launched is not None:
            launched = self._launch_sampling(*launched, outputs)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outputs.extend(self._finish(*launched))
        return outputs

    def _at_layer_boundary(self, in_flight: SchedulerOutput) -> None:
        if not self._take_inputs():
            return
        newcomers = self.scheduler.schedule_newcomers(in_flight)
        if newcomers.is_empty:
            return
        self.runner.layer_boundary = None  # one newcomer's step inside a step, not nested
        outputs, self._pending = self._pending, []
        if (launched := self._launch(newcomers, outputs)) is not None:
            outputs.extend(self._finish(*launched))
        self._deliver(outputs)

    def _launch(
        self, scheduler_output: SchedulerOutput, outputs: list[EngineOutput]
    ) -> tuple[SchedulerOutput, PendingStep] | None:
        """Launch a scheduled step on the runner; None, with its requests failed into
        ``outputs``, when that fails."""
        kv_cache = self.scheduler.kv_cache
        block_tables = [
            kv_cache.get_block_ids(item.request.req_id) for item in scheduler_output.scheduled
        ]
        scheduler_output.block_tables = block_tables
        try:
            return scheduler_output, self.runner.launch(scheduler_output.scheduled, block_tables)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the loop
            outputs.extend(self._fail_step(scheduler_output, exc))
            return None

    def _launch_sampling(
        self, scheduler_output: SchedulerOutput, launched: PendingStep, outputs: list[EngineOutput]
    ) -> tuple[SchedulerOutput, PendingStep] | None:
        """Launch a step's deferred sampling, if it has one; None, with its requests failed
        into ``outputs``, when that fails."""
        try:
            launched.launch_sampling()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the loop
            outputs.extend(self._fail_step(scheduler_output, exc))
            return None
        return scheduler_output, launched

    def _finish(
        self, scheduler_output: SchedulerOutput, launched: PendingStep
    ) -> list[EngineOutput]:
        """Wait for a launched step's tokens; the deltas of its requests."""
        try:
            sampled, logprobs = launched.result()
            prompt_logprobs = launched.prompt_logprobs()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the loop
            return self._fail_step(scheduler_output, exc)
        for request, start, entries in prompt_logprobs:
            if request.prompt_logprobs is not None:  # not sent yet
                request.prompt_logprobs[start : start + len(entries)] = entries
        stuck = {
            req_id: token for req_id, token in sampled.items() if token in (NO_TOKEN, UNDRAWABLE)
        }
        for req_id in stuck:
            del sampled[req_id]
        outputs, finished = [], []
        for request in self.scheduler.update_from_output(scheduler_output, sampled):
            output = self._output(request, request.finish_reason)
            output.new_token_ids = [request.output_token_ids[-1]]
            if request.req_id in logprobs:
                output.new_logprobs = [logprobs[request.req_id]]
            if request.prompt_logprobs is not None:  # its first token: they are all in
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            outputs.append(output)
            if request.is_finished:
                finished.append(request.req_id)
        if stuck:
            self._fail_stuck(stuck, outputs)
        if finished:
            self.runner.release(finished)
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[EngineOutput]:
        """End a failed step's requests (those not finished already), and those that read
        the KV it was to write, with an engine error."""
        readers = self.scheduler.forget_failed_step(scheduler_output)
        requests = self.scheduler.abort_requests(
            [item.request.req_id for item in scheduler_output.scheduled] + readers
        )
        self.runner.release([request.req_id for request in requests])
        message = f"model step failed: {type(exc).__name__}: {exc}"
        return [
            self._output(r, FinishReason.ERROR, ErrorCode.ENGINE_ERROR, message) for r in requests
        ]

    def _fail_stuck(self, stuck: dict[str, int], outputs: list[EngineOutput]) -> None:
        """End the requests that had no next token to draw with an error: their grammar
        allowed none (the tokenizer cannot spell what it requires), or their sampling
        parameters left none any probability."""
        requests = self.scheduler.abort_requests(list(stuck))
        self.runner.release(list(stuck))
        outputs.extend(
            self._output(r, FinishReason.ERROR, ErrorCode.INVALID_REQUEST, STUCK[stuck[r.req_id]])
            for r in requests
        )

    @staticmethod
    def _output(
        request: Request,
        finish_reason: FinishReason | None,
        error_code: ErrorCode | None = None,
        error_message: str | None = None,
        error_param: str | None = None,
    ) -> EngineOutput:
        # an aborted request's usage is what the engine computed for it (metered exactly)
        is_abort = finish_reason == FinishReason.ABORT
        num_prompt = request.num_prefilled_prompt_tokens if is_abort else request.num_prompt_tokens
        return EngineOutput(
            req_id=request.req_id,
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=min(max(request.num_cached_tokens, 0), num_prompt),
            timings=request.timings if finish_reason is not None else None,
            error_code=error_code,
            error_message=error_message,
            error_param=error_param,
        )
