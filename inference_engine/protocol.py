"""Wire structs shared by the engine and its clients. No torch, no Django.

Structs that cross the wire use ``msgspec.Struct(array_like=True, omit_defaults=True, gc=False)``.
A frame is ``[RequestType byte][msgpack payload]``.
"""

from __future__ import annotations

import enum
import math

import msgspec

MAX_LOGPROBS = 20
# longest request_id, tenant_id, cache_salt or message role the engine accepts
MAX_ID_CHARS = 256
# a bigger frame from a client is dropped by ZeroMQ before it is read
MAX_FRAME_BYTES = 16 << 20
# the longest JSON schema, regex or grammar a request may constrain its output with
MAX_GRAMMAR_CHARS = 256 << 10
MAX_CHOICE_OPTIONS = 1024
# OpenAI's bound on a logit_bias value, and on how many tokens one request may bias
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_TOOLS = 128


class RequestType(bytes, enum.Enum):
    """First frame of every message from a client to the engine."""

    GENERATE = b"\x00"
    ABORT = b"\x01"
    STATS = b"\x02"
    CONTROL = b"\x03"


class ResponseType(bytes, enum.Enum):
    """First frame of every message from the engine to a client."""

    # payload: list[GenerateDelta], this client's deltas from one engine step
    OUTPUTS = b"\x00"
    STATS = b"\x01"
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
    # a CONTROL load is switching models; retry once STATS says ready
    MODEL_LOADING = "model_loading"
    # CONTROL unloaded the model; nothing is served until a load
    MODEL_NOT_LOADED = "model_not_loaded"


MAX_TENANT_WEIGHT = 1000.0


