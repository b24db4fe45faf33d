"""A batch input file, checked line by line as OpenAI checks it on upload."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from config.json_text import MAX_NESTING, NUL, nests_too_deeply

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_REQUESTS = 50_000  # OpenAI's limit on the requests of one batch
MAX_CUSTOM_ID_CHARS = 512  # what BatchRequest.custom_id holds
UTF8_BOM = b"\xef\xbb\xbf"


class InputLineError(ValueError):
    """The first line of an input file that is not a valid batch request."""

    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"Line {line_number}: {reason}")
        self.line_number = line_number


@dataclass(frozen=True)
class InputLine:
    line_number: int  # 1-based, as an editor counts
    custom_id: str
    url: str
    body: bytes  # the request's body, compact JSON, its keys in their order
    model: str | None  # the body's model, where it names one as a string


def parse_line(raw: bytes, line_number: int) -> InputLine:
    """One request line, checked as OpenAI checks it and for what the database can store (a
    line it could not store would leave its batch ``validating`` for good)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputLineError(line_number, "not UTF-8 text.") from None
    if nests_too_deeply(raw):
        raise InputLineError(
            line_number, f"arrays and objects nested more than {MAX_NESTING} levels deep."
        )
    try:
        item = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise InputLineError(line_number, "not a JSON object.") from None
    if not isinstance(item, dict):
        raise InputLineError(line_number, "not a JSON object.")
    if b"\\u0000" in raw and _holds_nul(item):
        raise InputLineError(line_number, "the NUL character (\\u0000) cannot be stored.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InputLineError(line_number, "'custom_id' must be a non-empty string.")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InputLineError(
            line_number, f"'custom_id' must be at most {MAX_CUSTOM_ID_CHARS} characters."
        )
    if item.get("method") != "POST":
        raise InputLineError(line_number, "'method' must be \"POST\".")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise InputLineError(line_number, f"'url' must be one of {', '.join(ENDPOINTS)}.")
    body = item.get("body")
    if not isinstance(body, dict):
        raise InputLineError(line_number, "'body' must be a JSON object.")
    model = body.get("model")
    # the body alone is kept, as bytes: a decoded line holds many times its size in objects
    return InputLine(
        line_number=line_number,
        custom_id=custom_id,
        url=url,
        body=msgspec.json.encode(body),
        model=model if isinstance(model, str) else None,
    )


def _holds_nul(value: object) -> bool:
    """Whether a NUL is in any string or key of a decoded JSON document."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if NUL in value:
                return True
        elif isinstance(value, dict):
            if any(NUL in key for key in value):
                return True
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


READ_CHUNK_BYTES = 1 << 16


def split_lines(stream: BinaryIO, max_line_bytes: int | None = None) -> Iterator[bytes]:
    """The stream's lines, split at line feeds only, as JSON Lines separates documents: a
    carriage return is JSON whitespace (a CRLF file's lines keep theirs, which parsing
    ignores), where Python's file iteration would split at it too. Raises ``InputLineError``
    for a line longer than ``max_line_bytes``, before reading the rest of it."""
    start: list[bytes] = []  # the line read so far, in chunks (one line may span many)
    start_bytes = 0
    line_number = 0
    while chunk := stream.read(READ_CHUNK_BYTES):
        *lines, rest = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join([*start, lines[0]])
            for line in lines:
                line_number += 1
                _check_length(line, line_number, max_line_bytes)
                yield line
            start, start_bytes = [], 0
        start.append(rest)
        start_bytes += len(rest)
        if max_line_bytes is not None and start_bytes > max_line_bytes + len(b"\r"):
            _refuse_long(line_number + 1, max_line_bytes)  # it only grows: refused at once
    if tail := b"".join(start):
        _check_length(tail, line_number + 1, max_line_bytes)
        yield tail


def _check_length(line: bytes, line_number: int, max_line_bytes: int | None) -> None:
    # one carriage return ends a CRLF file's line; more are the line's (and count)
    if max_line_bytes is not None and len(line) - line.endswith(b"\r") > max_line_bytes:
        _refuse_long(line_number, max_line_bytes)


def _refuse_long(line_number: int, max_line_bytes: int) -> None:
    raise InputLineError(
        line_number, f"longer than {max_line_bytes} bytes, the most one request may have."
    )


def iter_lines(raw_lines: Iterable[bytes]) -> Iterator[InputLine]:
    """Every request of a file, in order, one at a time; blank lines are skipped. Raises
    ``InputLineError`` for the first bad line, a ``custom_id`` seen before, one request too
    many, or (at the end) a file without requests."""
    custom_ids: set[str] = set()
    for line_number, raw in enumerate(raw_lines, start=1):
        if line_number == 1:
            raw = raw.removeprefix(UTF8_BOM)  # as Windows' editors save UTF-8
        if not raw.strip():
            continue
        line = parse_line(raw, line_number)
        if line.custom_id in custom_ids:
            raise InputLineError(line_number, f"duplicate custom_id '{line.custom_id}'.")
        if len(custom_ids) == MAX_REQUESTS:
            raise InputLineError(line_number, f"a batch holds at most {MAX_REQUESTS} requests.")
        custom_ids.add(line.custom_id)
        yield line
    if not custom_ids:
        raise InputLineError(1, "the file holds no requests.")


def encode_lines(items: Iterable[object]) -> bytes:
    """JSONL: one compact JSON document a line."""
    return b"".join(msgspec.json.encode(item) + b"\n" for item in items)
