"""An API request's JSON body, as UTF-8 bytes for the decoder, or an ``ApiError``.

- Size: past ``GATEWAY_MAX_BODY_BYTES`` a 413 (the web server drops such a body as it
  arrives; this is the check for anything that reaches Django another way).
- ``Content-Type``: ``application/json``, or none at all. A request without one is read as
  JSON, as OpenAI's API and vLLM's server read it (curl's ``-d`` sends
  ``application/x-www-form-urlencoded``, which is refused, but many HTTP clients send no type
  with a raw body). Any other type is a 415.
- ``charset``: the body is decoded by the declared one (``utf-8`` when none is declared, as
  JSON's RFC 8259 has it; ``latin-1``, ``utf-16``, ``shift_jis``: any charset Python's own
  codecs read), then re-encoded as UTF-8. Anything else is a 415: a name Python does not know,
  and its codecs that are no charsets (``base64``, ``zlib``; ``punycode``, ``idna`` and the
  escapes, which transform text: punycode's decoder takes quadratic time, 14 s of the event
  loop for 400 KB); bytes the charset cannot decode are a 400.
- Text: a lone surrogate escaped in any string or key (``"\\ud800"``) is a 400 naming the
  field (``config.json_text``).
- Depth: arrays and objects nested past ``MAX_NESTING`` are a 400, whatever the field (the
  decoder would otherwise run out of stack in a field it does not type, such as a schema).
"""

import codecs
import encodings
import pkgutil

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest

from config.json_text import (
    describe_lone_surrogate,
    describe_nesting,
    lone_surrogate_path,
    nests_too_deeply,
)
from config.numerals import MAX_DIGITS
from gateway.errors import ApiError, invalid

JSON_CONTENT_TYPE = "application/json"
UTF8 = codecs.lookup("utf-8").name
# Python's text codecs that are no charsets: transforms of text, and the placeholders
NOT_CHARSETS = frozenset(
    ("punycode", "idna", "unicode-escape", "raw-unicode-escape", "utf-7", "undefined", "charmap")
)


def _python_charsets() -> frozenset[str]:
    """The names (as ``codecs.lookup`` gives them) of the charsets Python's own codecs read:
    one codec registered by a library may be anything."""
    names = set()
    for module in pkgutil.iter_modules(encodings.__path__):
        try:
            codec = codecs.lookup(module.name)
        except LookupError:  # a helper module (aliases), or a platform's own codec (mbcs)
            continue
        if getattr(codec, "_is_text_encoding", True) and codec.name not in NOT_CHARSETS:
            names.add(codec.name)
    return frozenset(names)


CHARSETS = _python_charsets()


def json_body(request: HttpRequest) -> bytes:
    """The request's JSON body as UTF-8 bytes (see the module docstring)."""
    raw = _read(request)
    charset = request.content_params.get("charset") if request.content_type else None
    body = raw if charset is None else _transcode(raw, charset)
    if nests_too_deeply(body):
        raise invalid(describe_nesting())
    if (path := lone_surrogate_path(body)) is not None:
        raise invalid(describe_lone_surrogate(path), param=path)
    return body


def _read(request: HttpRequest) -> bytes:
    limit = settings.GATEWAY_MAX_BODY_BYTES
    too_large = ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    length = request.headers.get("Content-Length", "")
    # more digits than a count has declares more than any limit (and int() refuses 4,300)
    if length.isascii() and length.isdigit() and (len(length) > MAX_DIGITS or int(length) > limit):
        raise too_large
    if request.content_type and request.content_type != JSON_CONTENT_TYPE:
        raise ApiError(
            415, "Send the request body as application/json.", code="unsupported_media_type"
        )
    try:
        body = request.body
    except RequestDataTooBig as exc:
        raise too_large from exc
    if len(body) > limit:
        raise too_large
    return body


def _transcode(raw: bytes, charset: str) -> bytes:
    try:
        codec = codecs.lookup(charset)
    except LookupError:
        codec = None
    # bytes-to-bytes codecs (base64, zlib: a decompression bomb) are no charsets either
    if codec is None or codec.name not in CHARSETS:
        raise ApiError(
            415,
            f"Unsupported charset {charset[:40]!r}: send the body as UTF-8 (or name a charset "
            "such as latin-1 or utf-16).",
            code="unsupported_media_type",
        )
    if codec.name == UTF8:
        return raw
    try:
        text = codec.decode(raw)[0]
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid(f"The request body is not valid {codec.name}: {exc}.") from exc
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate decoded from the bytes themselves
        raise invalid(
            f"The request body holds a lone UTF-16 surrogate at character {exc.start}: text "
            "must be valid Unicode."
        ) from exc
