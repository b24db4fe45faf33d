"""Wire structs shared by the engine and its clients. No torch, no Django.

Structs that cross the wire use ``msgspec.Struct(array_like=True, omit_defaults=True, gc=False)``.
A frame is ``[RequestType byte][msgpack payload]``.
"""

from __future__ import annotations

import enum
import math

import msgspec

MAX_LOGPROBS = 20


class RequestType(bytes, enum.Enum):
    """First frame of every message from a client to the engine."""

    GENERATE = b"\x00"
    ABORT = b"\x01"
    STATS = b"\x02"
    CONTROL = b"\x03"


class FinishReason(enum.IntEnum):
    """Why a request stopped. ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class ErrorCode(enum.StrEnum):
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    OVERLOADED = "overloaded"
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to sample one request, with vLLM's names and defaults.

    ``top_k=0`` (or -1) means off. ``stop`` strings are matched on the detokenized text and are
    not included in it. ``logprobs=n`` returns the sampled token's logprob and the top ``n``.
    Raises ``ValueError`` naming the field on invalid values, also when decoded from the wire.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("top_k", "max_tokens", "min_tokens"):
            _check_number(name, getattr(self, name), integer=True)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise ValueError(f"stop must be a string or a list of non-empty strings: {self.stop!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            )
        ):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative integers: {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    role: str
    content: str


class GenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A client's generate request; exactly one of messages, prompt, prompt_token_ids is set."""

    req_id: str
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    messages: list[Message] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    tenant_id: str | None = None
    # Lower values are served first, as in vLLM.
    priority: int = 0
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_ids: list[str]


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprob of one sampled token and the top-n alternatives (descending)."""

    logprob: float
    top_token_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class RequestTimings(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Wall-clock ``time.time()`` seconds; 0.0 means not reached yet."""

    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's delta for one request. Finished when ``finish_reason`` is set."""

    req_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    # one entry per new token when logprobs were requested
    new_logprobs: list[TokenLogprobs] | None = None
    new_text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error_code: ErrorCode | None = None
    error_message: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
