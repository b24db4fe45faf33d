"""The console's reads for batches: a tenant's batches with their progress, and batch usage
(``source=batch``) with what it is billed as: batch tokens weigh the plan's
``batch_price_factor`` (OpenAI's Batch API bills them at half price), every other token one."""

from dataclasses import dataclass
from decimal import Decimal

from django.db.models import Count, QuerySet, Sum

from batches.models import ACTIVE_STATUSES, Batch
from console.selectors import DateRange, daily_rollups
from tenants.models import Tenant, UsageRecord

PAGE_SIZE = 50


@dataclass(frozen=True)
class BatchRow:
    batch: Batch
    num_done: int  # completed and failed lines
    percent: int  # of its lines done
    is_active: bool  # not yet ended: it may be cancelled
    is_cancellable: bool


def tenant_batches(*, tenant: Tenant, limit: int = PAGE_SIZE) -> list[BatchRow]:
    """The tenant's newest batches, newest first."""
    batches = Batch.objects.filter(tenant=tenant).order_by("-created_at", "-id")[:limit]
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
    tenant's batch tokens weighed by its own plan's factor); with ``end_user``, only its
    requests, read from the raw records (the roll-ups do not carry it)."""
    if end_user is None:
        rows: QuerySet = daily_rollups(date_range=date_range, tenant=tenant)
        requests = Sum("requests")
    else:
        start, end = date_range.bounds
        rows = UsageRecord.objects.filter(
            end_user=end_user, started_at__gte=start, started_at__lt=end
        )
        rows = rows.filter(tenant=tenant) if tenant is not None else rows
        requests = Count("id")
    rows = rows.values("source", "tenant__plan__batch_price_factor").annotate(
        requests=requests, prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )
    batch_requests = batch_tokens = other_tokens = 0
    billed = Decimal(0)
    for row in rows:
        tokens = (row["prompt"] or 0) + (row["completion"] or 0)
        if row["source"] == UsageRecord.Source.BATCH:
            batch_requests += row["requests"] or 0
            batch_tokens += tokens
            billed += tokens * row["tenant__plan__batch_price_factor"]
        else:
            other_tokens += tokens
            billed += tokens
    return BatchUsage(
        batch_requests=batch_requests,
        batch_tokens=batch_tokens,
        other_tokens=other_tokens,
        billed_tokens=round(billed),
        price_factor=tenant.plan.batch_price_factor if tenant is not None else None,
    )
