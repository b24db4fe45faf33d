"""``metered`` when the request is cancelled (its client left) while the admission is still
on its worker thread: the admission made there must not outlive the request."""

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache

from tenants import quotas, services
from tenants.metering import metered
from tenants.models import Plan, UsageRecord

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api_key(async_db):
    cache.clear()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan, max_concurrent_requests=2)
    yield services.api_key_create(tenant=tenant, name="k")[0]
    cache.clear()


async def _eventually(check, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await sync_to_async(check)():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.02)


async def test_a_request_cancelled_during_its_admission_holds_no_slot(api_key):
    on_thread, go_on = threading.Event(), threading.Event()

    def precondition() -> None:  # runs on the worker thread just before the admission
        on_thread.set()
        go_on.wait(10)

    async def request() -> None:
        async with metered(
            request_id="req-cancelled",
            tenant=api_key.tenant,
            api_key=api_key,
            model="m",
            source=UsageRecord.Source.API,
            estimated_tokens=100,
            precondition=precondition,
        ):
            raise AssertionError("a cancelled request never runs")

    task = asyncio.create_task(request())
    assert await asyncio.to_thread(on_thread.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go_on.set()  # the worker thread now admits the request that is gone

    def settled() -> bool:
        usage = quotas.quota_usage(tenant=api_key.tenant, api_key=api_key)
        return usage.concurrent_requests == 0 and UsageRecord.objects.exists()

    await _eventually(settled)
    record = await UsageRecord.objects.aget()
    assert (record.request_id, record.status, record.error_code) == (
        "req-cancelled",
        UsageRecord.Status.CANCELLED,
        "cancelled",
    )
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
