"""The console's reads: usage from the daily roll-ups (never the raw records), how fairly
the tenants of each tier were served, where a tenant stands against its quotas, and the
deployments with their replicas' state."""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from django.db.models import QuerySet, Sum

from gateway.metrics import supervisor_status
from serving.models import ModelDeployment
from tenants.models import ApiKey, Tenant, UsageRollup
from tenants.quotas import quota_usage
from tenants.rollups import histogram_merge, histogram_percentile
from tenants.selectors import tenant_limits, tenant_priority, tenant_share

MAX_SERIES = 5


@dataclass
class DateRange:
    start: date
    end: date  # inclusive

    @property
    def days(self) -> list[date]:
        return [self.start + timedelta(days=i) for i in range((self.end - self.start).days + 1)]

    @property
    def bounds(self) -> tuple[datetime, datetime]:
        start = datetime(self.start.year, self.start.month, self.start.day, tzinfo=UTC)
        return start, start + timedelta(days=len(self.days))


@dataclass
class UsageSummary:
    days: list[str]
    tokens_by: dict[str, list[float]]
    requests_by: dict[str, list[float]]
    total_requests: int
    total_tokens: int
    error_rate: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    latency_p50: float | None
    latency_p95: float | None


def daily_rollups(*, date_range: DateRange, tenant: Tenant | None = None) -> QuerySet:
    start, end = date_range.bounds
    rows = UsageRollup.objects.filter(
        period=UsageRollup.Period.DAY, period_start__gte=start, period_start__lt=end
    )
    return rows.filter(tenant=tenant) if tenant is not None else rows


def _label(row: UsageRollup, group_by: str, key_names: dict[int, str]) -> str:
    if group_by == "key":
        if row.api_key_id is None:
            return "chat" if row.source == "chat" else "deleted key"
        return key_names.get(row.api_key_id, "deleted key")
    if group_by == "tenant":
        return row.tenant.slug
    if group_by == "source":
        return row.get_source_display()
    return row.model


def usage_summary(
    *, date_range: DateRange, tenant: Tenant | None = None, group_by: str = "model"
) -> UsageSummary:
    """Tokens and requests per day grouped by model, key or tenant (the top few, the rest as
    "other"), with totals, error rate and latency percentiles over the range."""
    rows = list(daily_rollups(date_range=date_range, tenant=tenant).select_related("tenant"))
    key_names = (
        dict(ApiKey.objects.filter(tenant=tenant).values_list("pk", "name")) if tenant else {}
    )
    days = date_range.days
    index = {day: i for i, day in enumerate(days)}
    tokens: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(days))
    requests: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(days))
    for row in rows:
        label = _label(row, group_by, key_names)
        i = index[row.period_start.astimezone(UTC).date()]
        tokens[label][i] += row.prompt_tokens + row.completion_tokens
        requests[label][i] += row.requests
    order = sorted(tokens, key=lambda label: -sum(tokens[label]))
    total_requests = sum(row.requests for row in rows)
    errors = sum(row.errors for row in rows)
    ttft = histogram_merge(row.ttft_histogram for row in rows if row.ttft_histogram)
    latency = histogram_merge(row.latency_histogram for row in rows if row.latency_histogram)
    return UsageSummary(
        days=[day.strftime("%b %d") for day in days],
        # the same labels in the same order (so the same colours) in both charts
        tokens_by=_top(tokens, order),
        requests_by=_top(requests, order),
        total_requests=total_requests,
        total_tokens=sum(row.prompt_tokens + row.completion_tokens for row in rows),
        error_rate=errors / total_requests if total_requests else None,
        ttft_p50=histogram_percentile(ttft, 0.5),
        ttft_p95=histogram_percentile(ttft, 0.95),
        latency_p50=histogram_percentile(latency, 0.5),
        latency_p95=histogram_percentile(latency, 0.95),
    )


def _top(series: dict[str, list[float]], order: list[str]) -> dict[str, list[float]]:
    """The first ``MAX_SERIES`` labels of ``order``, the rest summed as "other"."""
    top = {label: series[label] for label in order[:MAX_SERIES] if label in series}
    rest = [series[label] for label in order[MAX_SERIES:] if label in series]
    if rest:
        top["other"] = [sum(values) for values in zip(*rest, strict=True)]
    return top


