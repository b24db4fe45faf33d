"""The API's request and response bodies as msgspec structs.

Requests are decoded straight into these types (unknown fields are refused, as OpenAI does);
the OpenAPI document is generated from the same structs, so it cannot drift from what the
API accepts. Checks that types cannot express live in ``gateway.validation``.
"""

from typing import Annotated, Literal

import msgspec

# Integer and number bounds as the engine and OpenAI's API take them. A value outside one is
# a 400 naming its field, before anything is encoded for the engine (msgpack cannot carry
# an integer past 64 bits). Bounds that depend on the model (token ids below the vocabulary,
# top_k up to it, max_tokens up to the context) are checked once the model is known.
INT32_MAX = 2**31 - 1
MAX_CHOICES = 16
MAX_LOGPROBS = 20
# OpenAI's legacy Completions API and vLLM stop a completion here unless asked for more (a
# chat goes on up to the context)
COMPLETION_MAX_TOKENS = 16
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
# a completion's max_tokens: 0 only with echo (the prompt's logprobs, nothing generated)
CompletionTokenCount = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=INT32_MAX)]
Choices = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # OpenAI's padding of streamed events against length side channels: accepted, not done
    include_obfuscation: bool | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    text: str


class RefusalPart(msgspec.Struct, forbid_unknown_fields=True, tag="refusal", tag_field="type"):
    """An assistant's refusal, as OpenAI's answers carry it and SDKs send it back."""

    refusal: str


ContentPart = TextPart | RefusalPart


# A message is read leniently, as vLLM reads it: clients send back the assistant messages the
# SDK gave them, with what the SDK adds (``parsed``, ``parsed_arguments``, ``annotations``,
# ``audio``, ``function_call``), and the model is shown none of it.


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON, as the model wrote it


class MessageToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only on an assistant turn that calls tools or refused
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool turn answers
    refusal: str | None = None  # an assistant's refusal, echoed back by SDKs

    def text(self) -> str:
        """What the model is shown of the turn: its text, or what it refused with."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(
            part.text if isinstance(part, TextPart) else part.refusal for part in self.content
        )


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    schema: dict | None = None  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(
    msgspec.Struct, forbid_unknown_fields=True, tag="json_object", tag_field="type"
):
    pass


class JsonSchemaResponseFormat(
    msgspec.Struct, forbid_unknown_fields=True, tag="json_schema", tag_field="type"
):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's extension: constrain the output to a JSON schema, a regex, one of some strings
    or an EBNF grammar (exactly one)."""

    json: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _GenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Optional fields also accept null, as OpenAI's API does; null means the default.
    model: str
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None  # 0: the likeliest token alone, as greedy sampling
    n: Choices | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    # The engine's extras, as vLLM accepts them.
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=INT32_MAX)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None  # stop at any of these tokens too
    include_stop_str_in_output: bool | None = None  # keep the stop string that ended it
    # special tokens the model writes are left out of the text (vLLM's default: true)
    skip_special_tokens: bool | None = None
    # vLLM's: lower values are served first; a caller may only lower its plan's priority
    priority: Priority | None = None
    # token id (as a string, JSON's keys) -> a bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    # stored on the usage record: up to 16 string pairs, as OpenAI takes them
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # accepted for compatibility and ignored: every request is served at its plan's tier and
    # nothing is stored beyond the usage record
    service_tier: str | None = None
    store: bool | None = None
    # OpenAI's cache routing hint and end-user id for abuse detection: accepted and ignored
    # (each tenant's prefix cache is its own already; the usage record names the key)
    prompt_cache_key: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    safety_identifier: Annotated[str, msgspec.Meta(max_length=1024)] | None = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, for what this server does not do: taken where they ask for nothing (null,
    # text output, the default verbosity), else a 400 that says so (``gateway.validation``)
    modalities: list[str] | None = None
    audio: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    web_search_options: dict | None = None
    verbosity: str | None = None
    # OpenAI's predicted output: a hint that only speeds its answer up; accepted and ignored
    prediction: dict | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    # A string, a list of token ids, or a list of strings or of token id lists (one choice set
    # each). One list type holds them all (msgspec decodes a union with one array type only);
    # gateway.validation refuses a mix.
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: CompletionTokenCount | None = COMPLETION_MAX_TOKENS
    logprobs: Logprobs | None = None
    # the prompt before the completion, in its text and (with logprobs) its tokens' logprobs
    echo: bool | None = None
    # taken where they ask for nothing (no suffix; best_of the same as n), else a 400
    suffix: str | None = None
    best_of: Choices | None = None


# --- Responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallFunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first of a call carries its ``id``, ``type`` and
    name; later ones add to its ``arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    # null for an echoed prompt's first token (nothing comes before it), as OpenAI's
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
