"""Where a client's JSON holds text that is not Unicode.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but no Unicode string. No
UTF-8 encoder, database or tokenizer takes one, so every text a client sends is checked where
it enters (the API's body, the chat socket's frame), once, whatever its field.
``lone_surrogate_path`` names the first field holding one, for the error the client gets.
"""

import json
import re

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
    pending: list[tuple[str, object]] = [("", document)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path or "$"
        elif isinstance(value, dict):
            for key in reversed(list(value)):
                shown = key.encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{shown}" if path else shown
                if shown != key:
                    return child
                pending.append((child, value[key]))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def describe_lone_surrogate(path: str) -> str:
    """The message for a lone surrogate at ``path``."""
    return (
        f"'{path}' holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): "
        "text must be valid Unicode."
    )
