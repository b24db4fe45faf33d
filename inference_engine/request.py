"""One request's state as the scheduler and KV cache see it. Pure Python."""

from __future__ import annotations

import enum
import time

from inference_engine.protocol import FinishReason, RequestTimings, SamplingParams, TokenLogprobs

# the sampled "token" of a request whose grammar allows none: the request fails instead
NO_TOKEN = -1
# the sampled "token" of a request whose parameters leave no token any probability (every
# token banned until min_tokens, a penalty past float32's range): it fails instead
UNDRAWABLE = -2
# tokens a JSON-guided request keeps at least for closing its value (``wants_closing``)
MIN_CLOSING_TOKENS = 32


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class Request:
    """Prompt and output token ids, how many of them have KV in the cache
    (``num_computed_tokens``), the block hashes of its full blocks, status and timings."""

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        max_model_len: int | None = None,
        tenant_id: str = "",
        weight: float = 1.0,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        # fair scheduling: whose request this is, and that tenant's share (> 0)
        self.tenant_id = tenant_id
        self.weight = weight
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # tokens being sampled by a step still in flight (async scheduling): their positions
        # are scheduled, their ids not known on the host yet
        self.num_output_placeholders = 0
        # tokens served from the prefix cache when first scheduled; -1 until then
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # a preemption drops the request's KV and its count: the most of its prompt it had
        # computed stays, for the metering of an abort before its first token
        self.num_prompt_tokens_computed_before_preemption = 0
        # chained hashes of this request's full blocks, extended as tokens arrive
        self.block_hashes: list[bytes] = []
        self.timings = RequestTimings(arrival=time.time() if arrival_time is None else arrival_time)
        # set by the scheduler: FCFS order within one priority
        self.arrival_order = 0
        # structured outputs: an xgrammar matcher the sampler advances token by token, and for
        # JSON the tokens that close a value with their weights (see ``wants_closing``)
        self.grammar = None
        self.closing_tokens: tuple[list[int], list[float]] | None = None
        # prompt logprobs asked for and not yet sent: one entry per prompt token after the
        # first, by position, filled as its chunks run (``prompt_logprobs.py``)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * (self.num_prompt_tokens - 1)
            if sampling_params.prompt_logprobs is not None
            else None
        )

    @property
    def reads_whole_prompt(self) -> bool:
        """Whether its prompt must be computed, none of it read from the prefix cache: the
        logits of every prompt position are wanted (prompt logprobs not yet sent)."""
        return self.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those a step in flight is sampling."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling its next token needs the previous one on the host (a grammar to
        advance): a step that samples it while that token is in flight launches its forward
        and defers its sampling until the token is back (``model_runner.PendingStep``).
        Penalties count a token in flight on the device (``penalties.TokensInFlight``)."""
        return self.grammar is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prefilled_prompt_tokens(self) -> int:
        """Prompt tokens the engine has computed or found in the prefix cache so far: what the
        prompt of a request aborted before its first token cost."""
        if self.output_token_ids:
            return self.num_prompt_tokens
        computed = min(self.num_computed_tokens, self.num_prompt_tokens)
        return max(computed, self.num_prompt_tokens_computed_before_preemption)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold (prompt plus outputs)."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:  # up to the context length
            if self.max_model_len is None:
                raise ValueError("max_tokens=None needs the engine's max_model_len")
            return self.max_model_len
        limit = self.num_prompt_tokens + max_tokens
        return limit if self.max_model_len is None else min(limit, self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def wants_closing(self) -> bool:
        """Whether a JSON-guided request is near its token limit: from then on the sampler
        favours the tokens that close the value (quotes, brackets, EOS), so that the output
        parses instead of being cut off mid-value. The last quarter of its budget (at least
        ``MIN_CLOSING_TOKENS``, but never more than half of it: a short budget closed every
        string from its first token, and answered ``{"answer": ""}``) is kept for closing."""
        if self.closing_tokens is None:
            return False
        budget = self.max_num_tokens - self.num_prompt_tokens
        tokens_left = self.max_num_tokens - self.num_tokens
        return tokens_left <= min(max(MIN_CLOSING_TOKENS, budget // 4), budget // 2)

    def check_stop(self) -> FinishReason | None:
        """Stop reason after the last appended token, if any (stop strings are checked outside)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        # a grammar decides alone where its output ends (the sampler lets EOS through only there)
        if self.num_output_tokens >= params.min_tokens or self.grammar is not None:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if params.stop_token_ids and last in params.stop_token_ids:
                return FinishReason.STOP
        if self.num_tokens >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None
