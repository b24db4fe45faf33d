"""From a request body to a ``GenerationPlan`` (the engine requests, one per choice), or a
400 that names the offending ``param``."""

import re
from dataclasses import dataclass, field

import msgspec

from config.json_text import NUL, describe_nesting
from gateway import structured
from gateway.errors import ApiError, invalid
from gateway.schemas import (
    COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway.structured import ToolPlan
from inference_engine.protocol import MAX_TOOLS, GenerateRequest, InvalidParam, SamplingParams
from serving.budget import PromptTokens, message_tokens, text_tokens, token_id_tokens
from serving.runs import RunSpec

MAX_STOP = 4
MAX_MESSAGES = 1024
MAX_USER_CHARS = 256

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_FIELD = "Object contains unknown field"
_FIELD = re.compile(r"field `([^`]+)`")
# where the API calls a sampling parameter otherwise (the constraint: ``_constraint_names``)
_API_PARAM = {"logprobs": "top_logprobs"}


@dataclass
class GenerationPlan:
    """What one API request asks the engine for: one engine request per choice."""

    model: str
    prompts: list[GenerateRequest]  # one per prompt, before the fan-out by n
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    prompt_tokens: PromptTokens  # of all the prompts, before the engine counts them
    # completions' echo: each choice's text (and logprobs) begins with its prompt's; with
    # max_tokens 0 (``echo_only``) it is the prompt's alone, the one token drawn left out
    echo: bool = False
    echo_only: bool = False
    max_tokens_param: str = "max_tokens"  # what the request called it
    priority: int | None = None  # as asked; the plan's tier is the floor (see serving.runs)
    # the request's names of the engine's fields an engine refusal may name: the constraint
    # is the request's response_format, structured_outputs or tools
    param_names: dict[str, str] = field(default_factory=dict)
    tool_plan: ToolPlan | None = None  # how the output is read back as tool calls
    user: str | None = None  # the caller's end user, stored on the usage record
    metadata: dict[str, str] | None = None  # stored on the usage record

    def run_spec(self, response_id: str, attempt: int = 0) -> RunSpec:
        """The run of this request; its usage record is filed under ``response_id``. A later
        ``attempt`` under the same id (a batch line owed its answer) gets engine requests of
        its own: the last try's may still run on the engine, which refuses an id in use."""
        requests = self.engine_requests(response_id)
        if attempt:
            for request in requests:
                request.request_id = f"{request.request_id}.{attempt}"
        return RunSpec(
            request_id=response_id,
            requests=requests,
            prompt_tokens=self.prompt_tokens,
            max_tokens_name=self.max_tokens_param,
            choices_per_prompt=self.n,
            priority=self.priority,
            end_user=self.user,
            metadata=self.metadata,
            param_names=self.param_names,
        )

    def engine_requests(self, response_id: str) -> list[GenerateRequest]:
        """One engine request per choice, ``n`` of each prompt in a row; a choice's seed is
        offset so that the ``n`` samples differ. Only the first of a prompt's choices asks for
        its logprobs and text (an echo's): they are the same for all, and computing them
        skips the prefix cache."""
        requests = []
        for prompt_index, prompt in enumerate(self.prompts):
            for sample in range(self.n):
                params = msgspec.structs.replace(prompt.params)
                if params.seed is not None and sample:
                    params.seed += sample
                request_id = f"{response_id}-{prompt_index * self.n + sample}"
                request = msgspec.structs.replace(prompt, params=params, request_id=request_id)
                if sample:  # an echo's prompt comes from the prompt's first choice alone
                    params.prompt_logprobs, request.return_prompt_text = None, False
                requests.append(request)
        return requests


def decode(body: bytes, request_type: type) -> msgspec.Struct:
    if not body:
        raise invalid("The request body is empty; send a JSON object.")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith(_UNKNOWN_FIELD) and not _PATH.search(message):
            unrecognized = _unrecognized(body, request_type)
            if unrecognized is not None:
                raise unrecognized from exc
        param = _param_of(message)
        if (part := _UNREAD_PART.match(message)) and param and param.endswith(".type"):
            message = (
                f"Content of type '{part.group(1)}' is not supported by this server: its "
                "models read text only (send 'text' parts, or a string)."
            )
        raise invalid(message, param=param) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # json_body caps the depth; a batch line stored before did not
        raise invalid(describe_nesting()) from exc
    except UnicodeDecodeError as exc:
        raise invalid(
            f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}."
        ) from exc


