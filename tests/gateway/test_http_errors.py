"""Bad input over HTTP, in process: every refusal is OpenAI's error object, and an admitted
request that cannot reach an engine is still metered."""

import pytest
from django.core.cache import cache

from gateway.errors import from_run_error
from serving.runs import RunError
from serving.services import deployment_register
from tenants import services
from tenants.models import Plan, UsageRecord

# The API does its database work on shared worker threads (config.workers), which see only
# committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

CHAT_URL = "/v1/chat/completions"
BODY = {"model": "dead", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def key(tmp_path):
    cache.clear()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan)
    deployment_register(name="dead", endpoints=[f"ipc://{tmp_path}/nobody.sock"], max_context=64)
    return services.api_key_create(tenant=tenant, name="k")[1]


def _post(client, key, body=BODY, **extra):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key else {}
    return client.post(CHAT_URL, body, content_type="application/json", **headers, **extra)


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "authorization", [None, "", "Bearer", "Basic abc", "Bearer sk-short", "Bearer " + "x" * 5000]
)
def test_missing_or_malformed_keys_get_401(client, key, authorization):
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    response = client.post(CHAT_URL, BODY, content_type="application/json", **headers)
    assert _error(response, 401)["type"] == "invalid_request_error"


def test_inactive_tenant_gets_403(client, key):
    tenant = services.api_key_authenticate(raw_key=key).tenant
    tenant.is_active = False
    tenant.save()
    assert _error(_post(client, key), 403)["code"] == "tenant_inactive"


def test_oversized_body_gets_413(client, key, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 1000
    body = {**BODY, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert _error(_post(client, key, body), 413)["code"] == "request_too_large"


def test_wrong_content_type_gets_415(client, key):
    response = client.post(
        CHAT_URL, "model=x", content_type="text/plain", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    _error(response, 415)


def test_wrong_method_gets_405(client, key):
    response = client.get(CHAT_URL, HTTP_AUTHORIZATION=f"Bearer {key}")
    _error(response, 405)
    assert response["Allow"] == "POST"


def test_unknown_api_route_gets_a_json_404(client):
    assert _error(client.get("/v1/embeddings"), 404)["code"] == "unknown_route"


@pytest.mark.parametrize("raw", [b"{not json", b"\x00\x01", b"[1, 2]", b""])
def test_garbage_json_gets_400(client, key, raw):
    response = client.post(
        CHAT_URL, raw, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    _error(response, 400)


def test_unknown_model_gets_404(client, key):
    error = _error(_post(client, key, {**BODY, "model": "gpt-9"}), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_an_unreachable_engine_gets_503_before_admission(client, key):
    response = _post(client, key)
    error = _error(response, 503)
    assert error["code"] == "engine_unavailable"
    assert int(response["Retry-After"]) > 0
    # refused before admission: nothing is metered, nothing is held
    assert not UsageRecord.objects.exists()

    # and the server keeps serving: the next request gets the same clear answer
    _error(_post(client, key), 503)


def test_a_disabled_deployment_is_not_found(client, key):
    deployment_register(name="dead", endpoints=["ipc:///tmp/x.sock"], is_enabled=False)
    _error(_post(client, key), 404)


def test_a_run_that_failed_after_admission_names_its_usage_record():
    failed = RunError("engine_unavailable", "gone", retry_after=5)
    failed.request_id = "chatcmpl-1"
    response = from_run_error(failed).response()
    assert (response.status_code, response["x-request-id"], response["Retry-After"]) == (
        503,
        "chatcmpl-1",
        "5",
    )
    assert (
        not from_run_error(RunError("engine_unavailable", "none"))
        .response()
        .has_header("x-request-id")
    )
