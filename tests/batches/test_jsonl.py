import io
import json

import pytest

from batches.jsonl import InputLineError, iter_lines, split_lines
from tests.batches.conftest import jsonl, request_line


def _error(raw: bytes) -> InputLineError:
    with pytest.raises(InputLineError) as caught:
        list(iter_lines(raw.splitlines(keepends=True)))
    return caught.value


def test_every_request_is_read_in_order_and_blank_lines_are_skipped():
    raw = jsonl([request_line("a")]) + b"\n  \n" + jsonl([request_line("b", url="/v1/completions")])

    lines = list(iter_lines(raw.splitlines(keepends=True)))

    assert [(line.custom_id, line.line_number, line.url) for line in lines] == [
        ("a", 1, "/v1/chat/completions"),
        ("b", 4, "/v1/completions"),
    ]
    assert json.loads(lines[0].body)["max_tokens"] == 4
    assert lines[0].model == request_line("a")["body"]["model"]


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        (b"{not json", "not a JSON object"),
        (b"[1, 2]", "not a JSON object"),
        (jsonl([request_line("")]), "custom_id"),
        (jsonl([request_line(7)]), "custom_id"),
        (jsonl([request_line("x", method="GET")]), "method"),
        (jsonl([request_line("x", url="/v1/embeddings")]), "url"),
        (jsonl([request_line("x", body="hello")]), "body"),
    ],
)
def test_the_first_bad_line_is_named_by_its_number(bad_line, reason):
    raw = jsonl([request_line("a"), request_line("b")]) + bad_line.strip() + b"\n"
    raw += jsonl([request_line("c", method="GET")])

    error = _error(raw)

    assert error.line_number == 3
    assert str(error).startswith("Line 3:") and reason in str(error)


def test_a_custom_id_may_appear_once_per_file():
    error = _error(jsonl([request_line("a"), request_line("b"), request_line("a")]))

    assert error.line_number == 3 and "duplicate custom_id 'a'" in str(error)


def test_a_file_without_requests_is_refused():
    assert "no requests" in str(_error(b"\n\n"))


def test_a_byte_order_mark_at_the_start_of_the_file_is_read_past():
    """Windows' editors write one; the first line was "not a JSON object"."""
    raw = b"\xef\xbb\xbf" + jsonl([request_line("a"), request_line("b")])
    assert [line.custom_id for line in list(iter_lines(raw.splitlines(keepends=True)))] == [
        "a",
        "b",
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1 << 16])
def test_lines_split_at_line_feeds_only(monkeypatch, chunk_bytes):
    """JSON Lines separates documents by LF; a CR is JSON whitespace. Python's file iteration
    (which the upload and the validation used) split a valid line at a CR between tokens."""
    from batches import jsonl as jsonl_module

    monkeypatch.setattr(jsonl_module, "READ_CHUNK_BYTES", chunk_bytes)
    with_cr = jsonl([request_line("a")]).replace(b', "method"', b',\r"method"')
    raw = with_cr + b"\r\n" + jsonl([request_line("b")]).rstrip(b"\n")  # CRLF, no last LF

    lines = list(iter_lines(jsonl_module.split_lines(io.BytesIO(raw))))

    assert [(line.custom_id, line.line_number) for line in lines] == [("a", 1), ("b", 3)]


class EndlessLine:
    """A stream of one line that never ends: what a reader that keeps a whole line would
    run out of memory on."""

    def __init__(self, fill: bytes = b"x") -> None:
        self.num_read = 0
        self.fill = fill

    def read(self, size: int) -> bytes:
        self.num_read += size
        return self.fill * size


def test_a_line_longer_than_a_request_may_be_is_refused_before_it_is_read_whole():
    stream = EndlessLine()
    lines = split_lines(io.BytesIO(b'{"a": 1}\n'), max_line_bytes=8)
    assert list(lines) == [b'{"a": 1}']
    with pytest.raises(InputLineError) as caught:
        list(split_lines(stream, max_line_bytes=1 << 20))
    assert caught.value.line_number == 1 and "longer than 1048576 bytes" in str(caught.value)
    assert stream.num_read < 2 << 20  # it read little more than the limit


def test_the_longest_line_may_end_in_a_carriage_return():
    """A CRLF file's carriage returns are JSON whitespace, not part of the request."""
    lines = split_lines(io.BytesIO(b'{"a": 1}\r\n{"b": 22}\r\n'), max_line_bytes=8)
    assert next(lines) == b'{"a": 1}\r'
    with pytest.raises(InputLineError) as caught:
        next(lines)
    assert caught.value.line_number == 2


@pytest.mark.parametrize("in_one_read", [True, False])
def test_only_one_carriage_return_ends_a_line_within_the_limit(monkeypatch, in_one_read):
    """``rstrip`` took every carriage return off: a request padded with megabytes of them
    passed the line limit, and checking it joined the line so far again at every read (30 MB
    took 11 s of a web worker's thread)."""
    if not in_one_read:
        monkeypatch.setattr("batches.jsonl.READ_CHUNK_BYTES", 4)
    padded = io.BytesIO(b'{"a": 1}' + b"\r" * 2 + b"\n")
    with pytest.raises(InputLineError) as caught:
        list(split_lines(padded, max_line_bytes=8))
    assert caught.value.line_number == 1


@pytest.mark.timeout(10)
def test_a_line_of_carriage_returns_is_refused_as_soon_as_it_passes_the_limit():
    stream = EndlessLine(b"\r")  # was read for ever, the line so far joined at every read
    with pytest.raises(InputLineError):
        list(split_lines(stream, max_line_bytes=1 << 20))
    assert stream.num_read < 2 << 20
