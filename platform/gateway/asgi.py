"""Django for the machine-facing paths (the API, health, metrics), without the browser's
middleware.

Sessions, CSRF, authentication by cookie, messages and the clickjacking header mean nothing
to an API client, and every one of Django's built-in middlewares is sync-only: under ASGI each
hook costs a trip to a worker thread and back, a dozen per request, which is most of the time
the platform adds before a first token. This handler runs the same Django request cycle (URL
resolution, signals, streaming responses, ``request_started``/``request_finished``) with no
middleware, sets the one header the API wants from ``SecurityMiddleware``, and answers an
unhandled exception with OpenAI's error object instead of an HTML page.
"""

import logging

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import Http404, HttpRequest, HttpResponse

from gateway.errors import ApiError

logger = logging.getLogger("django.request")

API_PATH_PREFIXES = ("/v1/", "/health/", "/metrics")


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATH_PREFIXES) or path == "/v1"


class ApiASGIHandler(ASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._api_response)

    async def _api_response(self, request: HttpRequest) -> HttpResponse:
        try:
            response = await self._get_response_async(request)
        except Http404:
            response = ApiError(
                404, f"Unknown route: {request.method} {request.path}", code="unknown_route"
            ).response()
        except Exception:
            logger.exception("Internal Server Error: %s", request.path)
            response = ApiError(
                500, "The server had an error while processing your request.", code="server_error"
            ).response()
        if settings.SECURE_CONTENT_TYPE_NOSNIFF:
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if settings.SECURE_HSTS_SECONDS and request.is_secure():
            response.headers.setdefault(
                "Strict-Transport-Security", f"max-age={settings.SECURE_HSTS_SECONDS}"
            )
        return response
