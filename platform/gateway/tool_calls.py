"""Reading a model's output back as OpenAI tool calls, whole or as it streams.

One ``ToolCallReader`` per choice, fed the choice's text deltas. By the request's
``ToolPlan`` mode:

- ``named``: the output is the named function's arguments (guided decoding made it parse):
  one call, its arguments streamed piece by piece as they come.
- ``required``: the output is a JSON array of ``{"name", "arguments"}`` (guided too): read at
  the end, one call per item.
- ``auto``: the model writes calls in its chat template's convention, for now the Hermes/Qwen
  one, ``<tool_call>{"name": …, "arguments": …}</tool_call>``; text outside the tags is the
  message's content, streamed as it comes, with any tail that might open a tag held back.
  A block that does not parse as a call stays content, as vLLM does; with
  ``parallel_tool_calls: false``, a call after the first is dropped, as OpenAI gives one.

A reader gives ``ReadPiece``s: content text, or a tool call's delta.
"""

import json
import uuid
from dataclasses import dataclass

from gateway.errors import invalid
from gateway.structured import ToolPlan
from serving.pool import get_pool

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


async def check_auto_tool_choice(plan: ToolPlan | None, endpoints: list[str]) -> None:
    """Refuse (400) tools the model may call at will where its calls cannot be read back: its
    chat template writes them in no convention the API parses, so they would come back as the
    message's text, and an agent would take them for the answer. vLLM refuses them too (its
    ``--tool-call-parser``); a named function or ``required`` still works (guided decoding).
    Where no replica has said yet, the run finds out (and reads no calls)."""
    if plan is None or plan.mode != "auto":
        return
    if await get_pool().tool_call_parser(endpoints) == "":
        raise invalid(
            'tool_choice "auto" is not supported for this model: its chat template writes '
            "tool calls in no format this server reads. Name a function in tool_choice, or "
            'use "required".',
            "tool_choice",
        )


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class CallDelta:
    """A piece of call ``index``: the first piece has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class FullCall:
    id: str
    name: str
    arguments: str


class ToolCallReader:
    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.parser = parser  # the model's convention for auto: "hermes", or "" (none)
        self.calls: list[FullCall] = []
        self._buffer = ""  # text not yet given out (auto: a possible tag; required: all)
        self._content: list[str] = []
        # The text between two calls (or before the first, after the last) is content unless
        # it is all whitespace. Streamed, whitespace that opens such a stretch is held until
        # text (content) or a call (none) decides, so the stream reads as the whole answer.
        self._space = ""
        self._stretch_has_text = False

    @property
    def content(self) -> str | None:
        """The message's content: what was not a call (None when that is nothing)."""
        text = "".join(self._content)
        return text if text.strip() or not self.calls else None

    def feed(self, text: str) -> list[str | CallDelta]:
        mode = self.plan.mode
        if mode == "named":
            return self._feed_named(text)
        if mode == "required":
            self._buffer += text  # one JSON array: read whole at the end
            return []
        if not self.parser:  # calls this model writes cannot be told from text
            return _given([self._say(text)])
        self._buffer += text
        return _given(self._read_hermes(final=False))

    def finish(self) -> list[str | CallDelta]:
        """Whatever is left, once the output is complete."""
        pieces: list[str | CallDelta] = []
        if self.plan.mode == "required":
            pieces = self._read_required()
        elif self.plan.mode == "auto" and self.parser:
            pieces = self._read_hermes(final=True)
        if self._space and not self.calls:  # an answer of whitespace is its content
            self._content.append(self._space)
            pieces.append(self._space)
        self._space = ""
        return _given(pieces)

    def _feed_named(self, text: str) -> list[str | CallDelta]:
        pieces: list[str | CallDelta] = []
        if not self.calls:
            self.calls.append(FullCall(new_call_id(), self.plan.named, ""))
            pieces.append(CallDelta(0, id=self.calls[0].id, name=self.plan.named))
        if text:
            self.calls[0].arguments += text
            pieces.append(CallDelta(0, arguments=text))
        return pieces

    def _read_required(self) -> list[str | CallDelta]:
        text, self._buffer = self._buffer, ""
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):  # nested past the parser's depth: not a call
            items = None
        if not isinstance(items, list) or not all(_is_call(item) for item in items):
            return [self._say(text)]  # cut short (max_tokens): the text as it is
        return [self._add_call(item["name"], item["arguments"]) for item in items]

    def _read_hermes(self, *, final: bool) -> list[str | CallDelta]:
        pieces: list[str | CallDelta] = []
        while self._buffer:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _possible_prefix(self._buffer, CALL_OPEN)
                text = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(text) :]
                if text:
                    pieces.append(self._say(text))
                break
            if start:
                pieces.append(self._say(self._buffer[:start]))
                self._buffer = self._buffer[start:]
                continue
            end = self._buffer.find(CALL_CLOSE)
            if end < 0:
                if final:  # an unclosed block: content, as written
                    pieces.append(self._say(self._buffer))
                    self._buffer = ""
                break
            block = self._buffer[len(CALL_OPEN) : end]
            whole = self._buffer[: end + len(CALL_CLOSE)]
            self._buffer = self._buffer[end + len(CALL_CLOSE) :]
            call = _parse_call(block)
            if call is None or call["name"] not in self.plan.function_names:
                pieces.append(self._say(whole))
            elif self.calls and not self.plan.is_parallel:
                continue  # one call was asked for at most: the model's second is dropped
            else:
                pieces.append(self._add_call(call["name"], call["arguments"]))
        return pieces

    def _say(self, text: str) -> str:
        if not self._stretch_has_text and not text.strip():
            self._space += text
            return ""
        text, self._space, self._stretch_has_text = self._space + text, "", True
        self._content.append(text)
        return text

    def _add_call(self, name: str, arguments: object) -> CallDelta:
        self._space, self._stretch_has_text = "", False  # whitespace alone is no content
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = FullCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return CallDelta(len(self.calls) - 1, id=call.id, name=name, arguments=arguments)


def _given(pieces: list[str | CallDelta]) -> list[str | CallDelta]:
    return [piece for piece in pieces if piece != ""]


def _is_call(item: object) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item


def _parse_call(block: str) -> dict | None:
    try:
        call = json.loads(block)
    except (ValueError, RecursionError):  # nested past the parser's depth: not a call
        return None
    if isinstance(call, dict) and "parameters" in call and "arguments" not in call:
        call["arguments"] = call.pop("parameters")  # a common variant
    if not _is_call(call):
        return None
    return call


def _possible_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that could start ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
