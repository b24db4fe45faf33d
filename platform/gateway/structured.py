"""What a chat or completion request asks of its output's form: ``response_format``, vLLM's
``structured_outputs``, and ``tools`` with ``tool_choice``, turned into the engine's
``StructuredOutputsParams`` and a ``ToolPlan`` the response is read back with.

``tool_choice`` as OpenAI defines it: ``none`` (the model is not shown the tools), ``auto`` (it
may call them; its output is parsed for calls), ``required`` (it must call at least one) and a
named function (it must call that one). The last two are enforced by guided decoding, so their
arguments always parse: a named call's output *is* its arguments object; a required call's is a
JSON array of ``{"name", "arguments"}``, one item unless ``parallel_tool_calls``.
"""

import json
from dataclasses import dataclass, field

import msgspec

from config.json_text import NUL
from gateway import schemas
from gateway.errors import invalid
from inference_engine.protocol import Message, StructuredOutputsParams, ToolCall

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# a function without parameters takes an empty object
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a response's text is read back as tool calls."""

    mode: str  # "auto", "required" or "named"
    function_names: list[str] = field(default_factory=list)
    named: str | None = None  # the function of a named tool_choice
    is_parallel: bool = True  # False (``parallel_tool_calls: false``): one call at most


def tool_plan(request: schemas.ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; None when no tool may be called (no tools, or ``none``)."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is not None and not request.tools and choice != "none":
        raise invalid("tool_choice is only allowed when tools are specified.", "tool_choice")
    if request.parallel_tool_calls is not None and request.tools is None:
        raise invalid(
            "parallel_tool_calls is only allowed when tools are specified.", "parallel_tool_calls"
        )
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must have distinct function names.", "tools")
    if not tools or choice == "none":
        return None
    if isinstance(choice, schemas.NamedToolChoice):
        if choice.function.name not in names:
            raise invalid(
                f"tool_choice names the function '{choice.function.name}', which is not "
                "among tools.",
                "tool_choice",
            )
        return ToolPlan("named", names, named=choice.function.name)
    return ToolPlan(choice or "auto", names, is_parallel=request.parallel_tool_calls is not False)


def engine_tools(request: schemas.ChatCompletionRequest, plan: ToolPlan | None) -> list | None:
    """The tools shown to the model through its chat template (none for ``tool_choice:
    none``)."""
    if plan is None:
        return None
    return msgspec.to_builtins(request.tools)


def constraint(
    request: schemas.ChatCompletionRequest | schemas.CompletionRequest,
    plan: ToolPlan | None = None,
) -> StructuredOutputsParams | None:
    """The engine's constraint for the request's output, from at most one of
    ``response_format``, ``structured_outputs`` and a forcing ``tool_choice``."""
    source = constraint_source(request, plan)
    if source is None:
        return None
    response_format = request.response_format
    if source == "tool_choice":
        return StructuredOutputsParams(json=json.dumps(_tool_call_schema(request, plan)))
    if source == "structured_outputs":
        return _vllm_constraint(request.structured_outputs)
    if isinstance(response_format, schemas.JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema.schema
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=json.dumps(schema))


def constraint_source(
    request: schemas.ChatCompletionRequest | schemas.CompletionRequest,
    plan: ToolPlan | None = None,
) -> str | None:
    """The field the output's constraint comes from: ``response_format``,
    ``structured_outputs`` or ``tool_choice`` (the tools' parameters); None for none."""
    sources = []
    response_format = request.response_format
    if response_format is not None and not isinstance(response_format, schemas.TextFormat):
        sources.append("response_format")
    if request.structured_outputs is not None:
        sources.append("structured_outputs")
    if plan is not None and plan.mode in ("required", "named"):
        sources.append("tool_choice")
    if len(sources) > 1:
        raise invalid(f"Give only one of {', '.join(sources)}.", sources[-1])
    return sources[0] if sources else None


def _vllm_constraint(value: schemas.StructuredOutputs) -> StructuredOutputsParams:
    given = [name for name in ("json", "regex", "choice", "grammar") if getattr(value, name)]
    if len(given) != 1:
        raise invalid(
            "structured_outputs takes exactly one of json, regex, choice, grammar.",
            "structured_outputs",
        )
    if value.json is not None:
        return StructuredOutputsParams(json=json.dumps(value.json))
    return StructuredOutputsParams(regex=value.regex, choice=value.choice, grammar=value.grammar)


def _tool_call_schema(request: schemas.ChatCompletionRequest, plan: ToolPlan) -> dict:
    parameters = {
        tool.function.name: tool.function.parameters or NO_PARAMETERS for tool in request.tools
    }
    if plan.mode == "named":
        return parameters[plan.named]
    roots: dict[str, dict] = {}
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _rooted(schema, n, roots)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n, (name, schema) in enumerate(parameters.items())
        ]
    }
    array = {"type": "array", "items": calls, "minItems": 1}
    if roots:
        array["$defs"] = roots
    if request.parallel_tool_calls is False:
        array["maxItems"] = 1
    return array


