"""Roll usage records up into hourly and daily aggregates, idempotently.

A period's rows are always recomputed from scratch (hours from the raw records, days from
their hours) and replaced in one transaction, so running a roll-up twice changes nothing. A
record that arrives late (its request started in an hour that was already rolled up) is
counted because the task re-rolls every hour touched by records *created* since its last
run, whenever the request started.
"""

import bisect
import hashlib
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.db.models.functions import TruncHour
from django.utils import timezone

from tenants.models import RollupCursor, UsageRecord, UsageRollup

# Upper bounds (ms) of the latency histogram buckets (TTFT and whole latency); the last
# bucket is open-ended.
LATENCY_BUCKETS_MS = (25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000, 120_000)
# Upper bounds (ms) of the time-per-output-token histogram's buckets: a decode step is
# milliseconds on a GPU, tens of them on a CPU.
TPOT_BUCKETS_MS = (1, 2.5, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000)
# Records are created in transactions that may commit a little after their created_at.
CREATED_AT_SLACK = timedelta(minutes=5)
CURSOR = "usage"
GROUP_FIELDS = ("tenant_id", "api_key_id", "user_id", "model", "source")
STATUS_FIELDS = {"ok": "ok", "cancelled": "cancelled", "error": "errors", "rejected": "rejected"}
SUM_FIELDS = ("requests", "ok", "cancelled", "errors", "rejected", "prompt_tokens",
              "completion_tokens", "cached_tokens", "billed_tokens")  # fmt: skip
HISTOGRAM_BOUNDS = {
    "ttft_histogram": LATENCY_BUCKETS_MS,
    "latency_histogram": LATENCY_BUCKETS_MS,
    "tpot_histogram": TPOT_BUCKETS_MS,
}


def empty_histogram(bounds: tuple[float, ...] = LATENCY_BUCKETS_MS) -> list[int]:
    return [0] * (len(bounds) + 1)


def histogram_add(
    histogram: list[int], value_ms: float | None, bounds: tuple[float, ...] = LATENCY_BUCKETS_MS
) -> None:
    if value_ms is not None:
        histogram[bisect.bisect_left(bounds, value_ms)] += 1


def histogram_merge(
    histograms: Iterable[list[int]], bounds: tuple[float, ...] = LATENCY_BUCKETS_MS
) -> list[int]:
    """The bucket-wise sum; an empty list (a row from before the histogram existed) adds
    nothing."""
    merged = empty_histogram(bounds)
    for histogram in histograms:
        for index, count in enumerate(histogram):
            merged[index] += count
    return merged


def histogram_percentile(
    histogram: list[int], q: float, bounds: tuple[float, ...] = LATENCY_BUCKETS_MS
) -> float | None:
    """The q-quantile (ms), interpolated linearly inside the bucket that holds it, as
    Prometheus' ``histogram_quantile`` does: the values of a bucket are taken as spread evenly
    between its bounds (the first bucket's lower bound is 0). A quantile in the open-ended
    last bucket is the highest finite bound. None when the histogram is empty."""
    total = sum(histogram)
    if not total:
        return None
    rank, seen = q * total, 0
    for index, count in enumerate(histogram):
        if count and seen + count >= rank:
            if index >= len(bounds):
                return float(bounds[-1])
            lower = bounds[index - 1] if index else 0.0
            return float(lower + (bounds[index] - lower) * (rank - seen) / count)
        seen += count
    return float(bounds[-1])


def time_per_output_token_ms(
    latency_ms: float | None, ttft_ms: float | None, completion_tokens: int
) -> float | None:
    """The mean time between a request's output tokens after the first; None when it had
    fewer than two."""
    if latency_ms is None or ttft_ms is None or completion_tokens < 2:
        return None
    return max(0.0, latency_ms - ttft_ms) / (completion_tokens - 1)


def _empty_row() -> dict:
    return {field: 0 for field in SUM_FIELDS} | {
        name: empty_histogram(bounds) for name, bounds in HISTOGRAM_BOUNDS.items()
    }


def _hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _day(moment: datetime) -> datetime:
    return _hour(moment).replace(hour=0)