class InvalidParam(ValueError):
    """A sampling parameter out of its range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# what a torch generator takes (a negative seed wraps around to its unsigned value)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidParam(name, f"{name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise InvalidParam(name, f"{name} must be finite, got {value!r}")


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Constrains a request's output to a language, as vLLM's ``structured_outputs``: exactly one
    of a JSON schema (``json``, serialized), any JSON object (``json_object``), a ``regex``, one
    of ``choice``'s strings, or an EBNF ``grammar`` (GBNF, as xgrammar reads it). The engine
    compiles it once per distinct value and masks every step's logits with it; a value it
    cannot compile is refused with ``invalid_request``. Once the output is complete the grammar
    allows only EOS, so a request ends where its language does."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kind(self) -> str:
        """The one constraint given ("json", "regex", ...); ``InvalidParam`` unless exactly
        one is."""
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if self.json_object is True:
            given.append("json_object")
        elif not isinstance(self.json_object, bool):
            raise InvalidParam(
                "structured_outputs", "structured_outputs.json_object must be a bool"
            )
        if len(given) != 1:
            raise InvalidParam(
                "structured_outputs",
                f"structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar (got {given or 'none'})",
            )
        return given[0]

    def validate(self) -> None:
        kind = self.kind()
        if kind == "choice":
            if (
                not isinstance(self.choice, list)
                or not 0 < len(self.choice) <= MAX_CHOICE_OPTIONS
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidParam(
                    "structured_outputs",
                    f"structured_outputs.choice must be 1 to {MAX_CHOICE_OPTIONS} non-empty "
                    "strings",
                )
            size = sum(map(len, self.choice))
        elif kind == "json_object":
            size = 0
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise InvalidParam(
                    "structured_outputs", f"structured_outputs.{kind} must be a non-empty string"
                )
            size = len(value)
        if size > MAX_GRAMMAR_CHARS:
            raise InvalidParam(
                "structured_outputs",
                f"structured_outputs.{kind} is {size} characters; at most {MAX_GRAMMAR_CHARS}",
            )


# a temperature below this samples greedily (as vLLM's ``_SAMPLING_EPS``)
SAMPLING_EPS = 1e-5


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to sample one request, with vLLM's names and defaults.

    ``top_k=0`` (or -1) means off. ``stop`` strings are matched on the detokenized text and are
    not included in it. ``logprobs=n`` returns the sampled token's logprob and the top ``n``.
    ``prompt_logprobs=n`` returns each prompt token's logprob given the tokens before it and
    the top ``n`` there, from the raw logits (vLLM's): such a request reads nothing from the
    prefix cache, its whole prompt is computed (as vLLM's).
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
    max_tokens: int | None = 16  # None: up to the context length (as vLLM)
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # the stop string that ended the text is kept at its end
    include_stop_str_in_output: bool = False
    # token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    # special tokens the model writes are left out of the text (vLLM's default); off, they
    # are text (a tool call's tags are special tokens in some models); the stop token never is
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("top_k", "min_tokens"):
            _check_number(name, getattr(self, name), integer=True)
        if self.max_tokens is not None:
            _check_number("max_tokens", self.max_tokens, integer=True)
        if self.temperature < 0:
            raise InvalidParam("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParam("top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidParam(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            )
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            )
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise InvalidParam(
                    "seed", f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            raise InvalidParam(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise InvalidParam(
                "stop", f"stop must be a string or a list of non-empty strings: {self.stop!r}"
            )
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            )
        ):
            raise InvalidParam(
                "stop_token_ids",
                f"stop_token_ids must be a list of non-negative integers: {self.stop_token_ids!r}",
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, integer=True)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidParam(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logit_bias is not None:
            self._validate_logit_bias()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidParam("structured_outputs", "structured_outputs must be an object")
            self.structured_outputs.validate()
            if self.ignore_eos:
                raise InvalidParam(
                    "ignore_eos", "ignore_eos cannot be combined with structured outputs"
                )

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidParam(
                "logit_bias",
                f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to numbers",
            )
        for token_id, value in bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidParam(
                    "logit_bias", f"logit_bias keys must be token ids (>= 0), got {token_id!r}"
                )
            _check_number("logit_bias", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias values must be in [-100, 100], got {value} for token {token_id}",
                )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one so small that dividing the logits by it in float32 would
        overflow them to inf (and the softmax to NaN): vLLM's ``_SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens already produced (repetition, presence or
        frequency penalty)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class ToolCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A function call the assistant made earlier in a conversation; ``arguments`` is JSON."""

    id: str
    name: str
    arguments: str


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One turn. An assistant turn may carry ``tool_calls`` (its content may then be empty);
    a ``tool`` turn answers the call ``tool_call_id``."""

    role: str
    content: str
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """This turn as chat templates read it (transformers' convention: a call's
        ``arguments`` as an object where they parse as one)."""
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _json_or_text(call.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> object:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


class GenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A client's generate request; exactly one of prompt, messages, prompt_token_ids is set.

    ``messages`` may be given as role/content dicts; they become ``Message``s. The client fills
    ``request_id`` with a uuid when it is None. ``validate()`` raises ``ValueError`` for a request
    the engine must refuse with ``invalid_request``; the engine calls it on every decode.
    """

    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str | None = None
    tenant_id: str | None = None
    # Lower values are served first, as in vLLM.
    priority: int = 0
    cache_salt: str | None = None
    # the tenant's share under fair scheduling (its plan's weight): 2 is served twice as much
    tenant_weight: float = 1.0
    # function tools the chat template renders into the prompt (OpenAI's tool objects:
    # {"type": "function", "function": {"name", "description", "parameters"}})
    tools: list[dict] | None = None
    # the caller's context length for this request (a deployment's own), when lower than the
    # engine's: the prompt and max_tokens must fit it, and an unset max_tokens stops there
    max_model_len: int | None = None
    # the first delta with tokens carries the prompt's text as decoded from its tokens
    # (``GenerateDelta.prompt_text``, special tokens kept): an echo of a prompt of token ids
    return_prompt_text: bool = False

    def __post_init__(self) -> None:
        if self.messages is not None and isinstance(self.messages, list):
            self.messages = [
                Message(**m) if isinstance(m, dict) and m.keys() == {"role", "content"} else m
                for m in self.messages
            ]

    def validate(self) -> None:
        given = [
            name
            for name in ("prompt", "messages", "prompt_token_ids")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})"
            )
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError("prompt must be a non-empty string")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise ValueError("messages must be a non-empty list")
            for message in self.messages:
                if not isinstance(message, Message) or not (
                    isinstance(message.role, str)
                    and 0 < len(message.role) <= MAX_ID_CHARS
                    and isinstance(message.content, str)
                ):
                    raise ValueError(f"each message needs a role and string content: {message!r}")
        if self.tools is not None:
            if self.messages is None:
                raise ValueError("tools need messages (a chat request)")
            if not isinstance(self.tools, list) or len(self.tools) > MAX_TOOLS:
                raise ValueError(f"tools must be a list of at most {MAX_TOOLS} tool objects")
        if self.prompt_token_ids is not None and (
            not isinstance(self.prompt_token_ids, list)
            or not self.prompt_token_ids
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.prompt_token_ids
            )
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of non-negative integers")
        if not isinstance(self.params, SamplingParams):
            raise ValueError("params must be SamplingParams")
        self.params.validate()
        if not isinstance(self.return_prompt_text, bool):
            raise ValueError("return_prompt_text must be a bool")
        for name in ("request_id", "tenant_id", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
                raise ValueError(f"{name} must be a string of at most {MAX_ID_CHARS} characters")
        if not self.request_id:
            raise ValueError("request_id must be set")
        _check_number("priority", self.priority, integer=True)
        if self.max_model_len is not None:
            _check_number("max_model_len", self.max_model_len, integer=True)
            if self.max_model_len < 1:
                raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        _check_number("tenant_weight", self.tenant_weight)
        if not 0 < self.tenant_weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"tenant_weight must be in (0, {MAX_TENANT_WEIGHT}]")


class AbortRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_ids: list[str]


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprob of one sampled token and the top-n alternatives (descending). The engine's
    output processor adds the tokens' text, so clients need no tokenizer."""

    logprob: float
    top_token_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    token: str = ""  # its text, or "bytes:\\xc3" where it holds part of a character
    top_tokens: list[str] = msgspec.field(default_factory=list)
    token_bytes: bytes = b""  # its own UTF-8 bytes (``tokenization.TokenBytes``)
    top_token_bytes: list[bytes] = msgspec.field(default_factory=list)


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
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error_code: ErrorCode | None = None
    error_message: str | None = None
    error_param: str | None = None  # the request's field at fault, where one is
    # on a request's first output, where ``params.prompt_logprobs`` is set: one entry per
    # prompt token after the first, in order
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class Usage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # prompt tokens served from the prefix cache
    cached_tokens: int = 0


class GenerateDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request got from one engine step. The last delta has ``finish_reason`` set
    (``str()`` gives "stop", "length", "abort" or "error"), ``usage`` and ``timings``; an error
    ends the stream with ``finish_reason=ERROR`` and ``error`` set. The first delta with
    tokens carries ``usage`` too (the prompt and cached counts), so a client that stops early
    still knows what the prompt cost."""

    request_id: str
    # the new text; holds back characters that may still become part of a stop string
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ErrorCode | None = None
    error_message: str | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    # one entry per token in token_ids when logprobs were requested
    logprobs: list[TokenLogprobs] | None = None
    # the request's field an INVALID_REQUEST error is about (``top_k``, ``prompt``, ...)
    error_param: str | None = None
    # On the first delta with tokens, where ``params.prompt_logprobs`` is set: one entry per
    # prompt token, with its text. The first token has nothing before it: its entry carries
    # its text alone (its logprob is 0.0 and has no meaning; OpenAI's and vLLM's null).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # on the first delta with tokens, where the request asked ``return_prompt_text``
    prompt_text: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class StatsResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Health and load of one engine: the gauges and counters of its Prometheus metrics."""

    model: str = ""
    max_model_len: int = 0
    # False while the model loads and once shutdown has begun
    ready: bool = False
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    # 0..1, share of KV blocks held by requests
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    max_queued_requests: int = 0
    # prompt tokens looked up in / found in the prefix cache
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    # new on every start of the engine process: a client that sees it change knows that the
    # requests it had in flight are lost
    engine_id: str = ""
    # "ready", "loading" or "unloaded" (see ControlRequest); the detail says what is loading,
    # how far it got, or why the last load failed
    state: str = "ready"
    state_detail: str = ""
    model_path: str = ""
    # how the model's chat template writes a tool call ("hermes": <tool_call>{json}</tool_call>;
    # "" where it shows none): the API parses the model's output with it
    tool_call_parser: str = ""
    # how long the step under way has run (0.0 between steps): a replica whose step has run
    # for long (a kernel that stalls) is routed nothing new while another is free to take it
    step_seconds: float = 0.0


class ControlRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Model control. ``load`` (``model`` = a local HF directory) loads in the background while
    the current model finishes its requests, then switches; new requests meanwhile get
    ``model_loading``, and a failed load leaves the current model serving. ``unload`` drains
    and frees the model; requests then get ``model_not_loaded``. The reply only says whether
    the action was accepted: STATS ``state`` tells how it goes."""

    action: str  # "load" or "unload"
    model: str | None = None


class ControlResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ok: bool
    message: str = ""


# --- the link's security ---------------------------------------------------------------------
#
# An engine reached over the network serves only clients that hold its token (``ENGINE_TOKEN``
# in both processes' environments, never a flag: flags show in ``ps``). Both ends derive
# CurveZMQ key pairs from it: the link is encrypted, only a client holding the token knows the
# engine's server key, and the engine's ZAP handler admits the client key alone, so a client
# without the token completes no handshake and reaches nothing. Without a token the link is
# plain, which only a local endpoint (ipc, or tcp on loopback) may be.

ENGINE_TOKEN_ENV = "ENGINE_TOKEN"
# what either end logs (at most once a minute: ZeroMQ retries every few hundred ms) when a
# handshake fails, which on this link means the two ends' security does not match
HANDSHAKE_FAILED = (
    "the handshake failed: the engine's ENGINE_TOKEN and its client's differ, or one of them "
    "has none"
)
HANDSHAKE_FAILURE_LOG_SECONDS = 60.0


def handshake_failed_events() -> int:
    """The socket monitor events of a failed handshake."""
    import zmq

    return (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


class LinkKeys(msgspec.Struct, frozen=True):
    """The CurveZMQ keys (Z85) both ends of a link derive from its token."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def link_keys(token: str) -> LinkKeys:
    """The key pairs of the link that ``token`` secures (the same at both ends)."""
    import hashlib

    import zmq
    from zmq.utils import z85

    if not zmq.has("curve"):
        raise ValueError(f"{ENGINE_TOKEN_ENV} is set, but this libzmq has no CURVE security")

    def secret(role: bytes) -> bytes:
        return z85.encode(
            hashlib.sha256(b"llm-platform engine link\0" + role + token.encode()).digest()
        )

    server_secret, client_secret = secret(b"server"), secret(b"client")
    return LinkKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )


def link_check(endpoint: str, token: str | None) -> None:
    """Refuse (``ValueError``) to serve a network endpoint without a token: anyone who could
    reach it would generate unmetered, as any tenant, and load or unload models."""
    if token is not None and token.startswith("replace-with-"):
        raise ValueError(
            f"{ENGINE_TOKEN_ENV} is the example's placeholder: set a secret of your own"
        )
    if token or endpoint.startswith(("ipc://", "inproc://")):
        return
    # any other transport (tcp, ws, tipc, ...) reaches beyond this host unless bound to loopback
    transport, _, address = endpoint.partition("://")
    host = address.rsplit(":", 1)[0] if transport == "tcp" else None
    if host not in _LOOPBACK_HOSTS:
        raise ValueError(
            f"{endpoint} is reachable from other hosts: set {ENGINE_TOKEN_ENV} (the same secret "
            f"in the engine's and the web tier's environments), or bind to 127.0.0.1 or ipc://"
        )