def _rooted(schema: dict, index: int, roots: dict[str, dict]) -> dict:
    """A tool's parameters as they sit inside the schema of every call: as they are, or,
    where they refer to themselves (``$ref``: "#/$defs/Address", as pydantic writes nested
    models), kept whole under the root's ``$defs`` with their references rewritten to point
    there. Inside the array, "#/$defs/Address" would name the array's own, which is none."""
    if '"$ref"' not in json.dumps(schema):
        return schema
    root = f"tool_{index}"
    roots[root] = _references_moved(schema, f"#/$defs/{root}")
    return {"$ref": f"#/$defs/{root}"}


def _references_moved(node: object, root: str) -> object:
    if isinstance(node, dict):
        return {
            key: root + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _references_moved(value, root)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_references_moved(item, root) for item in node]
    return node


def engine_messages(request: schemas.ChatCompletionRequest) -> list[Message]:
    """The conversation as the engine takes it, tool turns and earlier calls included."""
    messages = []
    open_calls: set[str] = set()  # the ids of the calls a tool message may answer here
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        if message.role == "tool" and not message.tool_call_id:
            raise invalid("A tool message needs the tool_call_id it answers.", where)
        if message.role == "tool":
            _check_answers_a_call(message.tool_call_id, open_calls, where)
        else:
            open_calls = {call.id for call in message.tool_calls or ()}
        if message.tool_calls and message.role != "assistant":
            raise invalid("Only assistant messages may carry tool_calls.", f"{where}.tool_calls")
        if message.content is None and not (
            message.role == "assistant" and (message.tool_calls or message.refusal is not None)
        ):
            raise invalid(
                "content may be null only on an assistant message with tool_calls or a refusal.",
                f"{where}.content",
            )
        if message.role != "assistant" and (
            message.refusal is not None
            or (
                isinstance(message.content, list)
                and any(isinstance(part, schemas.RefusalPart) for part in message.content)
            )
        ):
            raise invalid("Only assistant messages may carry a refusal.", f"{where}.content")
        calls = [
            ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls or ()
        ]
        messages.append(
            Message(
                # OpenAI's newer name for the system's instructions; chat templates know
                # "system" only
                role="system" if message.role == "developer" else message.role,
                content=message.text(),
                tool_calls=calls or None,
                tool_call_id=message.tool_call_id,
                name=message.name,
            )
        )
    return messages


def _check_answers_a_call(call_id: str, open_calls: set[str], where: str) -> None:
    """OpenAI's rule: a tool message answers a call of the assistant message with
    ``tool_calls`` that it follows (after other answers to it)."""
    if not open_calls:
        raise invalid(
            "A message with role 'tool' must answer a preceding assistant message with tool_calls.",
            where,
        )
    if call_id not in open_calls:
        raise invalid(
            f"The tool_call_id {call_id[:64]!r} answers none of the tool_calls of the "
            "assistant message before it.",
            f"{where}.tool_call_id",
        )


def extra_prompt_text(request: schemas.ChatCompletionRequest, tools: list | None) -> str:
    """The prompt's text beyond the messages' contents (tool definitions, earlier calls'
    arguments), for the token estimate."""
    parts = [json.dumps(tools)] if tools else []
    for message in request.messages:
        for call in message.tool_calls or ():
            parts.append(call.function.name + call.function.arguments)
    return "".join(parts)


def logit_bias(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) as the engine takes it."""
    if value is None:
        return None
    bias = {}
    for key, number in value.items():
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise invalid(f"logit_bias keys must be token ids; got {key!r}.", "logit_bias")
        bias[int(key)] = number
    return bias


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs.", "metadata")
    for key, value in metadata.items():
        if NUL in key or NUL in value:  # stored on the usage record, whose text refuses it
            raise invalid("metadata must not contain the NUL character (\\u0000).", "metadata")
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid(
                f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters and "
                f"values {MAX_METADATA_VALUE_CHARS}.",
                "metadata",
            )
