"""From a request body to engine requests, or a 400 that names the offending ``param``."""

import re
from dataclasses import dataclass

import msgspec

from gateway.errors import ApiError, invalid
from gateway.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from inference_engine.protocol import GenerateRequest, Message, SamplingParams

MAX_STOP = 4
MAX_MESSAGES = 1024
MAX_USER_CHARS = 256
# max_tokens until the context length is known (see finalize_max_tokens)
UNBOUNDED = 2**31 - 1
# Before the engine counts a prompt, the gateway knows two figures for it. The likely count
# (OpenAI's rule of thumb) decides whether a request could ever fit a limit. The most it can
# be is what admission holds against the limits until the request settles with the real
# count: byte-level BPE (and SentencePiece with byte fallback) spends at most one token per
# UTF-8 byte, and a chat template adds a few tokens per message and some once.
CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
MAX_TEMPLATE_TOKENS_PER_MESSAGE = 16
MAX_TEMPLATE_TOKENS = 256

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_FIELD = re.compile(r"field `([^`]+)`")
# SamplingParams names its field in its ValueError; the API may call it differently.
_API_PARAM = {"logprobs": "top_logprobs", "stop_token_ids": "stop"}


@dataclass
class GenerationPlan:
    """What one API request asks the engine for: one engine request per choice."""

    model: str
    prompts: list[GenerateRequest]  # one per prompt, before the fan-out by n
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    estimated_prompt_tokens: int  # likely
    max_prompt_tokens: int  # at most
    max_tokens: int | None  # None: up to the context length
    max_tokens_param: str = "max_tokens"  # what the request called it
    priority: int | None = None  # as asked; the plan's tier is the floor (see fan_out)


def decode(body: bytes, request_type: type) -> msgspec.Struct:
    if not body:
        raise invalid("The request body is empty; send a JSON object.")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise invalid(str(exc), param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise invalid(
            f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}."
        ) from exc


def _param_of(message: str) -> str | None:
    path = _PATH.search(message)
    prefix = path.group(1) if path else ""
    field = _FIELD.search(message)
    if field:
        return f"{prefix}.{field.group(1)}" if prefix else field.group(1)
    return prefix or None


def _check_common(request: ChatCompletionRequest | CompletionRequest) -> None:
    if not request.model:
        raise invalid("model must be a non-empty string.", "model")
    if request.stop is not None:
        stops = [request.stop] if isinstance(request.stop, str) else request.stop
        if len(stops) > MAX_STOP or not all(stops):
            raise invalid(f"stop must be a non-empty string or up to {MAX_STOP} of them.", "stop")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true.", "stream_options")
    if request.user is not None and len(request.user) > MAX_USER_CHARS:
        raise invalid(f"user must be at most {MAX_USER_CHARS} characters.", "user")


def _sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    values = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "seed": request.seed,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "stop": stop,
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
    }
    try:
        return SamplingParams(**{name: v for name, v in values.items() if v is not None})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        param = max_tokens_param if field == "max_tokens" else _API_PARAM.get(field, field)
        raise invalid(str(exc).replace(field, param, 1), param) from exc


def plan_chat(body: bytes) -> GenerationPlan:
    request = decode(body, ChatCompletionRequest)
    _check_common(request)
    if not request.messages:
        raise invalid("messages must contain at least one message.", "messages")
    if len(request.messages) > MAX_MESSAGES:
        raise invalid(f"messages may hold at most {MAX_MESSAGES} messages.", "messages")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs needs logprobs to be true.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    params = _sampling_params(
        request,
        max_tokens=max_tokens if max_tokens is not None else UNBOUNDED,
        max_tokens_param=max_tokens_param,
        logprobs=logprobs,
    )
    messages = [Message(role=m.role, content=m.text()) for m in request.messages]
    estimate, bound = message_token_estimates(messages)
    return GenerationPlan(
        model=request.model,
        prompts=[GenerateRequest(messages=messages, params=params)],
        n=request.n or 1,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=logprobs,
        estimated_prompt_tokens=estimate,
        max_prompt_tokens=bound,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        priority=request.priority,
    )


