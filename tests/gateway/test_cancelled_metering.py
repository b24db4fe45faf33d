"""A client that leaves mid-request: exactly one usage record, status ``cancelled``, with the
tokens the engine computed for it (the engine's own counters are the reference).

A client's cut and the server's last byte race: a server that answered in full before the
client left rightly records ``ok``, so the test tells that case apart by the server's own clock
(the record's ``finished_at`` against the moment of the cut) and by the whole answer's tokens."""

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest
from asgiref.sync import sync_to_async

from tenants.models import UsageRecord
from tests.gateway.conftest import MODEL_NAME, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# about 30 prompt tokens and 200 new ones within the tiny model's 256-token context: long
# enough that every cut but the last lands while the engine still generates, on a fast machine
PROMPT = " ".join(f"w{i}" for i in range(10))
MAX_TOKENS = 200
# how long after the cut a server that had already answered may still be writing its record
SETTLE_SLACK_SECONDS = 0.1


@dataclass(frozen=True)
class Cut:
    finished: bool  # the client read the whole answer
    cut_at: float  # when it left (time.time()), if it did


def _engine_counts(platform) -> tuple[int, int]:
    stats = platform.engine.wait_ready()
    return stats.prompt_tokens_total, stats.generation_tokens_total


def _idle(platform) -> None:
    wait_until(lambda: platform.engine.wait_ready().num_requests_running == 0, 30, "idle engine")


async def _cut(platform, *, stream: bool, after: float) -> Cut:
    """One request the client abandons after ``after`` seconds, unless it got to the end."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
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
            return Cut(finished=True, cut_at=0.0)
        cut_at = time.time()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Cut(finished=False, cut_at=cut_at)


@pytest.mark.parametrize(
    ("stream", "after"), [(True, 0.05), (True, 0.15), (False, 0.05), (False, 0.1), (False, 1.5)]
)
async def test_a_cut_request_is_metered_once_with_the_engines_counts(
    async_db, platform, stream, after
):
    # warm: the key's authorization and the engine's connection are in place, so the cut
    # lands after admission
    assert (await _cut(platform, stream=False, after=30)).finished
    await sync_to_async(_idle)(platform)
    prompt_before, generated_before = await sync_to_async(_engine_counts)(platform)

    cut = await _cut(platform, stream=stream, after=after)

    records = UsageRecord.objects.filter(tenant=platform.tenant)
    await sync_to_async(wait_until)(lambda: records.count() == 2, 30, "a second record")
    await sync_to_async(_idle)(platform)
    prompt_after, generated_after = await sync_to_async(_engine_counts)(platform)
    record = await records.order_by("started_at").alast()
    if cut.finished:
        assert record.status == "ok"
    elif record.status == "ok":
        # the server answered in full before the client left: its record says so
        assert record.completion_tokens == MAX_TOKENS
        assert record.finished_at.timestamp() <= cut.cut_at + SETTLE_SLACK_SECONDS, (
            f"metered ok {record.finished_at.timestamp() - cut.cut_at:.3f}s after the client left"
        )
    else:
        assert record.status == "cancelled"
    assert record.prompt_tokens == prompt_after - prompt_before
    assert record.completion_tokens == generated_after - generated_before
