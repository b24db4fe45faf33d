"""Finding the field of a client's JSON that holds a lone surrogate."""

import pytest

from config.json_text import describe_lone_surrogate, lone_surrogate_path


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        (rb'{"stop": ["a", "b\udfff"]}', "stop[1]"),
        (rb'{"a": {"b": [1, {"c": "\uDC00"}]}}', "a.b[1].c"),
        (rb'"\ud800"', "$"),
        (rb'{"ok": "x", "k\ud800": 1}', "k\\ud800"),  # a key, shown escaped
        ('{"content": "\\ud800 as str"}', "content"),
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