def _unrecognized(body: bytes, request_type: type) -> ApiError | None:
    """Every unknown field of the request, as OpenAI names them (msgspec stops at the
    first); None where the body cannot be read whole (nested past the parser's depth)."""
    known = {field.encode_name for field in msgspec.structs.fields(request_type)}
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    unknown = sorted(key for key in fields if key not in known)
    plural = "s" if len(unknown) > 1 else ""
    return invalid(
        f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}", param=unknown[0]
    )


# a content part's type for what a text model cannot read: images, audio, files
_UNREAD_PART = re.compile(r"^Invalid value '(\w+)' - at `\$\.messages\[\d+\]\.content\[\d+\]")


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
    # stored on the usage record or looked up in the database, whose text refuses NUL
    for name, value in (("model", request.model), ("user", request.user)):
        if value is not None and NUL in value:
            raise invalid(f"{name} must not contain the NUL character (\\u0000).", name)
    if request.stop is not None:
        stops = [request.stop] if isinstance(request.stop, str) else request.stop
        if len(stops) > MAX_STOP or not all(stops):
            raise invalid(f"stop must be a non-empty string or up to {MAX_STOP} of them.", "stop")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true.", "stream_options")
    if request.user is not None and len(request.user) > MAX_USER_CHARS:
        raise invalid(f"user must be at most {MAX_USER_CHARS} characters.", "user")
    structured.check_metadata(request.metadata)


def _sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    tool_plan: ToolPlan | None = None,
) -> SamplingParams:
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    # a nucleus of 0 holds the likeliest token alone (OpenAI takes 0): greedy sampling
    is_greedy = request.top_p == 0
    values = {
        "temperature": 0.0 if is_greedy else request.temperature,
        "top_p": None if is_greedy else request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "seed": request.seed,
        "min_tokens": request.min_tokens,
        "stop": stop,
        "ignore_eos": request.ignore_eos,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": _skips_special_tokens(request, tool_plan),
        "logprobs": logprobs,
        "logit_bias": structured.logit_bias(request.logit_bias),
        "structured_outputs": structured.constraint(request, tool_plan),
    }
    given = {name: value for name, value in values.items() if value is not None}
    try:
        # max_tokens unset (None) is up to the context length
        return SamplingParams(max_tokens=max_tokens, **given)
    except InvalidParam as exc:
        names = _API_PARAM | _constraint_names(request, tool_plan)
        param = max_tokens_param if exc.field == "max_tokens" else names.get(exc.field)
        message = str(exc)
        if param is not None:  # the API's name for it
            message = message.replace(exc.field, param, 1)
        raise invalid(message, param or exc.field) from exc


def _skips_special_tokens(
    request: ChatCompletionRequest | CompletionRequest, tool_plan: ToolPlan | None
) -> bool | None:
    """The request's ``skip_special_tokens``; unset where the model may call tools at will, it
    is off: the calls' tags are special tokens in some models (Hermes 2 Pro's), and the reader
    must see them in the text (vLLM's Hermes parser turns it off too)."""
    if request.skip_special_tokens is None and tool_plan is not None and tool_plan.mode == "auto":
        return False
    return request.skip_special_tokens


def _not_supported(message: str, param: str) -> ApiError:
    return invalid(f"{message} is not supported by this server.", param)


def _check_chat_extras(request: ChatCompletionRequest) -> None:
    """OpenAI's fields for what this server does not do: a 400 that says so, unless they ask
    for nothing (text output, no audio or web search, the default verbosity)."""
    if request.modalities is not None and set(request.modalities) - {"text"}:
        raise _not_supported("Output other than text", "modalities")
    if request.audio is not None:
        raise _not_supported("Audio output", "audio")
    for name in ("functions", "function_call"):
        if getattr(request, name) is not None:
            raise invalid(f"{name} is not supported by this server: use tools.", name)
    if request.web_search_options is not None:
        raise _not_supported("Web search", "web_search_options")
    if request.verbosity not in (None, "medium"):
        raise _not_supported("A verbosity other than medium", "verbosity")


