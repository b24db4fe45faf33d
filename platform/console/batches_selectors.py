"""The console's reads for batches: a tenant's batches with their progress, and batch usage
(``source=batch``) with what it is billed as: batch tokens weigh the plan's
``batch_price_factor`` (OpenAI's Batch API bills them at half price), every other token one."""

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
    billed_tokens: int  # other tokens + batch tokens × the plan's factor
    price_factor: Decimal | None  # the tenant's plan's; None across tenants


def batch_usage(
    *, date_range: DateRange, tenant: Tenant | None = None, end_user: str | None = None
) -> BatchUsage:
    """Batch usage over the range against the rest, for one tenant or all of them (each
    tenant's batch tokens weighed by its own plan's factor), read as the usage report reads:
    the roll-ups, then the records not rolled up yet (so a request finished a second ago
    counts); with ``end_user``, only its requests, from the raw records (the roll-ups do not
    carry end users)."""
    start, end = date_range.bounds
    handover = usage.handover_of(start, end, end_user)

    def scoped(queryset: QuerySet) -> QuerySet:
        return queryset.filter(tenant=tenant) if tenant is not None else queryset

    tenants = Tenant.objects.filter(pk=tenant.pk) if tenant is not None else Tenant.objects
    factors = dict(tenants.values_list("pk", "plan__batch_price_factor"))
    batch_requests = batch_tokens = other_tokens = 0
    billed = Decimal(0)

    def add(tenant_id: int, source: str, requests: int, tokens: int) -> None:
        nonlocal batch_requests, batch_tokens, other_tokens, billed
        if source == UsageRecord.Source.BATCH:
            batch_requests += requests
            batch_tokens += tokens
            billed += tokens * factors.get(tenant_id, 1)
        else:
            other_tokens += tokens
            billed += tokens

    for row in usage.rollups_before(scoped, "day", start, handover):
        add(row.tenant_id, row.source, row.requests, row.prompt_tokens + row.completion_tokens)
    for record in usage.raw_records(scoped, handover, end, end_user):
        tokens = record["prompt_tokens"] + record["completion_tokens"]
        add(record["tenant_id"], record["source"], 1, tokens)
    return BatchUsage(
        batch_requests=batch_requests,
        batch_tokens=batch_tokens,
        other_tokens=other_tokens,
        billed_tokens=round(billed),
        price_factor=tenant.plan.batch_price_factor if tenant is not None else None,
    )
