"""The gateway's request counter (``llm_gateway_requests_total``) counts each request once:
an admitted one as it settles, a refused one as it is answered."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async

from inference_engine.protocol import GenerateDelta, ResponseType
from tenants import services
from tests.serving.fake_runs import run_world  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _requests_counted(tenant: str) -> dict[str, float]:
    from gateway import metrics

    return {
        sample.labels["status"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "llm_gateway_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["tenant"] == tenant
    }


@pytest.mark.tenant_limits(max_concurrent_requests=5)
async def test_a_request_that_fails_once_admitted_is_counted_once(run_world):  # noqa: F811
    """Its settlement counted it ("error"), and the handler counted it again as a refusal
    ("500")."""
    from inference_engine.protocol import ErrorCode, FinishReason
    from tests.asgi_client import asgi_request

    _, raw_key = await sync_to_async(services.api_key_create)(tenant=run_world.tenant, name="h")
    before = _requests_counted(run_world.tenant.slug)

    async def failing(fake) -> None:
        identity, request = await fake.generates.get()
        delta = GenerateDelta(
            request.request_id,
            finish_reason=FinishReason.ERROR,
            error=ErrorCode.ENGINE_ERROR,
            error_message="boom",
        )
        await fake.send(identity, ResponseType.OUTPUTS, [delta])

    engine = asyncio.create_task(failing(run_world.fake))
    try:
        status, _, _ = await asgi_request(
            "POST",
            "/v1/completions",
            body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"Authorization": f"Bearer {raw_key}", "Content-Type": "application/json"},
        )
    finally:
        engine.cancel()

    after = _requests_counted(run_world.tenant.slug)
    added = {name: after[name] - before.get(name, 0) for name in after}
    assert status == 500 and len(await run_world.records()) == 1
    assert {name: count for name, count in added.items() if count} == {"error": 1}


async def test_a_malformed_body_with_a_valid_key_is_counted_for_its_tenant(run_world):  # noqa: F811
    """A 400 for the body was counted under tenant="unknown" though the key named the
    tenant: its dashboard never showed its clients' bad requests."""
    from tests.asgi_client import asgi_request

    _, raw_key = await sync_to_async(services.api_key_create)(tenant=run_world.tenant, name="h")
    before = _requests_counted(run_world.tenant.slug)

    status, _, _ = await asgi_request(
        "POST",
        "/v1/completions",
        body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": -1}).encode(),
        headers={"Authorization": f"Bearer {raw_key}", "Content-Type": "application/json"},
    )

    after = _requests_counted(run_world.tenant.slug)
    assert status == 400
    assert after.get("400", 0) - before.get("400", 0) == 1


def test_a_scrape_without_tenants_sums_counts_and_leaves_out_created_timestamps():
    """Summing the tenants away summed each counter's ``_created`` Unix time too: three
    tenants' came out a century ahead."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway import metrics

    for slug in ("probe-a", "probe-b", "probe-c"):
        metrics.requests_total.labels(slug, "probe-model", "200").inc()

    text = metrics.exposition(with_tenants=False).decode()

    samples = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == "probe-model"
    ]
    assert {sample.name for sample in samples} == {"llm_gateway_requests_total"}
    assert samples[0].value == 3 and "tenant" not in samples[0].labels
