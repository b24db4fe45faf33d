"""Cross-origin requests to ``/v1/``: a web page calling the API from the browser (OpenAI's
SDKs with ``dangerouslyAllowBrowser``, chat front ends that talk to the API directly), as
OpenAI's API and vLLM's server answer them.

The API's credential is a key the caller sends in ``Authorization``, never a cookie, so no
origin gains anything a page without the key could use: ``API_CORS_ALLOWED_ORIGINS`` is
``*`` by default, as theirs; name origins instead to keep other pages out. A preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) is answered before the key is looked at,
as browsers send none with it; the answer lets the page send the headers it asked for (a
wildcard would not cover ``Authorization``) and read the headers a client needs (the request
id, the rate limits, ``Retry-After``)."""

import re

from django.conf import settings
from django.http import HttpRequest, HttpResponse

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS = ", ".join(
    [
        "x-request-id",
        "retry-after",
        "x-should-retry",
        *(
            f"x-ratelimit-{what}-{unit}"
            for what in ("limit", "remaining", "reset")
            for unit in ("requests", "tokens")
        ),
    ]
)
PREFLIGHT_MAX_AGE_SECONDS = 600
_HEADER_NAMES = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")


def allowed_origin(request: HttpRequest) -> str | None:
    """What ``Access-Control-Allow-Origin`` says to this request; None: no cross-origin
    answer (no ``Origin``, or one not allowed)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    allowed = settings.API_CORS_ALLOWED_ORIGINS
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def is_preflight(request: HttpRequest) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def preflight_response(request: HttpRequest) -> HttpResponse:
    """The answer to a preflight: 204, with what the page may send where its origin is
    allowed, and nothing (so the browser refuses the request) where not."""
    response = HttpResponse(status=204)
    origin = allowed_origin(request)
    if origin is None:
        return response
    response["Access-Control-Allow-Origin"] = origin
    response["Access-Control-Allow-Methods"] = ALLOWED_METHODS
    asked = request.headers.get("Access-Control-Request-Headers", "").strip()
    if asked and _HEADER_NAMES.match(asked):
        response["Access-Control-Allow-Headers"] = asked
    response["Access-Control-Max-Age"] = str(PREFLIGHT_MAX_AGE_SECONDS)
    _vary(response, origin)
    return response


def add_headers(request: HttpRequest, response: HttpResponse) -> None:
    """Let an allowed page read ``response`` and the headers a client needs."""
    origin = allowed_origin(request)
    if origin is None:
        return
    response["Access-Control-Allow-Origin"] = origin
    response["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
    _vary(response, origin)


def _vary(response: HttpResponse, origin: str) -> None:
    if origin != "*":  # the answer differs by origin: a cache must keep them apart
        response["Vary"] = "Origin"
