"""Reading a model's text back as tool calls: Hermes tags (whole and split across deltas at
every point), a required call's JSON array, a named call's arguments streamed as they come."""

import json

import pytest

from gateway.structured import ToolPlan
from gateway.tool_calls import CallDelta, ToolCallReader

AUTO = ToolPlan("auto", ["get_weather", "search"])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = "Let me check. " + CALL + "\n" + CALL.replace("Paris", "Oslo")


def read_all(reader: ToolCallReader, deltas: list[str]) -> list:
    pieces = []
    for delta in deltas:
        pieces += reader.feed(delta)
    return pieces + reader.finish()


def summary(pieces: list) -> tuple[str, list[tuple[int, str | None, str]]]:
    """The content given out, and each call's (index, name, arguments) joined from its
    pieces."""
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list] = {}
    for piece in pieces:
        if isinstance(piece, CallDelta):
            name, arguments = calls.get(piece.index, (None, ""))
            calls[piece.index] = (name or piece.name, arguments + piece.arguments)
    return content, [(i, *calls[i]) for i in sorted(calls)]


def test_hermes_calls_are_read_from_the_whole_text():
    reader = ToolCallReader(AUTO, "hermes")
    content, calls = summary(read_all(reader, [TEXT]))
    assert content == "Let me check. "
    assert [(i, name, json.loads(args)) for i, name, args in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Oslo"}),
    ]
    assert [call.name for call in reader.calls] == ["get_weather", "get_weather"]
    assert reader.content == "Let me check. "
    assert len({call.id for call in reader.calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_hermes_calls_split_across_deltas_read_the_same(size):
    whole = summary(read_all(ToolCallReader(AUTO, "hermes"), [TEXT]))
    deltas = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    pieces = read_all(ToolCallReader(AUTO, "hermes"), deltas)
    assert summary(pieces) == whole
    # no piece of a tag ever went out as content
    assert all("<" not in p for p in pieces if isinstance(p, str))


def test_text_that_only_looks_like_a_tag_start_is_given_out_in_the_end():
    reader = ToolCallReader(AUTO, "hermes")
    assert reader.feed("a < b and <tool") == ["a < b and "]
    assert reader.finish() == ["<tool"]
    assert reader.content == "a < b and <tool" and reader.calls == []


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "search", "arguments": {}}',  # never closed
    ],
)
def test_a_block_that_is_not_a_known_call_stays_content(block):
    reader = ToolCallReader(AUTO, "hermes")
    content, calls = summary(read_all(reader, ["x ", block]))
    assert content == "x " + block and calls == []


def test_a_block_nested_past_the_json_parsers_depth_stays_content():
    """``json.loads`` raises RecursionError, not ValueError, on deep nesting: it escaped the
    reader, and a streamed answer was left hanging."""
    deep = "[" * 5000 + "]" * 5000
    block = f"<tool_call>{deep}</tool_call>"
    reader = ToolCallReader(AUTO, "hermes")
    assert summary(read_all(reader, [block])) == (block, [])
    required = ToolCallReader(ToolPlan("required", ["search"]), "")
    assert summary(read_all(required, [deep])) == (deep, [])


def test_the_parameters_variant_and_string_arguments_are_read():
    reader = ToolCallReader(AUTO, "hermes")
    text = (
        '<tool_call>{"name": "search", "parameters": {"q": "é"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>'
    )
    _, calls = summary(read_all(reader, [text]))
    assert calls == [(0, "search", '{"q": "é"}'), (1, "search", '{"q": 1}')]
    assert reader.content is None  # nothing but calls


def test_without_a_known_convention_auto_output_is_all_content():
    reader = ToolCallReader(AUTO, "")
    assert read_all(reader, [CALL]) == [CALL]
    assert reader.calls == []


def test_a_required_call_array_becomes_calls_and_a_cut_one_stays_text():
    plan = ToolPlan("required", ["get_weather", "search"])
    reader = ToolCallReader(plan, "")
    text = '[{"name": "search", "arguments": {"q": "x"}}, {"name": "get_weather", "arguments": {}}]'
    assert reader.feed(text[:10]) == []
    _, calls = summary(read_all(reader, [text[10:]]))
    assert calls == [(0, "search", '{"q": "x"}'), (1, "get_weather", "{}")]
    cut = ToolCallReader(plan, "")
    assert read_all(cut, ['[{"name": "sea']) == ['[{"name": "sea']
    assert cut.calls == []


def test_a_named_call_streams_its_arguments_as_they_come():
    reader = ToolCallReader(ToolPlan("named", ["get_weather"], named="get_weather"), "")
    first = reader.feed('{"city"')
    assert first[0] == CallDelta(0, id=reader.calls[0].id, name="get_weather")
    assert first[1] == CallDelta(0, arguments='{"city"')
    assert reader.feed(': "Rome"}') == [CallDelta(0, arguments=': "Rome"}')]
    assert reader.finish() == []
    assert reader.calls[0].arguments == '{"city": "Rome"}'
    assert reader.content is None


def test_without_parallel_calls_the_second_call_is_dropped():
    """``parallel_tool_calls: false`` held only for ``required``: in auto mode the model's
    every call came back."""
    reader = ToolCallReader(ToolPlan("auto", AUTO.function_names, is_parallel=False), "hermes")
    content, calls = summary(read_all(reader, [TEXT]))
    assert content == "Let me check. "
    assert [(i, name, json.loads(args)) for i, name, args in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize(
    "deltas",
    [
        [CALL, "Done", ".", "\n\n", "It", " is", " sunny", "."],
        ["\n", CALL, "\n", "Done."],
        ["Hello", " ", "there", " "],
        [" ", "\n"],
    ],
)
def test_streamed_content_reads_as_the_whole_answer(deltas):
    """A delta of whitespace after a call was dropped: "Done.It is sunny." streamed where
    the whole answer read "Done.\\n\\nIt is sunny."; whitespace before the first call was
    streamed as content the whole answer does not have."""
    whole = ToolCallReader(AUTO, "hermes")
    whole_content, whole_calls = summary(read_all(whole, ["".join(deltas)]))
    streamed = ToolCallReader(AUTO, "hermes")
    content, calls = summary(read_all(streamed, deltas))
    assert (content, calls) == (whole_content, whole_calls)
    assert streamed.content == whole.content
