"""kill -9 of a web process with streams open, in the production mode (PostgreSQL and Redis
shared with the test): the engine aborts the dead process's requests once its heartbeats
stop, and its reservations on the monthly counter come off when their leases run out, so the
counter returns to the sum of the usage records (it stayed at the reserved tokens, with no
record, for the rest of the month)."""

import os
import threading

import httpx
import pytest
from django.utils import timezone

from serving.services import deployment_register
from tenants import quotas, services
from tenants.models import Plan
from tenants.selectors import month_tokens_used
from tests.gateway.conftest import MODEL_NAME, Daphne, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not os.environ.get("REDIS_URL"), reason="needs REDIS_URL: counters shared by processes"
    ),
]

NUM_STREAMS = 4


def _open_stream(base: str, key: str, started: threading.Semaphore) -> None:
    """One stream, read until the process serving it dies."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with (
            httpx.Client(base_url=base, timeout=60) as http,
            http.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
            ) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            started.release()
            for _ in lines:
                pass
    except httpx.HTTPError:
        pass  # the server died under it


def test_a_killed_web_process_leaves_nothing_running_and_nothing_reserved(
    engine, tmp_path, monkeypatch
):
    engine.wait_ready()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan, monthly_token_budget=10_000_000)
    _, key = services.api_key_create(tenant=tenant, name="k")
    deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
    monkeypatch.setenv("QUOTA_SLOT_LEASE_SECONDS", "2")  # the web process's leases
    server = Daphne(tmp_path)
    started = threading.Semaphore(0)
    streams = [
        threading.Thread(target=_open_stream, args=(server.base, key, started), daemon=True)
        for _ in range(NUM_STREAMS)
    ]
    try:
        for stream in streams:
            stream.start()
        for _ in streams:
            assert started.acquire(timeout=60)
        assert quotas.quota_usage(tenant=tenant).month_tokens > 0  # the reservations
    finally:
        server.process.kill()
        server.process.wait()
    for stream in streams:
        stream.join(timeout=60)

    month_start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    recorded = month_tokens_used(tenant=tenant, api_key=None, since=month_start)
    wait_until(lambda: engine.wait_ready().num_requests_running == 0, 60, "an idle engine")
    wait_until(
        lambda: quotas.quota_usage(tenant=tenant).month_tokens == recorded,
        60,
        f"the month counter back at the records' {recorded} tokens",
    )
