"""OpenAI's error object, and the exceptions the gateway turns into it: its own ``ApiError``
and a run's ``RunError`` (one table, ``RUN_ERROR_STATUS``)."""

import msgspec
from django.http import HttpResponse

from gateway.ratelimits import ratelimit_headers
from gateway.schemas import ErrorBody, ErrorResponse
from serving.runs import UNAVAILABLE, UNAVAILABLE_RETRY_AFTER_SECONDS, RunError

# as OpenAI's API answers: a bad key and an unknown model are invalid requests too
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# error codes whose type is not their status's: OpenAI's quota used up (a 429 that SDKs and
# proxies know not to retry, unlike a rate limit's)
ERROR_TYPES_BY_CODE = {"insufficient_quota": "insufficient_quota"}
# a run's error codes (serving.runs.RunError) -> HTTP status; any other code is a 503
RUN_ERROR_STATUS = {
    "insufficient_quota": 429,
    "context_length_exceeded": 400,
    "invalid_request": 400,
    "request_too_large": 400,
    "rate_limit_exceeded": 429,
    "engine_error": 500,
    "engine_unavailable": 503,
    "engine_overloaded": 503,
    "model_loading": 503,
    "model_not_loaded": 503,
}


# as OpenAI words a failure of the server's own
SERVER_ERROR = "The server had an error while processing your request."


class ApiError(Exception):
    """An error the API reports to the client as OpenAI does."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(
                message=self.message,
                type=ERROR_TYPES_BY_CODE.get(
                    self.code or "", ERROR_TYPES.get(self.status, "invalid_request_error")
                ),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> HttpResponse:
        response = HttpResponse(
            msgspec.json.encode(self.body()), status=self.status, content_type="application/json"
        )
        for name, value in self.headers.items():
            response[name] = value
        return response


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_run_error(exc: RunError) -> ApiError:
    """A run's refusal or failure as OpenAI answers it, with its ``Retry-After``, for a rate
    limit the ``x-ratelimit-*`` headers, and for a run admitted before it failed the
    ``x-request-id`` its usage record is filed under."""
    headers = ratelimit_headers(exc.windows, exc.retry_after)
    if exc.code == "insufficient_quota":
        headers["x-should-retry"] = "false"  # OpenAI's SDKs retry a 429 unless told not to
    if exc.request_id is not None:
        headers["x-request-id"] = exc.request_id
    return ApiError(
        RUN_ERROR_STATUS.get(exc.code, 503),
        exc.message,
        code=exc.code,
        param=exc.param,
        headers=headers,
    )


def store_unavailable() -> ApiError:
    """The answer when the database or Redis cannot be reached: a 503 to retry, as admission
    answers the same outage (``serving.runs``), not a server error."""
    return ApiError(
        503,
        UNAVAILABLE,
        code="service_unavailable",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
    )