@transaction.atomic
def rollup_hour(start: datetime) -> int:
    """Recompute the hour starting at ``start`` from the raw records; the rows written."""
    start = _hour(start)
    _lock_period(UsageRollup.Period.HOUR, start)
    groups: dict[tuple, dict] = defaultdict(_empty_row)
    records = UsageRecord.objects.filter(
        started_at__gte=start, started_at__lt=start + timedelta(hours=1)
    ).values_list(*GROUP_FIELDS, "status", "prompt_tokens", "completion_tokens",
                  "cached_tokens", "billed_tokens", "time_to_first_token_ms",
                  "latency_ms")  # fmt: skip
    for *key, status, prompt, completion, cached, billed, ttft, latency in records:
        row = groups[tuple(key)]
        row["requests"] += 1
        row[STATUS_FIELDS[status]] += 1
        row["prompt_tokens"] += prompt
        row["completion_tokens"] += completion
        row["cached_tokens"] += cached
        row["billed_tokens"] += billed
        histogram_add(row["ttft_histogram"], ttft)
        histogram_add(row["latency_histogram"], latency)
        tpot = time_per_output_token_ms(latency, ttft, completion)
        histogram_add(row["tpot_histogram"], tpot, TPOT_BUCKETS_MS)
    return _replace(UsageRollup.Period.HOUR, start, groups)


@transaction.atomic
def rollup_day(start: datetime) -> int:
    """Recompute the day starting at ``start`` from its hourly rows; the rows written."""
    start = _day(start)
    _lock_period(UsageRollup.Period.DAY, start)
    groups: dict[tuple, dict] = {}
    hours = UsageRollup.objects.filter(
        period=UsageRollup.Period.HOUR,
        period_start__gte=start,
        period_start__lt=start + timedelta(days=1),
    )
    for hour in hours:
        key = tuple(getattr(hour, field) for field in GROUP_FIELDS)
        row = groups.setdefault(key, _empty_row())
        for field in SUM_FIELDS:
            row[field] += getattr(hour, field)
        for field, bounds in HISTOGRAM_BOUNDS.items():
            row[field] = histogram_merge([row[field], getattr(hour, field)], bounds)
    return _replace(UsageRollup.Period.DAY, start, groups)


def _replace(period: str, start: datetime, groups: dict[tuple, dict]) -> int:
    UsageRollup.objects.filter(period=period, period_start=start).delete()
    UsageRollup.objects.bulk_create(
        UsageRollup(
            period=period, period_start=start, **dict(zip(GROUP_FIELDS, key, strict=True)), **values
        )  # fmt: skip
        for key, values in groups.items()
    )
    return len(groups)


def _lock_period(period: str, start: datetime) -> None:
    """Hold the period until this transaction ends, from before its rows are read. Two
    roll-ups at once (a slow run and the next, on a worker that runs two tasks) each delete the
    period's rows and insert their own: under PostgreSQL's READ COMMITTED the second's delete
    does not see the rows the first has not committed yet, and both sets stay; and one that
    read before the other committed would write what it read, older, last. Waiting for the
    first's commit, the second reads after it and deletes its rows. (SQLite runs one writing
    transaction at a time.)"""
    if connection.vendor != "postgresql":
        return
    digest = hashlib.sha256(f"usage-rollup:{period}:{start.isoformat()}".encode()).digest()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s)", [int.from_bytes(digest[:8], "big", signed=True)]
        )


def rollup_pending(now: datetime | None = None) -> list[datetime]:
    """Re-roll every hour (and its day) touched by records created since the last run, plus
    the current hour; returns the hours rolled."""
    now = now or timezone.now()
    cursor = RollupCursor.objects.filter(name=CURSOR).first()
    fresh = UsageRecord.objects.all()
    if cursor is not None:
        fresh = fresh.filter(created_at__gte=cursor.position - CREATED_AT_SLACK)
    hours = {
        _hour(moment)
        for moment in fresh.annotate(hour=TruncHour("started_at"))
        .values_list("hour", flat=True)
        .distinct()
    }
    hours.add(_hour(now))
    for hour in sorted(hours):
        rollup_hour(hour)
    for day in sorted({_day(hour) for hour in hours}):
        rollup_day(day)
    RollupCursor.objects.update_or_create(name=CURSOR, defaults={"position": now})
    return sorted(hours)
