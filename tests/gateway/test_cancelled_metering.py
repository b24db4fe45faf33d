"""A client that leaves mid-request: exactly one usage record, status ``cancelled``, with the
tokens the engine computed for it (the engine's own counters are the reference)."""

import asyncio

import httpx
import pytest
from asgiref.sync import sync_to_async

from tenants.models import UsageRecord
from tests.gateway.conftest import MODEL_NAME, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# about 150 prompt tokens, with max_tokens 50 within the tiny model's 256-token context
PROMPT = " ".join(f"w{i}" for i in range(40))


def _engine_counts(platform) -> tuple[int, int]:
    stats = platform.engine.wait_ready()
    return stats.prompt_tokens_total, stats.generation_tokens_total


def _idle(platform) -> None:
    wait_until(lambda: platform.engine.wait_ready().num_requests_running == 0, 30, "idle engine")


async def _cut(platform, *, stream: bool, after: float) -> bool:
    """One request the client abandons after ``after`` seconds; whether it got to the end."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {platform.key}"}

    async def call(http: httpx.AsyncClient) -> None:
        if not stream:
            response = await http.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            return
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                pass

    # the client exists before the clock starts: making one takes tens of milliseconds
    async with httpx.AsyncClient(base_url=platform.base, timeout=60) as http:
        task = asyncio.ensure_future(call(http))
        done, _ = await asyncio.wait([task], timeout=after)
        if done:
            task.result()
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False


@pytest.mark.parametrize(
    ("stream", "after"), [(True, 0.05), (True, 0.15), (False, 0.05), (False, 0.1), (False, 1.5)]
)
async def test_a_cut_request_is_metered_once_with_the_engines_counts(
    async_db, platform, stream, after
):
    # warm: the key's authorization and the engine's connection are in place, so the cut
    # lands after admission
    assert await _cut(platform, stream=False, after=30)
    await sync_to_async(_idle)(platform)
    prompt_before, generated_before = await sync_to_async(_engine_counts)(platform)

    finished = await _cut(platform, stream=stream, after=after)

    records = UsageRecord.objects.filter(tenant=platform.tenant)
    await sync_to_async(wait_until)(lambda: records.count() == 2, 30, "a second record")
    await sync_to_async(_idle)(platform)
    prompt_after, generated_after = await sync_to_async(_engine_counts)(platform)
    record = await records.order_by("started_at").alast()
    assert record.status == ("ok" if finished else "cancelled")
    assert record.prompt_tokens == prompt_after - prompt_before
    assert record.completion_tokens == generated_after - generated_before
