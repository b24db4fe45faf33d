"""The console's reads (usage over time is ``console.usage``): the usage CSV from the daily
roll-ups, the tenants, how fairly the tenants of each tier were served, where a tenant stands
against its quotas, and the deployments with their replicas' state."""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import NamedTuple

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from batches.selectors import stored_file_bytes
from gateway.metrics import supervisor_status
from serving.models import ModelDeployment
from tenants.models import Tenant, UsageRollup
from tenants.quotas import quota_usage
from tenants.selectors import tenant_file_storage_limit, tenant_limits

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


# the key's name, and (last) its prefix: names may repeat, and a deleted key has neither
USAGE_CSV_HEADER = [
    "date", "model", "source", "api_key", "requests", "prompt_tokens", "completion_tokens",
    "cached_tokens", "errors", "api_key_prefix",
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
        (
            "File storage (bytes)",
            stored_file_bytes(tenant_id=tenant.pk),
            tenant_file_storage_limit(tenant=tenant),
        ),
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


def deployment_exists(*, name: str) -> bool:
    """Whether a deployment is registered as ``name`` (as the register form sends it)."""
    name = name.strip()
    return "\x00" not in name and ModelDeployment.objects.filter(name=name).exists()
