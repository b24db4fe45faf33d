"""A usage record's status says what the client got, also when the API fails after the run
was admitted: the request through the whole ASGI application, against a fake engine."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async

from gateway import handling
from gateway.responses import Responder
from inference_engine.protocol import FinishReason, GenerateDelta, ResponseType, Usage
from tenants import quotas, services
from tenants.models import UsageRecord
from tests.asgi_client import asgi_request
from tests.serving.fake_runs import run_world  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()


async def _answering(fake) -> None:
    """Answer every generate with one token and its end."""
    while True:
        identity, request = await fake.generates.get()
        delta = GenerateDelta(
            request.request_id,
            "a",
            [1],
            finish_reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=3, completion_tokens=1),
        )
        await fake.send(identity, ResponseType.OUTPUTS, [delta])


async def _post(world, body: bytes = BODY) -> tuple[int, dict]:  # noqa: F811
    _, raw_key = await sync_to_async(services.api_key_create)(tenant=world.tenant, name="http")
    answering = asyncio.create_task(_answering(world.fake))
    try:
        status, _, answer = await asgi_request(
            "POST",
            "/v1/completions",
            headers={"Authorization": f"Bearer {raw_key}", "Content-Type": "application/json"},
            body=body,
        )
    finally:
        answering.cancel()
    return status, json.loads(answer)


async def _only_record(world) -> UsageRecord:  # noqa: F811
    records = await world.records()
    assert len(records) == 1, records
    return records[0]


@sync_to_async
def _concurrent_requests(world) -> int:  # noqa: F811
    return quotas.quota_usage(tenant=world.tenant).concurrent_requests


@pytest.mark.tenant_limits(max_concurrent_requests=5)
async def test_a_served_request_is_recorded_ok(run_world):  # noqa: F811
    status, body = await _post(run_world)
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    record = await _only_record(run_world)
    assert (record.status, record.completion_tokens) == (UsageRecord.Status.OK, 1)


@pytest.mark.tenant_limits(max_concurrent_requests=5)
async def test_a_response_that_fails_to_encode_is_a_500_recorded_as_an_error(
    run_world,  # noqa: F811
    monkeypatch,
):
    """It was recorded ``ok``: the run was settled before its body was encoded."""

    async def unencodable(self):
        async for _ in self.run.deltas():
            pass
        return object()

    monkeypatch.setattr(Responder, "complete", unencodable)
    status, body = await _post(run_world)
    assert status == 500 and body["error"]["type"] == "server_error"
    record = await _only_record(run_world)
    assert record.status == UsageRecord.Status.ERROR and record.completion_tokens == 1
    assert await _concurrent_requests(run_world) == 0


@pytest.mark.tenant_limits(max_concurrent_requests=5)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_failure_after_admission_before_the_response_settles_the_run(
    run_world,  # noqa: F811
    monkeypatch,
    stream,
):
    """It left the run unsettled: no record, and the admission held until its lease ran out
    (its month reservation for good)."""

    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(handling, "ratelimit_headers", failing)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream})
    status, body = await _post(run_world, body.encode())
    assert status == 500 and body["error"]["type"] == "server_error"
    record = await _only_record(run_world)
    assert record.status == UsageRecord.Status.ERROR and record.error_code == "internal_error"
    assert await _concurrent_requests(run_world) == 0
