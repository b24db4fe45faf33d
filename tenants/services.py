"""Writes: tenants, memberships, API keys and usage records.

Every function takes keyword-only arguments, validates before writing and runs in one
transaction. Async callers (the gateway, the chat consumer) use the ``a``-prefixed twins.
"""

from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from tenants import api_keys
from tenants.models import ApiKey, Membership, Plan, Tenant, UsageRecord
from tenants.selectors import DEFAULT_PLAN_SLUG, LIMIT_FIELDS, plan_default

# Writing last_used_at on every request would put a database write on the hot path;
# once a minute is as precise as a dashboard needs.
LAST_USED_RESOLUTION = timedelta(minutes=1)


class ApiKeyInvalid(Exception):
    """The presented key does not authenticate; ``reason`` says why (for logs, not clients)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _check_limits(limits: dict[str, int | None]) -> None:
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise ValidationError(f"Unknown limits: {', '.join(sorted(unknown))}")
    for name, value in limits.items():
        if value is not None and value < 0:
            raise ValidationError({name: "A limit must be zero or more (None for no limit)."})


# The limits of the plan new tenants get when none is named (also created by a migration).
DEFAULT_PLAN_LIMITS = {
    "name": "Default",
    "requests_per_minute": 60,
    "tokens_per_minute": 100_000,
    "max_concurrent_requests": 8,
    "monthly_token_budget": 10_000_000,
}


def plan_default_ensure() -> Plan:
    """The default plan, recreated with its stock limits if someone deleted it."""
    plan = plan_default()
    if plan is None:
        plan, _ = Plan.objects.get_or_create(slug=DEFAULT_PLAN_SLUG, defaults=DEFAULT_PLAN_LIMITS)
    return plan


@transaction.atomic
def tenant_create(
    *,
    slug: str,
    name: str = "",
    plan: Plan | None = None,
    owner: AbstractBaseUser | None = None,
    **limits: int | None,
) -> Tenant:
    """Create a tenant on ``plan`` (the default plan when omitted), with optional overrides
    of the plan's limits and an optional owner."""
    _check_limits(limits)
    plan = plan or plan_default_ensure()
    tenant = Tenant(slug=slug, name=name or slug, plan=plan, **limits)
    tenant.full_clean()
    tenant.save()
    if owner is not None:
        membership_set(tenant=tenant, user=owner, role=Membership.Role.OWNER)
    return tenant


@transaction.atomic
def membership_set(*, tenant: Tenant, user: AbstractBaseUser, role: str) -> Membership:
    """Give ``user`` the ``role`` in ``tenant``, creating the membership if needed."""
    if role not in Membership.Role.values:
        raise ValidationError({"role": f"Unknown role {role!r}."})
    membership, _ = Membership.objects.update_or_create(
        tenant=tenant, user=user, defaults={"role": role}
    )
    return membership


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
    **limits: int | None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its plaintext, which is never stored or shown again."""
    _check_limits(limits)
    for _ in range(5):
        raw_key = api_keys.generate_key()
        api_key = ApiKey(
            tenant=tenant,
            name=name,
            prefix=api_keys.parse_prefix(raw_key),
            key_hash=api_keys.hash_key(raw_key),
            created_by=created_by,
            expires_at=expires_at,
            **limits,
        )
        api_key.full_clean(exclude=["prefix", "key_hash"])
        try:
            with transaction.atomic():
                api_key.save()
        except IntegrityError:
            continue  # a prefix collision: astronomically rare, but never fatal
        return api_key, raw_key
    raise RuntimeError("Could not allocate a unique API key prefix.")


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def api_key_authenticate(*, raw_key: str) -> ApiKey:
    """The live key matching ``raw_key``, with its tenant and plan loaded.

    Looks the key up by its prefix and compares hashes in constant time. Raises
    ``ApiKeyInvalid`` for a malformed, unknown, wrong, revoked or expired key. The tenant's
    own state (active or not) is for the caller to judge.
    """
    prefix = api_keys.parse_prefix(raw_key)
    if prefix is None:
        raise ApiKeyInvalid("malformed")
    api_key = ApiKey.objects.select_related("tenant__plan").filter(prefix=prefix).first()
    if api_key is None:
        raise ApiKeyInvalid("unknown")
    if not api_keys.hashes_match(raw_key, api_key.key_hash):
        raise ApiKeyInvalid("mismatch")
    now = timezone.now()
    if api_key.is_revoked:
        raise ApiKeyInvalid("revoked")
    if api_key.is_expired(now):
        raise ApiKeyInvalid("expired")
    if api_key.last_used_at is None or now - api_key.last_used_at >= LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key


aapi_key_authenticate = sync_to_async(api_key_authenticate)


def usage_record_build(
    *,
    request_id: str,
    tenant: Tenant,
    model: str,
    source: str,
    status: str,
    started_at: datetime,
    finished_at: datetime,
    api_key: ApiKey | None = None,
    user: AbstractBaseUser | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    time_to_first_token_ms: float | None = None,
    latency_ms: float | None = None,
    error_code: str = "",
) -> UsageRecord:
    """One request's usage record, validated and not yet saved."""
    if api_key is None and user is None:
        raise ValidationError("A usage record needs an API key or a user.")
    if api_key is not None and api_key.tenant_id != tenant.pk:
        raise ValidationError("The API key belongs to another tenant.")
    record = UsageRecord(
        request_id=request_id,
        tenant=tenant,
        api_key=api_key,
        user=user,
        model=model,
        source=source,
        status=status,
        started_at=started_at,
        finished_at=finished_at,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        time_to_first_token_ms=time_to_first_token_ms,
        latency_ms=latency_ms,
        error_code=error_code,
    )
    record.full_clean(exclude=["tenant", "api_key", "user", "request_id"])
    return record


def usage_record_create(**fields: object) -> UsageRecord:
    """Record one request's usage, exactly once: a second call with the same ``request_id``
    returns the first record unchanged. Takes ``usage_record_build``'s arguments."""
    record = usage_record_build(**fields)
    try:
        with transaction.atomic():
            record.save()
    except IntegrityError:
        return UsageRecord.objects.get(request_id=record.request_id, tenant=record.tenant)
    return record


def usage_records_save(records: list[UsageRecord]) -> None:
    """Save built records in one transaction (one statement per few hundred rows). A record
    whose ``request_id`` is already there is skipped, leaving the first one as it was."""
    UsageRecord.objects.bulk_create(records, ignore_conflicts=True)


class LastOwnerError(ValidationError):
    pass


@transaction.atomic
def membership_remove(*, membership: Membership) -> None:
    """Remove a member; a tenant always keeps at least one owner."""
    _keep_an_owner(membership, new_role=None)
    membership.delete()


@transaction.atomic
def membership_change_role(*, membership: Membership, role: str) -> Membership:
    if role not in Membership.Role.values:
        raise ValidationError({"role": f"Unknown role {role!r}."})
    _keep_an_owner(membership, new_role=role)
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


def _keep_an_owner(membership: Membership, new_role: str | None) -> None:
    if membership.role != Membership.Role.OWNER or new_role == Membership.Role.OWNER:
        return
    owners = Membership.objects.select_for_update().filter(
        tenant_id=membership.tenant_id, role=Membership.Role.OWNER
    )
    if owners.count() <= 1:
        raise LastOwnerError("A tenant must keep at least one owner.")
