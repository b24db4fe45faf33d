"""The console's reads for batches: a tenant's batches with their progress, and batch usage
(``source=batch``) with what it is billed as: batch tokens weigh the ``batch_price_factor`` of
the plan they were used under (OpenAI's Batch API bills them at half price), every other token
one; each record keeps that amount (``UsageRecord.billed_tokens``), and its roll-ups the sum."""

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from django.db.models import QuerySet

from batches.models import ACTIVE_STATUSES, Batch
from console import usage
from console.selectors import DateRange
from tenants.models import Tenant, UsageRecord

PAGE_SIZE = 50


@dataclass(frozen=True)
class BatchRow:
    batch: Batch
    num_done: int  # completed and failed lines
    percent: int  # of its lines done
    is_active: bool  # not yet ended: it may be cancelled
    is_cancellable: bool
    # (key, value) pairs by key: a template reads a dict's key "items" for its ``items`` method
    metadata: list[tuple[str, str]]


def tenant_batches(*, tenant: Tenant) -> QuerySet[Batch]:
    """The tenant's batches, newest first (``batch_rows`` shows a page of them)."""
    return Batch.objects.filter(tenant=tenant).order_by("-created_at", "-id")


def batch_rows(batches: Iterable[Batch]) -> list[BatchRow]:
    """The batches as the page shows them, with their progress."""
    rows = []
    for batch in batches:
        num_done = batch.num_completed + batch.num_failed
        rows.append(
            BatchRow(
                batch=batch,
                num_done=num_done,
                percent=min(100, round(100 * num_done / batch.num_total)) if batch.num_total else 0,
                is_active=batch.status in ACTIVE_STATUSES,
                is_cancellable=batch.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
                metadata=sorted((batch.metadata or {}).items()),
            )
        )
    return rows


@dataclass(frozen=True)
class BatchUsage:
    batch_requests: int
    batch_tokens: int
    other_tokens: int
    billed_tokens: int  # other tokens + batch tokens × the factor of the plan of their day
    # the tenant's plan's, where every batch token of the range was billed at it; None across
    # tenants, or where a plan change in the range billed some at another
    price_factor: Decimal | None


def batch_usage(
    *, date_range: DateRange, tenant: Tenant | None = None, end_user: str | None = None
) -> BatchUsage:
    """Batch usage over the range against the rest, for one tenant or all of them, each token
    billed as its record was (at the plan of the day it was used), read as the usage report
    reads: the roll-ups, then the records not rolled up yet (so a request finished a second
    ago counts); with ``end_user``, only its requests, from the raw records (the roll-ups do
    not carry end users)."""
    start, end = date_range.bounds
    handover = usage.handover_of(start, end, end_user)

    def scoped(queryset: QuerySet) -> QuerySet:
        return queryset.filter(tenant=tenant) if tenant is not None else queryset

    batch_requests = batch_tokens = other_tokens = 0
    batch_billed = other_billed = Decimal(0)

    def add(source: str, requests: int, tokens: int, billed: Decimal) -> None:
        nonlocal batch_requests, batch_tokens, other_tokens, batch_billed, other_billed
        if source == UsageRecord.Source.BATCH:
            batch_requests += requests
            batch_tokens += tokens
            batch_billed += billed
        else:
            other_tokens += tokens
            other_billed += billed

    for row in usage.rollups_before(scoped, "day", start, handover):
        add(row.source, row.requests, row.prompt_tokens + row.completion_tokens, row.billed_tokens)
    for record in usage.raw_records(scoped, handover, end, end_user):
        tokens = record["prompt_tokens"] + record["completion_tokens"]
        add(record["source"], 1, tokens, record["billed_tokens"])
    return BatchUsage(
        batch_requests=batch_requests,
        batch_tokens=batch_tokens,
        other_tokens=other_tokens,
        billed_tokens=round(batch_billed + other_billed),
        price_factor=_one_factor(tenant, batch_tokens, batch_billed),
    )


def _one_factor(tenant: Tenant | None, batch_tokens: int, batch_billed: Decimal) -> Decimal | None:
    """The tenant's plan's factor where its batch tokens were all billed at it: the page says
    "batch at 50%" only where that is what its figure holds."""
    if tenant is None:
        return None
    factor = tenant.plan.batch_price_factor
    return factor if batch_billed == batch_tokens * factor else None
