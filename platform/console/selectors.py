"""The console's reads (usage over time is ``console.usage``): the usage CSV from the daily
roll-ups, the tenants, how fairly the tenants of each tier were served, where a tenant stands
against its quotas, and the deployments with their replicas' state."""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from gateway.metrics import supervisor_status
from serving.models import ModelDeployment
from tenants.models import Tenant, UsageRollup
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


def daily_rollups(*, date_range: DateRange, tenant: Tenant | None = None) -> QuerySet:
    start, end = date_range.bounds
    rows = UsageRollup.objects.filter(
        period=UsageRollup.Period.DAY, period_start__gte=start, period_start__lt=end
    )
    return rows.filter(tenant=tenant) if tenant is not None else rows


class TenantRow(NamedTuple):
    tenant: Tenant
    plan: str
    num_members: int
    num_active_keys: int


def tenant_rows() -> list[TenantRow]:
    """Every tenant with its plan and how many members and active keys it has."""
    tenants = Tenant.objects.select_related("plan").order_by("slug")
    live = Q(api_keys__revoked_at=None) & (
        Q(api_keys__expires_at=None) | Q(api_keys__expires_at__gt=timezone.now())
    )
    tenants = tenants.annotate(
        num_members=Count("memberships", distinct=True),
        num_active_keys=Count("api_keys", filter=live, distinct=True),
    )
    return [TenantRow(t, t.plan.name, t.num_members, t.num_active_keys) for t in tenants]


USAGE_CSV_HEADER = [
    "date", "model", "source", "api_key", "requests", "prompt_tokens", "completion_tokens",
    "cached_tokens", "errors",
]  # fmt: skip


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


def deployment_exists(*, name: str) -> bool:
    """Whether a deployment is registered as ``name`` (as the register form sends it)."""
    name = name.strip()
    return "\x00" not in name and ModelDeployment.objects.filter(name=name).exists()
