"""The ASGI application as Daphne runs it: API paths through the lean handler, pages through
Django's full middleware."""

import asyncio
import json

from config.asgi import application


async def _call(path: str, method: str = "GET", headers: dict[str, str] | None = None):
    """One HTTP request through the ASGI app: (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver")]
        + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays until the response is sent

    async def send(message):
        sent.append(message)

    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


async def test_api_paths_skip_the_browser_middleware(async_db):
    status, headers, body = await _call("/v1/models")
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    assert headers["x-content-type-options"] == "nosniff"
    # no session, CSRF or clickjacking machinery on the API
    assert "set-cookie" not in headers and "x-frame-options" not in headers
    assert "vary" not in headers


async def test_pages_keep_the_full_middleware(async_db):
    status, headers, _ = await _call("/accounts/login/")
    assert status == 200
    assert headers["x-frame-options"] == "DENY"
    assert "csrftoken" in headers.get("set-cookie", "")


async def test_health_is_served_by_the_api_handler(async_db):
    status, headers, body = await _call("/health/live")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert "x-frame-options" not in headers


async def test_an_unknown_api_route_is_a_json_404(async_db):
    status, _, body = await _call("/v1/embeddings", method="POST")
    assert status == 404 and json.loads(body)["error"]["code"] == "unknown_route"


async def test_an_api_view_that_fails_answers_with_openais_error_object(async_db, caplog, settings):
    settings.API_URLCONF = "tests.gateway.urls_failing"
    status, headers, body = await _call("/v1/fail")
    assert status == 500
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "param": None,
        "code": "server_error",
    }
    assert "boom" in caplog.text
