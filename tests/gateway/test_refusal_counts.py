"""Requests refused before admission leave no usage record, so they are counted per hour
(``RefusalCount``) for the dashboards' refusal rates: a quota's 429, an unknown model's 404,
no ready replica's 503."""

import pytest
from django.core.cache import cache
from django.db.models import Sum

from serving.services import deployment_register
from tenants import services
from tenants.models import Plan, RefusalCount, UsageRecord
from tests.gateway.conftest import MODEL_NAME

pytestmark = pytest.mark.django_db(transaction=True)

CHAT_URL = "/v1/chat/completions"


@pytest.fixture
def tenant_key(tmp_path):
    cache.clear()
    plan = Plan.objects.create(slug="one-rpm", name="One a minute", requests_per_minute=1)
    tenant = services.tenant_create(slug="acme", plan=plan)
    deployment_register(name="dead", endpoints=[f"ipc://{tmp_path}/nobody.sock"])
    return tenant, services.api_key_create(tenant=tenant, name="k")


def _post(client, raw_key: str, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return client.post(
        CHAT_URL, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw_key}"
    )


def _counts(tenant) -> dict[tuple[str, str], int]:
    rows = RefusalCount.objects.filter(tenant=tenant).values("code", "model")
    return {(r["code"], r["model"]): r["n"] for r in rows.annotate(n=Sum("count"))}


def test_an_unknown_model_and_a_dead_engine_are_counted(client, tenant_key):
    tenant, (api_key, raw_key) = tenant_key
    assert _post(client, raw_key, "no-such-model").status_code == 404
    assert _post(client, raw_key, "no-such-model").status_code == 404
    assert _post(client, raw_key, "dead").status_code == 503

    # the client's model name is not kept: it could be anything
    assert _counts(tenant) == {("model_not_found", ""): 2, ("engine_unavailable", "dead"): 1}
    assert set(RefusalCount.objects.values_list("api_key", "source")) == {(api_key.pk, "api")}
    assert not UsageRecord.objects.exists()


def test_a_rate_limited_request_is_counted(client, tenant_key, engine):
    tenant, (_, raw_key) = tenant_key
    engine.wait_ready()
    deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
    assert _post(client, raw_key, MODEL_NAME).status_code == 200
    assert _post(client, raw_key, MODEL_NAME).status_code == 429

    assert _counts(tenant) == {("rate_limit_exceeded", MODEL_NAME): 1}
    assert UsageRecord.objects.count() == 1  # the admitted one