def plan_completion(body: bytes) -> GenerationPlan:
    request = decode(body, CompletionRequest)
    _check_common(request)
    if request.echo:
        raise invalid("echo is not supported.", "echo")
    params = _sampling_params(
        request,
        max_tokens=request.max_tokens if request.max_tokens is not None else UNBOUNDED,
        max_tokens_param="max_tokens",
        logprobs=request.logprobs,
    )
    prompts, estimate, bound = _completion_prompts(request.prompt, params)
    return GenerationPlan(
        model=request.model,
        prompts=prompts,
        n=request.n or 1,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=request.logprobs,
        estimated_prompt_tokens=estimate,
        max_prompt_tokens=bound,
        max_tokens=request.max_tokens,
        priority=request.priority,
    )


def message_token_estimates(messages: list[Message]) -> tuple[int, int]:
    """The likely and the largest token count of a chat prompt (see CHARS_PER_TOKEN)."""
    likely = sum(len(m.content) // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE for m in messages)
    bound = MAX_TEMPLATE_TOKENS + sum(
        len(m.content.encode()) + len(m.role) + MAX_TEMPLATE_TOKENS_PER_MESSAGE for m in messages
    )
    return likely, bound


def _completion_prompts(
    prompt: str | list[str | int], params: SamplingParams
) -> tuple[list[GenerateRequest], int, int]:
    """The engine requests, one per prompt, and the likely and largest token count of all."""
    if isinstance(prompt, str):
        texts: list[str] = [prompt]
    elif prompt and all(isinstance(item, int) for item in prompt):
        requests = [GenerateRequest(prompt_token_ids=list(prompt), params=params)]
        return requests, len(prompt), len(prompt)
    elif prompt and all(isinstance(item, str) for item in prompt):
        texts = list(prompt)
    else:
        raise invalid(
            "prompt must be a string, a non-empty list of strings or a list of token ids.",
            "prompt",
        )
    if len(texts) > MAX_CHOICES:
        raise invalid(f"prompt may hold at most {MAX_CHOICES} strings.", "prompt")
    if not all(texts):
        raise invalid("prompt must not be empty.", "prompt")
    requests = [GenerateRequest(prompt=text, params=params) for text in texts]
    likely = sum(len(text) // CHARS_PER_TOKEN + 1 for text in texts)
    # a tokenizer may add a beginning-of-sequence token or two
    return requests, likely, sum(len(text.encode()) + 2 for text in texts)


@dataclass(frozen=True)
class Reservation:
    """Tokens a plan may use, for admission: ``tokens`` (at most: held against the budgets
    until the request settles with the engine's count) and ``likely_tokens`` (more than a
    limit, and no wait would ever admit it)."""

    tokens: int
    likely_tokens: int


def finalize_max_tokens(plan: GenerationPlan, max_context: int) -> Reservation:
    """Give every request its max_tokens (as asked, else the whole context: the engine stops
    at its context length) and return the tokens to reserve for the whole plan. A max_tokens
    above the context can never be served: a 400, as OpenAI and vLLM answer it."""
    if plan.max_tokens is not None and plan.max_tokens > max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {plan.max_tokens} tokens for the completion. Please reduce "
            f"{plan.max_tokens_param}.",
            code="context_length_exceeded",
            param=plan.max_tokens_param,
        )
    max_tokens = plan.max_tokens or max_context
    for request in plan.prompts:
        request.params.max_tokens = max_tokens
    num_choices = plan.n * len(plan.prompts)
    if plan.max_tokens is not None:
        completion = likely_completion = plan.max_tokens * num_choices
    else:
        # up to the context, less the prompt (each prompt's own share of it at most)
        completion = max_context * num_choices
        likely_completion = max(0, max_context - plan.estimated_prompt_tokens) * num_choices
    return Reservation(
        tokens=plan.max_prompt_tokens + completion,
        likely_tokens=plan.estimated_prompt_tokens + likely_completion,
    )
