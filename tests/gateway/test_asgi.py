"""The ASGI application as Daphne runs it: API paths through the lean handler, pages through
Django's full middleware."""

import json

from tests.asgi_client import asgi_request


async def _call(
    path: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    host: str = "testserver",
):
    """One HTTP request through the ASGI app: (status, headers, body)."""
    return await asgi_request(method, path, headers=headers, host=host)


async def test_api_paths_skip_the_browser_middleware(async_db):
    status, headers, body = await _call("/v1/models")
    assert status == 401
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert headers["x-content-type-options"] == "nosniff"
    # no session, CSRF or clickjacking machinery on the API
    assert "set-cookie" not in headers and "x-frame-options" not in headers
    assert "vary" not in headers


async def test_every_api_answer_carries_a_request_id(async_db):
    """As OpenAI's does, refusals too (a 401, a 404): what a client quotes to support. An
    admitted request's is its usage record's (tests/gateway/test_openai_sdk.py)."""
    ids = set()
    for path in ("/v1/models", "/v1/nowhere"):
        _, headers, _ = await _call(path)
        assert headers["x-request-id"].startswith("req_")
        ids.add(headers["x-request-id"])
    assert len(ids) == 2
    _, headers, _ = await _call("/health/live")
    assert "x-request-id" not in headers  # the probes' answers are not requests to trace


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


async def test_what_django_finds_suspicious_is_a_400_with_openais_error_object(async_db, settings):
    """As Django answers a SuspiciousOperation on its pages (too many fields or files in a
    form, say), not a 500."""
    settings.API_URLCONF = "tests.gateway.urls_failing"
    status, _, body = await _call("/v1/suspicious")
    assert status == 400
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


async def test_a_store_outage_as_a_key_is_looked_up_is_a_503_to_retry(async_db, monkeypatch):
    """The database (or Redis) gone as the key is read: a 503 with Retry-After, as admission
    answers the same outage, not a 500, on every API route."""
    from django.db import OperationalError

    def unreachable(**_):
        raise OperationalError("connection refused")

    monkeypatch.setattr("gateway.auth.api_key_authenticate", unreachable)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    for method, path, payload in (
        ("POST", "/v1/chat/completions", body),
        ("GET", "/v1/models", None),
        ("GET", "/v1/batches", None),
    ):
        status, headers, answer = await asgi_request(
            method,
            path,
            headers={"Authorization": "Bearer sk-anything", "Content-Type": "application/json"},
            body=payload.encode() if payload else b"",
        )
        assert status == 503, (path, answer)
        assert json.loads(answer)["error"]["code"] == "service_unavailable"
        assert headers["retry-after"] == "5"


async def test_api_paths_answer_only_the_allowed_hosts(async_db):
    for path in ("/metrics", "/v1/models", "/v1/chat/completions"):
        status, _, body = await _call(path, host="evil.example")
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_host"
    # health probes come by IP from load balancers, and say nothing worth hiding
    status, _, _ = await _call("/health/live", host="10.0.0.7:8000")
    assert status == 200


async def test_metrics_need_the_token_when_one_is_set(async_db, settings):
    from gateway import metrics

    metrics.requests_total.labels("acme-secret-co", "m", "ok").inc()
    settings.METRICS_BEARER_TOKEN = "s3cret"
    status, _, _ = await _call("/metrics")
    assert status == 401
    status, _, body = await _call("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and b'tenant="acme-secret-co"' in body


async def test_a_token_of_other_characters_than_ascii_is_refused_not_a_500(async_db, settings):
    """hmac.compare_digest raises TypeError for str holding other characters than ASCII: the
    metrics and the readiness probe (which looks at the token too) answered 500."""
    settings.METRICS_BEARER_TOKEN = "s3cret"
    status, _, _ = await _call("/metrics", headers={"Authorization": "Bearer s3crét"})
    assert status == 401
    status, _, _ = await _call("/health/ready", headers={"Authorization": "Bearer s3crét"})
    assert status in (200, 503)
    settings.METRICS_BEARER_TOKEN = "s3crét"  # a token of any characters works
    status, _, _ = await _call("/metrics", headers={"Authorization": "Bearer s3crét"})
    assert status == 200


async def test_production_metrics_without_a_token_name_no_tenant(async_db, settings):
    from gateway import metrics

    metrics.requests_total.labels("acme-secret-co", "m", "ok").inc()
    settings.METRICS_BEARER_TOKEN = ""
    settings.IS_EMBEDDED = False
    status, _, body = await _call("/metrics")
    assert status == 200
    assert b"acme-secret-co" not in body and b"tenant=" not in body
    assert b'llm_gateway_requests_total{model="m",status="ok"}' in body  # summed, still there

    settings.IS_EMBEDDED = True  # the local, embedded platform shows everything
    assert b'tenant="acme-secret-co"' in (await _call("/metrics"))[2]


async def test_readiness_does_not_tell_why_a_check_failed(async_db, monkeypatch):
    from gateway import health

    async def fails():
        raise RuntimeError("password authentication failed for user db-admin at 10.1.2.3")

    monkeypatch.setattr(health, "_check_cache", fails)
    status, _, body = await _call("/health/ready")
    assert status == 503
    report = json.loads(body)
    assert report["checks"]["cache"] == "error: unavailable"
    assert b"10.1.2.3" not in body and b"db-admin" not in body


async def test_a_browser_page_may_call_the_api_as_openais_allows(async_db):
    """A preflight was a 405 and answers had no Access-Control-Allow-Origin: a page calling
    the API from the browser (OpenAI's SDKs allow it) could not."""
    status, headers, _ = await _call(
        "/v1/chat/completions",
        method="OPTIONS",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert status == 204
    assert headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"

    status, headers, _ = await _call("/v1/models", headers={"Origin": "https://app.example"})
    assert status == 401 and headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in headers["access-control-expose-headers"]
    assert "retry-after" in headers["access-control-expose-headers"]
    _, headers, _ = await _call("/v1/models")  # no origin: no cross-origin answer
    assert "access-control-allow-origin" not in headers


async def test_origins_may_be_named_and_others_are_not_let_in(async_db, settings):
    settings.API_CORS_ALLOWED_ORIGINS = ["https://app.example"]
    preflight = {"Access-Control-Request-Method": "POST"}
    _, headers, _ = await _call(
        "/v1/models", method="OPTIONS", headers={"Origin": "https://app.example", **preflight}
    )
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert headers["vary"] == "Origin"
    status, headers, _ = await _call(
        "/v1/models", method="OPTIONS", headers={"Origin": "https://evil.example", **preflight}
    )
    assert status == 204 and "access-control-allow-origin" not in headers
    _, headers, _ = await _call("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers
