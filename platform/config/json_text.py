"""Where a client's JSON holds text that is not Unicode, or nests too deeply to be read.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but no Unicode string. No
UTF-8 encoder, database or tokenizer takes one, so every text a client sends is checked where
it enters (the API's body, the chat socket's frame), once, whatever its field.
``lone_surrogate_path`` names the first field holding one, for the error the client gets.
``nests_too_deeply`` finds a document nested past ``MAX_NESTING``, before a decoder recurses
into it.
"""

import json
import re
from collections.abc import Iterator

import numpy as np

# valid JSON and Unicode, but PostgreSQL's text and jsonb refuse it: stored text must not hold it
NUL = "\x00"

# an escaped surrogate, paired or lone: only a body with one is parsed again
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(raw: bytes | str) -> str | None:
    """The path (``messages[0].content``, ``$`` for the document itself) of the first string
    or key in the JSON document ``raw`` that holds a lone surrogate; None when none does or
    ``raw`` is not JSON (its decoder then says what is wrong)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not _SURROGATE_ESCAPE.search(text):
        return None
    try:
        document = json.loads(text)  # the standard library's parser keeps lone surrogates
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict | list):
        return "$" if isinstance(document, str) and _LONE_SURROGATE.search(document) else None
    # depth first, in the document's order, with the path's parts held once on a stack
    # (built only for the string it reports: a path per child copied its parent's each time)
    parts: list[str] = []
    stack = [_children(document)]
    while stack:
        child = next(stack[-1], None)
        if child is None:
            stack.pop()
            if parts:
                parts.pop()
            continue
        name, value = child
        is_bad_key = name is None
        if is_bad_key:  # a key that is no Unicode itself, shown escaped
            name = value.encode("utf-8", "backslashreplace").decode()
        part = f"[{name}]" if isinstance(name, int) else f".{name}" if parts else name
        if is_bad_key:
            return "".join(parts) + part
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return "".join(parts) + part
        elif isinstance(value, dict | list):
            parts.append(part)
            stack.append(_children(value))
    return None


def _children(container: object) -> Iterator[tuple[str | int | None, object]]:
    """(the child's key or index, the child) for each child of an object or array in order,
    and (None, the key) for a key holding a lone surrogate, in its value's place."""
    if isinstance(container, dict):
        for key, value in container.items():
            if _LONE_SURROGATE.search(key):
                yield None, key
                return
            yield key, value
    else:
        yield from enumerate(container)


# Arrays and objects a client's document may nest: OpenAI's structured outputs allow a schema
# 10 levels deep, a few JSON levels each. Past Python's recursion budget, which is what is left
# of 1,000 frames, msgspec raises RecursionError, at a depth that moves with the caller's own
# stack: an explicit cap refuses the same documents wherever they are read (an upload that
# passed, then crashed the batch runner on every pass).
MAX_NESTING = 100


def nests_too_deeply(raw: bytes, limit: int = MAX_NESTING) -> bool:
    """Whether the JSON document ``raw`` nests arrays and objects more than ``limit`` deep
    (brackets inside strings aside), in a few vectorised passes (8 MB in a fraction of a
    second). Invalid JSON may pass or not: its decoder then says what is wrong."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # with escaped backslashes and quotes gone, every quote left opens or closes a string
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = (np.cumsum(text == ord('"'), dtype=np.int32) & 1) == 0
    structure = text[outside]
    steps = (structure == ord("[")).astype(np.int8) + (structure == ord("{"))
    steps -= (structure == ord("]")).astype(np.int8) + (structure == ord("}"))
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)) > limit


def describe_nesting(limit: int = MAX_NESTING) -> str:
    """The message for a document nested past ``limit``."""
    return f"The JSON nests arrays and objects more than {limit} levels deep."


def describe_lone_surrogate(path: str) -> str:
    """The message for a lone surrogate at ``path``."""
    return (
        f"'{path}' holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): "
        "text must be valid Unicode."
    )
