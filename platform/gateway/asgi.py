"""Django for the machine-facing paths (the API, health, metrics), without the browser's
middleware and without a thread per request.

Sessions, CSRF, authentication by cookie, messages and the clickjacking header mean nothing
to an API client, and every one of Django's built-in middlewares is sync-only: under ASGI each
hook costs a trip to a worker thread and back, a dozen per request, which was most of the time
the platform added before a first token. This handler runs the same Django request cycle (URL
resolution, signals, streaming responses, ``request_started``/``request_finished``) with no
middleware, sets the one header the API wants from ``SecurityMiddleware``, and answers an
unhandled exception with OpenAI's error object instead of an HTML page.

Django also gives every request a thread of its own for thread-sensitive sync code, started
and joined per request. The API's views do their database work through
``config.workers.database_worker`` on shared threads instead, so this handler opens no such
context: what little thread-sensitive work is left (the ``request_started`` and
``request_finished`` receivers) runs on asgiref's one shared sync thread.
"""

import logging
import uuid
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import DisallowedHost, SuspiciousOperation
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import Http404, HttpRequest, HttpResponse

from config.stopping import as_disconnect_when_cancelled
from gateway import cors
from gateway.errors import SERVER_ERROR, ApiError, store_unavailable
from serving.runs import UNREACHABLE_STORE_ERRORS

logger = logging.getLogger("django.request")

API_PATH_PREFIXES = ("/v1/", "/health/", "/metrics")
HEALTH_PATH_PREFIX = "/health/"
V1_PATH_PREFIX = "/v1/"


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATH_PREFIXES) or path == "/v1"


# how long a request in flight when the server stops gets to end as a client's disconnect
# ends it (metered, its slot given back) before it is cancelled outright
STOPPING_GRACE_SECONDS = 10.0


class ApiASGIHandler(ASGIHandler):
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Handle one request; a server that stops ends it as its client's disconnect would
        (``config.stopping``)."""
        if scope["type"] != "http":
            raise ValueError(f"The API serves HTTP only, not {scope['type']}.")
        await as_disconnect_when_cancelled(
            lambda receive: self.handle(scope, receive, send),
            receive,
            {"type": "http.disconnect"},
            STOPPING_GRACE_SECONDS,
        )

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._api_response)

    async def _api_response(self, request: HttpRequest) -> HttpResponse:
        request.urlconf = settings.API_URLCONF  # the API's few routes, not the whole site's
        is_v1 = request.path.startswith(V1_PATH_PREFIX)
        try:
            if not request.path.startswith(HEALTH_PATH_PREFIX):
                # ALLOWED_HOSTS, as CommonMiddleware checks it for the pages; health probes
                # come by IP (a load balancer, Kubernetes) and tell nothing
                request.get_host()
            if is_v1 and cors.is_preflight(request):
                response = cors.preflight_response(request)
            else:
                response = await self._get_response_async(request)
        except DisallowedHost:
            response = ApiError(400, "Invalid Host header.", code="invalid_host").response()
        except UNREACHABLE_STORE_ERRORS as exc:  # a key's lookup, a file's row, a usage page
            logger.warning("API request %s: a store is unreachable: %r", request.path, exc)
            response = store_unavailable().response()
        except SuspiciousOperation as exc:  # a 400 wherever Django answers, said as OpenAI says it
            logger.warning("Refused as suspicious: %s: %s", request.path, exc)
            response = ApiError(400, "The request was refused as malformed.").response()
        except Http404:
            response = ApiError(
                404, f"Unknown route: {request.method} {request.path}", code="unknown_route"
            ).response()
        except Exception:
            logger.exception("Internal Server Error: %s", request.path)
            response = ApiError(500, SERVER_ERROR, code="server_error").response()
        if is_v1:
            if "x-request-id" not in response.headers:
                # every answer has one, as OpenAI's; an admitted request's is its usage record's
                response.headers["x-request-id"] = f"req_{uuid.uuid4().hex}"
            cors.add_headers(request, response)
        if settings.SECURE_CONTENT_TYPE_NOSNIFF:
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
        if settings.SECURE_HSTS_SECONDS and request.is_secure():
            response.headers.setdefault(
                "Strict-Transport-Security", f"max-age={settings.SECURE_HSTS_SECONDS}"
            )
        return response
