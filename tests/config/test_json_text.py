"""Finding the field of a client's JSON that holds a lone surrogate."""

import pytest

from config.json_text import (
    MAX_NESTING,
    describe_lone_surrogate,
    lone_surrogate_path,
    nests_too_deeply,
)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        (rb'{"stop": ["a", "b\udfff"]}', "stop[1]"),
        (rb'{"a": {"b": [1, {"c": "\uDC00"}]}}', "a.b[1].c"),
        (rb'"\ud800"', "$"),
        (rb'{"ok": "x", "k\ud800": 1}', "k\\ud800"),  # a key, shown escaped
        ('{"content": "\\ud800 as str"}', "content"),
        (rb'{"a": {"[0]": ["\udfff"]}}', "a.[0][0]"),  # a key that looks like an index
        (rb'[[1], {"": "\ud800"}]', "[1]."),
    ],
)
def test_the_first_lone_surrogate_is_found_by_its_path(raw, path):
    assert lone_surrogate_path(raw) == path
    assert describe_lone_surrogate(path).encode()  # the message itself is valid Unicode


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"emoji": "\ud83d\ude00", "plain": "caf\u00e9"}',  # a pair is one character
        rb'{"escaped backslash": "\\ud800"}',  # the text \ud800, no surrogate
        b'{"not json": "\\ud800',
        b"[" * 100_000 + b'"\\ud800"' + b"]" * 100_000,  # too deep to parse: the decoder says so
        "caf\u00e9".encode(),
    ],
)
def test_text_without_a_lone_surrogate_or_that_is_no_json_gives_none(raw):
    assert lone_surrogate_path(raw) is None


def test_the_search_builds_no_path_but_the_one_it_reports():
    """Every child's path was built before it was looked at: a 3 KB key over a list of 5,000
    numbers made 5,000 copies of it (a 60 KB body with a bad key took a web process from
    127 MB to 567 MB, and about 1 MB would take 100 GB)."""
    import tracemalloc

    key = "k" * 3_000
    raw = ('{"a": "\\ud83d\\ude00", "' + key + '": [' + ",".join(["0"] * 5_000) + "]}").encode()
    tracemalloc.start()
    try:
        assert lone_surrogate_path(raw) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(raw)
    late = raw[:-2] + b', "\\udc00"]}'
    assert lone_surrogate_path(late) == f"{key}[5000]"


def _nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + b"1" + close * depth


@pytest.mark.parametrize(
    ("raw", "too_deep"),
    [
        (_nested(MAX_NESTING), False),
        (_nested(MAX_NESTING + 1), True),
        (_nested(MAX_NESTING + 1, b'{"a":', b"}"), True),
        (b"[" * 50 + _nested(MAX_NESTING - 49, b"{", b"}") + b"]" * 50, True),  # mixed
        (b"[" + b"[]," * 1_000 + b"[]]", False),  # many brackets, two levels
        (b"[" * 100_000, True),  # never closed: the decoder would say so, past the cap first
        # brackets inside strings are text, whatever precedes their quotes
        (b'["' + b"[" * 500 + b'"]', False),
        (rb'["\\"' + b",[" * 101 + b"]" * 102, True),  # the quote after an escaped \\ ends it
        (rb'["\"' + b"[" * 500 + b'"]', False),  # an escaped quote ends none
        (rb'["\\\"' + b"{" * 500 + b'"]', False),  # a backslash, then a quote, escaped
    ],
)
def test_nesting_is_measured_outside_strings(raw, too_deep):
    assert nests_too_deeply(raw) is too_deep
