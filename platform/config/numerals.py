"""Whole numbers a client wrote: ASCII digits only, and few enough of them to convert.

``str.isdigit`` says yes to "²" and "١٢", which ``int`` refuses, and ``int`` refuses any
string of more than 4,300 digits (``sys.get_int_max_str_digits``) with a ``ValueError``: a
view that checks ``isdigit()`` and then calls ``int()`` answers such input with a 500.
"""

from __future__ import annotations

MAX_DIGITS = 19  # a PostgreSQL bigint's; a longer number names no row and passes no limit


def parse_count(value: str | None, *, max_digits: int = MAX_DIGITS) -> int | None:
    """``value`` as a non-negative int, or None when it is not 1 to ``max_digits`` ASCII
    digits."""
    if value is None or not 0 < len(value) <= max_digits:
        return None
    if not value.isascii() or not value.isdigit():
        return None
    return int(value)