def top_tenants(*, date_range: DateRange, limit: int = 10) -> list[dict]:
    return list(
        daily_rollups(date_range=date_range)
        .values("tenant__slug", "tenant__name")
        .annotate(
            requests=Sum("requests"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            errors=Sum("errors"),
        )
        .order_by("-completion", "-prompt")[:limit]
    )


def model_load(*, date_range: DateRange) -> list[dict]:
    return list(
        daily_rollups(date_range=date_range)
        .values("model")
        .annotate(
            requests=Sum("requests"),
            prompt=Sum("prompt_tokens"),
            completion=Sum("completion_tokens"),
            cached=Sum("cached_tokens"),
        )
        .order_by("-completion")
    )


USAGE_CSV_HEADER = [
    "date", "model", "source", "api_key", "requests", "prompt_tokens", "completion_tokens",
    "cached_tokens", "errors",
]  # fmt: skip


def usage_csv_rows(*, date_range: DateRange, tenant: Tenant) -> list[list]:
    """The rows under ``USAGE_CSV_HEADER``, one per daily roll-up."""
    key_names = dict(ApiKey.objects.filter(tenant=tenant).values_list("pk", "name"))
    rows = daily_rollups(date_range=date_range, tenant=tenant).order_by("period_start", "model")
    return [
        [
            row.period_start.date().isoformat(),
            row.model,
            row.source,
            key_names.get(row.api_key_id, ""),
            row.requests,
            row.prompt_tokens,
            row.completion_tokens,
            row.cached_tokens,
            row.errors,
        ]
        for row in rows
    ]


class QuotaRow(NamedTuple):
    name: str
    used: int
    limit: int | None  # None: unlimited
    percent: int | None  # of the limit, at most 100; None when there is no limit


def _percent(used: float | None, limit: int | None) -> int | None:
    if not limit:
        return None
    return min(100, round(100 * (used or 0) / limit))


def quota_rows(*, tenant: Tenant) -> list[QuotaRow]:
    """Where the tenant stands against each of its limits now."""
    usage = quota_usage(tenant=tenant)
    limits = tenant_limits(tenant=tenant)
    rows = [
        ("Requests / minute", usage.requests_this_minute, limits.requests_per_minute),
        ("Tokens / minute", usage.tokens_this_minute, limits.tokens_per_minute),
        ("Concurrent requests", usage.concurrent_requests, limits.max_concurrent_requests),
        ("Tokens this month", usage.month_tokens, limits.monthly_token_budget),
    ]
    return [
        QuotaRow(name, round(used or 0), limit, _percent(used, limit)) for name, used, limit in rows
    ]


def deployments_list() -> list[ModelDeployment]:
    return list(ModelDeployment.objects.order_by("name"))


class ProcessRow(NamedTuple):
    name: str
    is_running: bool  # False: it died and waits to be restarted
    restarts: int
    last_exit_code: int | None


def supervised_processes() -> list[ProcessRow]:
    """``make run``'s processes as its supervisor last reported them; none under another
    process manager (systemd, compose), whose own status tools show them."""
    return [
        ProcessRow(
            name,
            bool(status.get("running")),
            status.get("restarts", 0),
            status.get("last_exit_code"),
        )
        for name, status in supervisor_status().items()
    ]


def deployments_changing(*, deployments: Iterable[ModelDeployment]) -> bool:
    """Whether a replica of any of ``deployments`` is loading a model, or has a load or unload
    sent that the engine has not yet answered (``serving.replica_control`` records both)."""
    return any(
        state.get("state") == "loading" or state.get("control", {}).get("state") == "sent"
        for deployment in deployments
        for state in (deployment.replicas or {}).values()
    )


# Served tokens as the engine's fair scheduler counts them (a virtual token counter: an
# output token costs twice a prompt token, after Sheng et al., OSDI 2024).
PROMPT_TOKEN_COST = 1
OUTPUT_TOKEN_COST = 2


@dataclass(frozen=True)
class FairnessRow:
    """One tenant's service over a range, against what its plan entitles it to among the
    tenants of its tier that were served in the range (fair sharing is within a tier)."""

    tenant: Tenant
    tier: str
    weight: float
    served: int  # prompt tokens + 2 × completion tokens
    served_percent: float  # of its tier's served tokens
    entitled_percent: float  # its weight over its tier's served tenants' weights
    ttft_p50: float | None


def fairness_rows(*, date_range: DateRange) -> list[FairnessRow]:
    """Each tenant served in the range, by tier (highest priority first), then by service."""
    rows = daily_rollups(date_range=date_range).select_related("tenant__plan")
    served: dict[int, int] = defaultdict(int)
    ttft: dict[int, list] = defaultdict(list)
    tenants: dict[int, Tenant] = {}
    for row in rows:
        tenants[row.tenant_id] = row.tenant
        served[row.tenant_id] += (
            PROMPT_TOKEN_COST * row.prompt_tokens + OUTPUT_TOKEN_COST * row.completion_tokens
        )
        if row.ttft_histogram:
            ttft[row.tenant_id].append(row.ttft_histogram)
    by_tier: dict[int, list[int]] = defaultdict(list)
    for tenant_id, tenant in tenants.items():
        by_tier[tenant_priority(tenant=tenant)].append(tenant_id)
    result = []
    for priority in sorted(by_tier):
        members = by_tier[priority]
        tier_served = sum(served[t] for t in members) or 1
        tier_weight = sum(tenant_share(tenant=tenants[t]) for t in members)
        for tenant_id in sorted(members, key=lambda t: -served[t]):
            tenant = tenants[tenant_id]
            weight = tenant_share(tenant=tenant)
            result.append(
                FairnessRow(
                    tenant=tenant,
                    tier=tenant.plan.get_service_tier_display(),
                    weight=weight,
                    served=served[tenant_id],
                    served_percent=100 * served[tenant_id] / tier_served,
                    entitled_percent=100 * weight / tier_weight,
                    ttft_p50=histogram_percentile(histogram_merge(ttft[tenant_id]), 0.5),
                )
            )
    return result
