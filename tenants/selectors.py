"""Reads. Every selector of tenant-owned data takes the tenant and filters by it."""

from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Exists, OuterRef, QuerySet, Sum

from tenants.models import ApiKey, Membership, Plan, Tenant, UsageRecord

DEFAULT_PLAN_SLUG = "default"


@dataclass(frozen=True)
class Limits:
    """Quota limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    monthly_token_budget: int | None = None


LIMIT_FIELDS = tuple(field.name for field in fields(Limits))


def tenant_get(*, slug: str) -> Tenant:
    return Tenant.objects.select_related("plan").get(slug=slug)


def tenant_limits(*, tenant: Tenant) -> Limits:
    """The plan's limits with the tenant's own overrides applied."""
    values = {}
    for name in LIMIT_FIELDS:
        override = getattr(tenant, name)
        values[name] = override if override is not None else getattr(tenant.plan, name)
    return Limits(**values)


def tenant_queued_batch_tokens_limit(*, tenant: Tenant) -> int | None:
    """The most input tokens the tenant's unfinished batches may hold (None: no limit)."""
    if tenant.max_queued_batch_tokens is not None:
        return tenant.max_queued_batch_tokens
    return tenant.plan.max_queued_batch_tokens


def tenant_file_storage_limit(*, tenant: Tenant) -> int | None:
    """The most bytes the tenant's files may take (None: no limit)."""
    if tenant.max_file_storage_bytes is not None:
        return tenant.max_file_storage_bytes
    return tenant.plan.max_file_storage_bytes


def api_key_limits(*, api_key: ApiKey) -> Limits:
    """The key's own limits, enforced in addition to its tenant's."""
    return Limits(**{name: getattr(api_key, name) for name in LIMIT_FIELDS})


# engine priorities: lower values are served first
SERVICE_TIER_PRIORITY = {
    Plan.ServiceTier.INTERACTIVE: 0,
    Plan.ServiceTier.STANDARD: 1,
    Plan.ServiceTier.BATCH: 2,
}


def tenant_priority(*, tenant: Tenant) -> int:
    """The engine priority of the tenant's requests, from its plan's service tier."""
    return SERVICE_TIER_PRIORITY.get(tenant.plan.service_tier, 1)


def tenant_share(*, tenant: Tenant) -> float:
    """The tenant's weight under the engine's fair scheduling, from its plan."""
    return tenant.plan.share


def tenant_api_keys(*, tenant: Tenant) -> QuerySet[ApiKey]:
    """The tenant's keys, newest first, with who created each (the keys page shows it)."""
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by").order_by("-created_at")


def tenant_memberships(*, tenant: Tenant) -> QuerySet[Membership]:
    """The tenant's memberships with their users, by username."""
    return (
        Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")
    )


def user_tenants(*, user: AbstractBaseUser) -> QuerySet[Tenant]:
    return Tenant.objects.filter(memberships__user=user, is_active=True).order_by("name")


def user_role(*, user: AbstractBaseUser, tenant: Tenant) -> str | None:
    membership = Membership.objects.filter(user=user, tenant=tenant).only("role").first()
    return membership.role if membership else None


def tenants_owned_alone(*, users: Iterable[AbstractBaseUser]) -> list[Tenant]:
    """The tenants whose active owners are all among ``users``: without them, none is left."""
    user_ids = [user.pk for user in users]
    active_owners = Membership.objects.filter(role=Membership.Role.OWNER, user__is_active=True)
    owned = active_owners.filter(user__in=user_ids).values("tenant")
    others = active_owners.filter(tenant=OuterRef("pk")).exclude(user__in=user_ids)
    return list(Tenant.objects.filter(pk__in=owned).exclude(Exists(others)).order_by("slug"))


def tenant_usage_records(
    *, tenant: Tenant, start: datetime | None = None, end: datetime | None = None
) -> QuerySet[UsageRecord]:
    """The tenant's usage records that started in [start, end)."""
    records = UsageRecord.objects.filter(tenant=tenant)
    if start is not None:
        records = records.filter(started_at__gte=start)
    if end is not None:
        records = records.filter(started_at__lt=end)
    return records.order_by("-started_at")


def plan_default() -> Plan | None:
    return Plan.objects.filter(slug=DEFAULT_PLAN_SLUG).first()


def month_tokens_used(
    *,
    tenant: Tenant,
    since: datetime,
    api_key: ApiKey | None = None,
    until: datetime | None = None,
) -> int:
    """Prompt plus completion tokens recorded for the tenant (or one of its keys) since
    ``since`` (and before ``until``)."""
    records = UsageRecord.objects.filter(tenant=tenant, started_at__gte=since)
    if until is not None:
        records = records.filter(started_at__lt=until)
    if api_key is not None:
        records = records.filter(api_key=api_key)
    totals = records.aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return (totals["prompt"] or 0) + (totals["completion"] or 0)