def plan_chat(body: bytes) -> GenerationPlan:
    request = decode(body, ChatCompletionRequest)
    _check_common(request)
    _check_chat_extras(request)
    if not request.messages:
        raise invalid("messages must contain at least one message.", "messages")
    if len(request.messages) > MAX_MESSAGES:
        raise invalid(f"messages may hold at most {MAX_MESSAGES} messages.", "messages")
    if request.tools is not None and len(request.tools) > MAX_TOOLS:
        raise invalid(f"tools may hold at most {MAX_TOOLS} tools.", "tools")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("top_logprobs needs logprobs to be true.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    tool_plan = structured.tool_plan(request)
    params = _sampling_params(
        request,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=logprobs,
        tool_plan=tool_plan,
    )
    messages = structured.engine_messages(request)
    tools = structured.engine_tools(request, tool_plan)
    prompt_tokens = message_tokens(messages)
    if extra := structured.extra_prompt_text(request, tools):
        prompt_tokens += text_tokens(extra)
    return GenerationPlan(
        model=request.model,
        prompts=[GenerateRequest(messages=messages, params=params, tools=tools)],
        n=request.n or 1,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=logprobs,
        prompt_tokens=prompt_tokens,
        max_tokens_param=max_tokens_param,
        priority=request.priority,
        tool_plan=tool_plan,
        user=request.user,
        metadata=request.metadata,
        param_names=_constraint_names(request, tool_plan),
    )


def _constraint_names(
    request: ChatCompletionRequest | CompletionRequest, tool_plan: structured.ToolPlan | None
) -> dict[str, str]:
    source = structured.constraint_source(request, tool_plan)
    if source is None:
        return {}
    return {"structured_outputs": "tools" if source == "tool_choice" else source}


def plan_completion(body: bytes) -> GenerationPlan:
    request = decode(body, CompletionRequest)
    _check_common(request)
    if request.suffix:
        raise _not_supported("suffix", "suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise _not_supported("best_of other than n", "best_of")
    echo = bool(request.echo)
    # unset or null: the API's default, not up to the context as a chat's
    max_tokens = COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    echo_only = max_tokens == 0
    if echo_only and not echo:
        raise invalid("max_tokens must be at least 1 (0 only with echo).", "max_tokens")
    params = _sampling_params(
        request,
        max_tokens=max(max_tokens, 1),  # an echo alone still draws one token: the engine's least
        max_tokens_param="max_tokens",
        logprobs=request.logprobs,
    )
    if echo and request.logprobs is not None:
        params.prompt_logprobs = request.logprobs
    prompts, prompt_tokens = _completion_prompts(request.prompt, params, echo=echo)
    return GenerationPlan(
        model=request.model,
        prompts=prompts,
        n=request.n or 1,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=request.logprobs,
        prompt_tokens=prompt_tokens,
        echo=echo,
        echo_only=echo_only,
        priority=request.priority,
        user=request.user,
        metadata=request.metadata,
        param_names=_constraint_names(request, None),
    )


def _completion_prompts(
    prompt: str | list[str | int | list[int]], params: SamplingParams, *, echo: bool = False
) -> tuple[list[GenerateRequest], PromptTokens]:
    """The engine requests, one per prompt, and the token count of all the prompts. An echo
    of token ids asks the engine for their text (a text prompt is echoed as it was sent)."""
    requests, counts = [], []
    for each in _split_prompts(prompt):
        if isinstance(each, str):
            requests.append(GenerateRequest(prompt=each, params=params))
            counts.append(text_tokens(each))
        else:
            requests.append(
                GenerateRequest(prompt_token_ids=each, params=params, return_prompt_text=echo)
            )
            counts.append(token_id_tokens(each))
    return requests, sum(counts, PromptTokens(0, 0))


def _split_prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request, as OpenAI and vLLM read ``prompt``: a string or a
    list of token ids is one prompt; a list of strings or of token id lists is one each."""
    if isinstance(prompt, str) or (prompt and all(isinstance(item, int) for item in prompt)):
        prompts = [prompt]
    elif prompt and (
        all(isinstance(item, str) for item in prompt)
        or all(isinstance(item, list) for item in prompt)
    ):
        prompts = prompt
    else:
        raise invalid(
            "prompt must be a string, a list of token ids, or a non-empty list of strings or "
            "of token id lists (not a mix of them).",
            "prompt",
        )
    if len(prompts) > MAX_CHOICES:
        raise invalid(f"prompt may hold at most {MAX_CHOICES} prompts.", "prompt")
    if not all(prompts):
        raise invalid("prompt must not be empty, nor hold an empty prompt.", "prompt")
    return prompts
