import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum

from config import celery_app
from tenants import rollups, services
from tenants.models import UsageRecord, UsageRollup
from tenants.tasks import purge_old_usage, rollup_usage
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)


@pytest.fixture
def eager():
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@pytest.fixture
def keys(tenant, other_tenant):
    return (
        services.api_key_create(tenant=tenant, name="a")[0],
        services.api_key_create(tenant=other_tenant, name="b")[0],
    )


def _record(key, started_at, n, *, status="ok", model="demo-chat", ttft=40.0, latency=900.0):
    return usage_record_add(
        request_id=f"r-{key.pk}-{n}",
        tenant=key.tenant,
        api_key=key,
        model=model,
        source=UsageRecord.Source.API,
        status=status,
        started_at=started_at,
        finished_at=started_at + timedelta(seconds=1),
        prompt_tokens=10 * n,
        completion_tokens=n,
        cached_tokens=n % 3,
        time_to_first_token_ms=ttft,
        latency_ms=latency,
    )


def _totals(period: str, **filters) -> dict:
    return UsageRollup.objects.filter(period=period, **filters).aggregate(
        requests=Sum("requests"),
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        cached=Sum("cached_tokens"),
        errors=Sum("errors"),
    )


def _raw(**filters) -> dict:
    records = UsageRecord.objects.filter(**filters)
    sums = records.aggregate(
        prompt=Sum("prompt_tokens"),
        completion=Sum("completion_tokens"),
        cached=Sum("cached_tokens"),
    )
    return {
        "requests": records.count(),
        **sums,
        "errors": records.filter(status="error").count(),
    }


def test_rollups_match_the_raw_records_and_are_idempotent(keys):
    mine, theirs = keys
    for n in range(1, 13):
        _record(mine, T0 + timedelta(minutes=11 * n), n, status="error" if n % 5 == 0 else "ok")
        _record(theirs, T0 + timedelta(minutes=7 * n), n, model="other")

    hours = rollups.rollup_pending(now=T0 + timedelta(hours=3))
    rollups.rollup_pending(now=T0 + timedelta(hours=3))  # a second run changes nothing

    assert T0 in hours and T0 + timedelta(hours=2) in hours
    for key in keys:
        assert _totals("hour", tenant=key.tenant) == _raw(tenant=key.tenant)
        assert _totals("day", tenant=key.tenant) == _raw(tenant=key.tenant)
    first_hour = _totals("hour", tenant=mine.tenant, period_start=T0)
    assert first_hour == _raw(tenant=mine.tenant, started_at__lt=T0 + timedelta(hours=1))


def test_a_late_record_is_counted_in_its_own_hour(keys):
    mine, _ = keys
    _record(mine, T0 + timedelta(minutes=5), 1)
    rollups.rollup_pending(now=T0 + timedelta(hours=5))
    assert _totals("hour", period_start=T0)["requests"] == 1

    _record(mine, T0 + timedelta(minutes=50), 2)  # started in that hour, arrives later
    rollups.rollup_pending(now=T0 + timedelta(hours=6))

    assert _totals("hour", period_start=T0)["requests"] == 2
    assert _totals("day", period_start=T0.replace(hour=0)) == _raw()


def test_latency_histograms_merge_into_percentiles(keys):
    mine, _ = keys
    for n, ttft in enumerate([10, 20, 30, 40, 60, 80, 90, 200, 400, 3000], start=1):
        _record(mine, T0 + timedelta(minutes=n), n, ttft=ttft)
    rollups.rollup_pending(now=T0 + timedelta(hours=1))

    [day] = UsageRollup.objects.filter(period="day")
    assert sum(day.ttft_histogram) == 10
    # interpolated inside the bucket, as Prometheus' histogram_quantile: the 5th of 10 is
    # the 1st of the 3 values in (50, 100], the 9.5th half-way into (2500, 5000]
    assert rollups.histogram_percentile(day.ttft_histogram, 0.5) == pytest.approx(50 + 50 / 3)
    assert rollups.histogram_percentile(day.ttft_histogram, 0.95) == pytest.approx(3750)
    assert rollups.histogram_percentile(rollups.empty_histogram(), 0.5) is None


def test_a_quantile_in_the_open_ended_bucket_is_the_highest_bound():
    histogram = rollups.empty_histogram()
    histogram[-1] = 3
    assert rollups.histogram_percentile(histogram, 0.5) == rollups.LATENCY_BUCKETS_MS[-1]


def test_time_per_output_token_is_rolled_up(keys):
    mine, _ = keys
    # n completion tokens in latency - ttft = 900 - 40 ms: (860 / (n - 1)) ms per token
    for n in (2, 5, 11, 1):
        _record(mine, T0 + timedelta(minutes=n), n)
    rollups.rollup_pending(now=T0 + timedelta(hours=1))

    [day] = UsageRollup.objects.filter(period="day")
    assert sum(day.tpot_histogram) == 3  # a one-token reply has no time between tokens
    assert rollups.time_per_output_token_ms(900, 40, 11) == 86
    p50 = rollups.histogram_percentile(day.tpot_histogram, 0.5, rollups.TPOT_BUCKETS_MS)
    assert 150 < p50 <= 250  # the middle one, 860 / 4 = 215 ms, lies in (150, 250]


