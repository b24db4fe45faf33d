"""The console's reads that hold a rule: how full each quota is, and when the platform page
follows a deployment that is changing."""

import pytest
from django.core.cache import cache

from console import selectors
from serving.models import ModelDeployment
from tenants import quotas
from tests.tenants.racers import tenant_with

MINUTE_START = 1_800_000_000.0 - (1_800_000_000.0 % 60)


@pytest.fixture
def frozen_quotas(monkeypatch):
    """Counters from a clean cache, read at one instant (no minute rolls over mid-test)."""
    cache.clear()
    monkeypatch.setattr(quotas, "_now", lambda: MINUTE_START + 1)
    yield
    cache.clear()


@pytest.mark.django_db
def test_quota_rows_show_use_against_each_limit(frozen_quotas):
    tenant = tenant_with(requests_per_minute=4, max_concurrent_requests=1)
    for _ in range(2):
        ticket = quotas.admission_acquire(tenant=tenant, api_key=None, estimated_tokens=10)
        quotas.admission_release(ticket=ticket, actual_tokens=10)

    rows = {row.name: row for row in selectors.quota_rows(tenant=tenant)}

    assert list(rows) == [
        "Requests / minute", "Tokens / minute", "Concurrent requests", "Tokens this month",
        "File storage (bytes)",
    ]  # fmt: skip
    assert rows["Requests / minute"] == selectors.QuotaRow("Requests / minute", 2, 4, 50)
    assert rows["Concurrent requests"] == selectors.QuotaRow("Concurrent requests", 0, 1, 0)
    # no limit: no share of one to show
    assert rows["Tokens / minute"].limit is None and rows["Tokens / minute"].percent is None


@pytest.mark.django_db
def test_a_quota_used_past_a_lowered_limit_shows_full_and_a_zero_limit_shows_none(
    frozen_quotas,
):
    tenant = tenant_with(requests_per_minute=3)
    for _ in range(3):
        ticket = quotas.admission_acquire(tenant=tenant, api_key=None, estimated_tokens=1)
        quotas.admission_release(ticket=ticket, actual_tokens=1)
    tenant.requests_per_minute, tenant.max_concurrent_requests = 1, 0

    rows = {row.name: row for row in selectors.quota_rows(tenant=tenant)}

    assert rows["Requests / minute"].used == 3 and rows["Requests / minute"].percent == 100
    assert rows["Concurrent requests"].percent is None


def _deployment(**replicas: dict) -> ModelDeployment:
    return ModelDeployment(name="m", endpoints=list(replicas), replicas=replicas)


@pytest.mark.parametrize(
    ("replica", "changing"),
    [
        ({"state": "loading", "state_detail": "loading /models/x"}, True),
        ({"state": "ready", "control": {"action": "load", "state": "sent"}}, True),
        ({"state": "ready", "control": {"action": "load", "ok": True, "message": "ready"}}, False),
        ({"state": "unloaded"}, False),
        ({"error": "no answer"}, False),
    ],
)
def test_a_deployment_is_changing_while_a_replica_loads_or_a_control_is_unanswered(
    replica, changing
):
    idle = _deployment(a={"state": "ready"})
    assert selectors.deployments_changing(deployments=[idle, _deployment(b=replica)]) is changing


def test_no_deployments_or_no_replica_state_is_not_changing():
    assert selectors.deployments_changing(deployments=[]) is False
    assert selectors.deployments_changing(deployments=[ModelDeployment(name="m")]) is False


@pytest.mark.django_db
@pytest.mark.parametrize("is_rolled_up", [True, False])
def test_fairness_compares_each_tenants_service_with_its_weight_within_its_tier(is_rolled_up):
    """Not yet rolled up, the usage is read from its records, as on the rest of the page (the
    panel read the roll-ups alone: "no usage" beside a page of it)."""
    from datetime import UTC, datetime

    from console.usage import fairness_rows
    from tenants import rollups, services
    from tenants.models import Plan, UsageRecord
    from tests.usage_records import usage_record_add

    standard = Plan.objects.create(slug="standard", name="Standard", share=1.0)
    double = Plan.objects.create(slug="double", name="Double", share=2.0)
    batch = Plan.objects.create(
        slug="nightly", name="Nightly", service_tier=Plan.ServiceTier.BATCH, share=3.0
    )
    now = datetime.now(UTC)
    served = {"light": (100, 50), "heavy": (300, 150), "night": (10, 5)}
    plans = {"light": standard, "heavy": double, "night": batch}
    for slug, (prompt, completion) in served.items():
        tenant = services.tenant_create(slug=slug, plan=plans[slug])
        key, _ = services.api_key_create(tenant=tenant, name="k")
        usage_record_add(
            request_id=slug, tenant=tenant, api_key=key, model="m",
            source=UsageRecord.Source.API, status="ok", started_at=now, finished_at=now,
            prompt_tokens=prompt, completion_tokens=completion, time_to_first_token_ms=40.0,
        )  # fmt: skip
    services.tenant_create(slug="idle", plan=double)  # served nothing: not in the table
    if is_rolled_up:
        rollups.rollup_pending()

    rows = fairness_rows(date_range=selectors.DateRange(now.date(), now.date()))

    assert [(r.tenant.slug, r.tier, r.weight, r.served) for r in rows] == [
        ("heavy", "Standard", 2.0, 600),  # prompt + 2 × completion
        ("light", "Standard", 1.0, 200),
        ("night", "Batch", 3.0, 20),  # a tier of its own, after the higher priority
    ]
    heavy, light, night = rows
    assert (heavy.served_percent, heavy.entitled_percent) == (75.0, pytest.approx(200 / 3))
    assert (light.served_percent, light.entitled_percent) == (25.0, pytest.approx(100 / 3))
    assert (night.served_percent, night.entitled_percent) == (100.0, 100.0)
    # estimated inside the histogram bucket that holds the one 40 ms
    assert heavy.ttft_p50 is not None and 25 < heavy.ttft_p50 <= 50


@pytest.mark.django_db
def test_the_quota_rows_show_what_the_tenants_files_take_of_its_storage(frozen_quotas):
    from batches.models import File

    tenant = tenant_with()
    tenant.max_file_storage_bytes = 1000
    tenant.save()
    File.objects.create(tenant=tenant, purpose="batch", filename="a.jsonl", bytes=250)

    rows = {row.name: row for row in selectors.quota_rows(tenant=tenant)}

    assert rows["File storage (bytes)"] == selectors.QuotaRow("File storage (bytes)", 250, 1000, 25)