def test_rollups_carry_what_their_records_are_billed_at(keys):
    """A plan changed within an hour: its hour and its day sum each record's own billed
    tokens (a factor kept per row would bill the whole hour at one of them)."""
    mine, _ = keys
    plan = mine.tenant.plan
    plan.batch_price_factor = Decimal("0.50")
    plan.save()

    def batch_line(n: int, minute: int) -> None:
        usage_record_add(
            request_id=f"b-{n}", tenant=mine.tenant, api_key=mine, model="demo-chat",
            source=UsageRecord.Source.BATCH, status="ok", started_at=T0 + timedelta(minutes=minute),
            finished_at=T0 + timedelta(minutes=minute), prompt_tokens=600, completion_tokens=400,
        )  # fmt: skip

    batch_line(1, 5)
    plan.batch_price_factor = Decimal("1")
    plan.save()
    batch_line(2, 40)
    _record(mine, T0 + timedelta(minutes=50), 10)  # an API request: one a token
    rollups.rollup_pending(now=T0 + timedelta(hours=1))

    for period in (UsageRollup.Period.HOUR, UsageRollup.Period.DAY):
        billed = UsageRollup.objects.filter(period=period).aggregate(b=Sum("billed_tokens"))["b"]
        assert billed == 500 + 1000 + 110


def test_tasks_run_through_celery(eager, keys, settings):
    mine, _ = keys
    old = _record(mine, datetime.now(UTC) - timedelta(days=40), 1)  # before this month
    _record(mine, datetime.now(UTC), 2)

    assert rollup_usage.delay().get() >= 2
    settings.USAGE_RETENTION_DAYS = 7
    purged = purge_old_usage.delay().get()

    assert purged["usage_records"] == 1
    assert not UsageRecord.objects.filter(pk=old.pk).exists()
    assert UsageRollup.objects.filter(period="day").count() == 2  # roll-ups outlive records


@pytest.mark.parametrize("days", [0, 1])
def test_purging_keeps_this_months_records_and_0_keeps_all(eager, keys, settings, days):
    """0 deleted every record (the other retentions keep everything at 0), and a retention
    under a month deleted records a monthly budget is counted from."""
    mine, _ = keys
    now = datetime.now(UTC)
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    this_month = _record(mine, month_start + timedelta(seconds=1), 1)
    last_month = _record(mine, month_start - timedelta(days=2), 2)
    settings.USAGE_RETENTION_DAYS = days
    settings.ROLLUP_RETENTION_DAYS = days
    rollup_usage.delay().get()
    rolled = UsageRollup.objects.count()

    purged = purge_old_usage.delay().get()

    kept = set(UsageRecord.objects.values_list("pk", flat=True))
    assert this_month.pk in kept and (last_month.pk in kept) == (days == 0)
    assert purged["usage_records"] == (0 if days == 0 else 1)
    if days == 0:
        assert purged["usage_rollups"] == 0 and UsageRollup.objects.count() == rolled


def _race_two_rollups(keys, monkeypatch, *, write_first: bool, meanwhile=lambda: None) -> None:
    """Roll up while another roll-up, started first, holds its hour in its transaction: paused
    after writing its rows (``write_first``) or after reading its records only. ``meanwhile``
    runs while it is paused, before the second starts."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writing transaction at a time")
    for n in range(3):
        _record(keys[0], T0 + timedelta(minutes=n), n + 1)
    UsageRecord.objects.update(created_at=T0)  # created as they finished
    rollups.rollup_pending(now=T0 + timedelta(minutes=30))

    paused, go_on = threading.Event(), threading.Event()
    replace = rollups._replace

    def paused_replace(period, start, groups):
        if threading.current_thread().name != "first" or period != UsageRollup.Period.HOUR:
            return replace(period, start, groups)
        written = replace(period, start, groups) if write_first else None
        paused.set()
        go_on.wait(10)  # inside rollup_hour's transaction, nothing of it committed yet
        return written if write_first else replace(period, start, groups)

    monkeypatch.setattr(rollups, "_replace", paused_replace)

    def run() -> None:
        try:
            rollups.rollup_pending(now=T0 + timedelta(minutes=40))
        finally:
            connection.close()

    first, second = threading.Thread(target=run, name="first"), threading.Thread(target=run)
    first.start()
    assert paused.wait(10)
    meanwhile()
    second.start()
    time.sleep(1.0)  # the second waits at the hour, or (before) got past it
    go_on.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()


@pytest.mark.django_db(transaction=True)
def test_two_rollups_at_once_count_each_record_once(keys, monkeypatch):
    """Beat queues a roll-up every 5 minutes and the worker runs two tasks at once: a slow run
    overlaps the next. Under PostgreSQL's READ COMMITTED, the second run's delete of an hour
    did not see the rows the first had just inserted, and both sets stayed, for good."""
    _race_two_rollups(keys, monkeypatch, write_first=True)
    assert _totals("hour")["requests"] == _totals("day")["requests"] == 3


@pytest.mark.django_db(transaction=True)
def test_a_rollup_that_read_first_does_not_write_its_older_rows_last(keys, monkeypatch):
    """The period's lock was taken after its records were read: a run that read, then waited,
    wrote rows older than those a run after it had read and committed meanwhile (a record
    committed between the two reads went missing until the next roll-up)."""

    def late_record() -> None:  # of the same hour, committed
        _record(keys[0], T0 + timedelta(minutes=5), 4)

    _race_two_rollups(keys, monkeypatch, write_first=False, meanwhile=late_record)
    assert _totals("hour")["requests"] == _totals("day")["requests"] == 4
