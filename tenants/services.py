"""Writes: tenants, memberships, API keys and usage records.

Functions take keyword-only arguments (``usage_records_save`` takes its list), validate
before writing and write in one transaction. A change to a tenant's set-up (its creation,
members and keys) writes its audit event in that transaction, naming ``actor`` (None: the
platform itself). They are synchronous: async callers (the gateway, the chat consumer) run
them on a database thread of their own.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, models, transaction
from django.utils import timezone

from tenants import api_keys
from tenants.audit import audit_record, field_changes, model_values
from tenants.models import ApiKey, AuditEvent, Membership, Plan, Tenant, UsageRecord
from tenants.selectors import DEFAULT_PLAN_SLUG, LIMIT_FIELDS, plan_default, tenants_owned_alone

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
        plan, created = Plan.objects.get_or_create(
            slug=DEFAULT_PLAN_SLUG, defaults=DEFAULT_PLAN_LIMITS
        )
        if created:
            audit_record(
                action=AuditEvent.Action.PLAN_CREATED,
                actor=None,
                target=plan,
                changes=field_changes({}, DEFAULT_PLAN_LIMITS),
            )
    return plan


# the fields of a tenant and of a key that their creation's audit event lists
TENANT_AUDITED_FIELDS = (
    "name", "slug", "plan", "is_active", *LIMIT_FIELDS, "max_queued_batch_tokens",
    "max_file_storage_bytes",
)  # fmt: skip
API_KEY_AUDITED_FIELDS = ("name", "expires_at", *LIMIT_FIELDS)


@transaction.atomic
def tenant_create(
    *,
    slug: str,
    name: str = "",
    plan: Plan | None = None,
    owner: AbstractBaseUser | None = None,
    actor: AbstractBaseUser | None = None,
    **limits: int | None,
) -> Tenant:
    """Create a tenant on ``plan`` (the default plan when omitted), with optional overrides
    of the plan's limits and an optional owner."""
    _check_limits(limits)
    plan = plan or plan_default_ensure()
    tenant = Tenant(slug=slug, name=name or slug, plan=plan, **limits)
    tenant.full_clean()
    tenant.save()
    audit_record(
        action=AuditEvent.Action.TENANT_CREATED,
        actor=actor,
        target=tenant,
        tenant=tenant,
        changes=field_changes({}, model_values(tenant, TENANT_AUDITED_FIELDS)),
    )
    if owner is not None:
        # the actor's rights were not asked for: whoever may create a tenant names its owner
        membership_set(
            tenant=tenant, user=owner, role=Membership.Role.OWNER, actor=None, audit_actor=actor
        )
    return tenant


# Ten years: a longer life is as good as "never" (leave it empty), and a day count without a
# bound overflows datetime arithmetic.
MAX_KEY_LIFETIME_DAYS = 3650


def api_key_expires_at(*, days: int | None) -> datetime | None:
    """When a key created now to live ``days`` days expires; None (never) for None."""
    if days is None:
        return None
    if not 1 <= days <= MAX_KEY_LIFETIME_DAYS:
        raise ValidationError(
            {"expires_in_days": f"A key expires in from 1 to {MAX_KEY_LIFETIME_DAYS} days."}
        )
    return timezone.now() + timedelta(days=days)


def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
    actor: AbstractBaseUser | None = None,
    **limits: int | None,
) -> tuple[ApiKey, str]:
    """Create a key and return it with its plaintext, which is never stored or shown again.
    ``created_by`` is who the console shows made it; ``actor`` who did, for the audit log (a
    command that makes a tenant's first key for its owner is the platform's doing)."""
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
                audit_record(
                    action=AuditEvent.Action.API_KEY_CREATED,
                    actor=actor,
                    target=api_key,
                    tenant=tenant,
                    changes=field_changes({}, model_values(api_key, API_KEY_AUDITED_FIELDS)),
                )
        except IntegrityError:
            continue  # a prefix collision: astronomically rare, but never fatal
        return api_key, raw_key
    raise RuntimeError("Could not allocate a unique API key prefix.")


# What a key created without a name is called (the console's name field is optional).
UNNAMED_KEY_NAME = "unnamed"


def api_key_issue(
    *,
    tenant: Tenant,
    name: str,
    created_by: AbstractBaseUser | None,
    expires_in_days: int | None,
) -> tuple[ApiKey, str]:
    """Create a key that lives ``expires_in_days`` days (None: until revoked), called
    ``UNNAMED_KEY_NAME`` when ``name`` is blank; the key and its plaintext, as
    ``api_key_create`` returns them."""
    return api_key_create(
        tenant=tenant,
        name=name.strip() or UNNAMED_KEY_NAME,
        created_by=created_by,
        expires_at=api_key_expires_at(days=expires_in_days),
        actor=created_by,
    )


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, actor: AbstractBaseUser | None = None) -> ApiKey:
    """Revoke the key, once: a key revoked already (here or by a revocation at the same
    time) keeps its time, and its revocation is in the audit log once. Saved, not updated,
    so that the API's caches hear of it (``gateway.authorization``)."""
    stored = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    if stored.revoked_at is None:
        stored.revoked_at = timezone.now()
        stored.save(update_fields=["revoked_at"])
        audit_record(
            action=AuditEvent.Action.API_KEY_REVOKED,
            actor=actor,
            target=stored,
            tenant=api_key.tenant,
        )
    api_key.revoked_at = stored.revoked_at
    return api_key


def api_keys_revoke_made_by(
    *, user: AbstractBaseUser, tenant: Tenant | None, actor: AbstractBaseUser | None
) -> int:
    """Revoke the live keys ``user`` made in ``tenant`` (None: in every tenant): who leaves a
    tenant (removed, deactivated, deleted) takes the keys they made with them, as OpenAI's
    keys go with their member, and as the console tells whoever removes one. Each
    revocation is in the audit log; the number revoked."""
    keys = ApiKey.objects.select_related("tenant").filter(created_by=user, revoked_at__isnull=True)
    if tenant is not None:
        keys = keys.filter(tenant=tenant)
    revoked = 0
    for api_key in keys:
        api_key_revoke(api_key=api_key, actor=actor)
        revoked += 1
    return revoked


def api_key_revoke_by_id(
    *, tenant: Tenant, api_key_id: int | None, actor: AbstractBaseUser | None = None
) -> ApiKey:
    """Revoke the tenant's key ``api_key_id``. Raises ``ApiKey.DoesNotExist`` when the tenant
    has no such key: another tenant's key is never touched."""
    api_key = ApiKey.objects.select_related("tenant").get(tenant=tenant, pk=api_key_id)
    return api_key_revoke(api_key=api_key, actor=actor)


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


def billed_tokens(*, tenant: Tenant, source: str, tokens: int) -> Decimal:
    """What ``tokens`` of ``source`` are billed as now, in online tokens: batch tokens at the
    tenant's plan's ``batch_price_factor`` (OpenAI's Batch API bills them at half price),
    every other token one. Read from the plan the caller loaded with the tenant (the batch
    runner loads it), so a record costs no query for it."""
    if source == UsageRecord.Source.BATCH:
        return tokens * tenant.plan.batch_price_factor
    return Decimal(tokens)


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
    end_user: str = "",
    metadata: dict[str, str] | None = None,
) -> UsageRecord:
    """One request's usage record, validated and not yet saved, billed at the tenant's plan
    of now (``billed_tokens``): the record keeps what it costs, whatever plan comes later."""
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
        billed_tokens=billed_tokens(
            tenant=tenant, source=source, tokens=prompt_tokens + completion_tokens
        ),
        time_to_first_token_ms=time_to_first_token_ms,
        latency_ms=latency_ms,
        error_code=error_code,
        end_user=end_user,
        metadata=metadata,
    )
    record.full_clean(exclude=["tenant", "api_key", "user", "request_id"])
    return record


def usage_records_save(records: list[UsageRecord]) -> None:
    """Save built records in one transaction (one statement per few hundred rows). A record
    whose ``request_id`` is already there is skipped, leaving the first one as it was.

    A record naming a key or user deleted while its request ran is saved without that name,
    as the deletion left the records written before it (SET_NULL): its foreign key would fail
    the whole transaction at commit, and the request would go unmetered. On PostgreSQL the
    keys are checked as each row goes in, so a deletion committed between the check and the
    insert fails that row alone (the settlement then saves it on its own, checked again),
    not the group's transaction."""
    if connection.vendor == "postgresql" and connection.in_atomic_block:
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    _forget_deleted(records, "api_key", ApiKey.objects)
    _forget_deleted(records, "user", get_user_model().objects)
    UsageRecord.objects.bulk_create(records, ignore_conflicts=True)


def _forget_deleted(records: list[UsageRecord], field: str, rows: models.Manager) -> None:
    ids = {getattr(record, f"{field}_id") for record in records} - {None}
    if not ids:
        return
    live = set(rows.filter(pk__in=ids).values_list("pk", flat=True))
    for record in records:
        if getattr(record, f"{field}_id") not in live:
            setattr(record, field, None)


# --- memberships ---------------------------------------------------------------------------
#
# Two rules hold for every caller (the console, the admin, commands): only a tenant's owners
# (or platform staff) touch an owner's membership or make owners, and no change leaves a
# tenant that has an owner without one. ``actor`` is the person making the change, or None
# for the platform itself (a management command, the demo bootstrap); it is keyword-only
# and has no default so that no caller skips the first rule by forgetting it.


class LastOwnerError(ValidationError):
    pass


class OwnerRequiredError(ValidationError):
    pass


class MembershipNotAllowed(ValidationError):
    pass


@dataclass(frozen=True)
class MembershipChange:
    user: AbstractBaseUser
    role: str | None  # None removes the user's membership


def memberships_check(
    *, tenant: Tenant, changes: list[MembershipChange], actor: AbstractBaseUser | None
) -> None:
    """Raise unless ``actor`` may make all of ``changes`` and the tenant keeps an owner."""
    for change in changes:
        if change.role is not None and change.role not in Membership.Role.values:
            raise ValidationError({"role": f"Unknown role {change.role!r}."})
    current = dict(
        Membership.objects.filter(tenant=tenant, user__in=[c.user for c in changes]).values_list(
            "user_id", "role"
        )
    )
    real = [c for c in changes if current.get(c.user.pk) != c.role]
    if actor is not None:
        _check_actor(
            tenant=tenant, actor=actor, roles=[(current.get(c.user.pk), c.role) for c in real]
        )
    # An inactive owner cannot sign in to act as one, so only active ones count.
    owners = set(
        Membership.objects.filter(
            tenant=tenant, role=Membership.Role.OWNER, user__is_active=True
        ).values_list("user_id", flat=True)
    )
    had_owner = bool(owners)
    for change in real:
        if change.role == Membership.Role.OWNER and change.user.is_active:
            owners.add(change.user.pk)
        else:
            owners.discard(change.user.pk)
    if had_owner and not owners:
        raise LastOwnerError("A tenant must keep at least one owner.")


def role_give_check(*, tenant: Tenant, actor: AbstractBaseUser, role: str) -> None:
    """Raise unless ``actor`` may give ``role`` in ``tenant`` to someone not in it."""
    if role not in Membership.Role.values:
        raise ValidationError({"role": f"Unknown role {role!r}."})
    _check_actor(tenant=tenant, actor=actor, roles=[(None, role)])


def _check_actor(
    *, tenant: Tenant, actor: AbstractBaseUser, roles: list[tuple[str | None, str | None]]
) -> None:
    """Raise unless ``actor`` may make each change of a role ``(before, after)`` (None: not a
    member)."""
    if actor.is_staff and (
        actor.has_perm("tenants.change_membership")
        or (
            actor.has_perm("tenants.add_membership")
            and all(before is None and after for before, after in roles)
        )
    ):
        return  # staff who may change memberships in the admin, or add these ones
    role = (
        Membership.objects.filter(tenant=tenant, user=actor).values_list("role", flat=True).first()
    )
    if role == Membership.Role.OWNER:
        return
    if role != Membership.Role.ADMIN:
        raise MembershipNotAllowed("Only a tenant's owners and admins manage its members.")
    for before_and_after in roles:
        if Membership.Role.OWNER in before_and_after:
            raise OwnerRequiredError("Only an owner can change an owner or make owners.")


@transaction.atomic
def memberships_apply(
    *,
    tenant: Tenant,
    changes: list[MembershipChange],
    actor: AbstractBaseUser | None,
    audit_actor: AbstractBaseUser | None = None,
    audit_changes: dict[str, list] | None = None,
) -> None:
    """Make ``changes`` together (the admin's tenant page saves several rows at once), after
    ``memberships_check`` of ``actor``'s rights (None: none asked for), each in the audit log
    as ``actor``'s (or ``audit_actor``'s, where the rights were not asked for), with
    ``audit_changes`` beside the role's (how it came about: an invitation)."""
    # One membership change per tenant at a time: two admins each removing one of two owners
    # would otherwise both see an owner left.
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    memberships_check(tenant=tenant, changes=changes, actor=actor)
    for change in changes:
        previous = (
            Membership.objects.filter(tenant=tenant, user=change.user)
            .values_list("role", flat=True)
            .first()
        )
        if previous == change.role:
            continue
        if change.role is None:
            Membership.objects.filter(tenant=tenant, user=change.user).delete()
            api_keys_revoke_made_by(user=change.user, tenant=tenant, actor=actor or audit_actor)
        else:
            Membership.objects.update_or_create(
                tenant=tenant, user=change.user, defaults={"role": change.role}
            )
        audit_record(
            action=_MEMBERSHIP_ACTIONS[previous is None, change.role is None],
            actor=actor or audit_actor,
            target=change.user,
            tenant=tenant,
            changes={"role": [previous, change.role], **(audit_changes or {})},
        )


# (was not a member, is not one now) -> what the change was
_MEMBERSHIP_ACTIONS = {
    (True, False): AuditEvent.Action.MEMBER_ADDED,
    (False, False): AuditEvent.Action.MEMBER_ROLE_CHANGED,
    (False, True): AuditEvent.Action.MEMBER_REMOVED,
}


def membership_set(
    *,
    tenant: Tenant,
    user: AbstractBaseUser,
    role: str,
    actor: AbstractBaseUser | None,
    audit_actor: AbstractBaseUser | None = None,
) -> Membership:
    """Give ``user`` the ``role`` in ``tenant``, creating the membership if needed."""
    memberships_apply(
        tenant=tenant,
        changes=[MembershipChange(user, role)],
        actor=actor,
        audit_actor=audit_actor,
    )
    return Membership.objects.get(tenant=tenant, user=user)


def membership_change_role(
    *, membership: Membership, role: str, actor: AbstractBaseUser | None
) -> Membership:
    return membership_set(tenant=membership.tenant, user=membership.user, role=role, actor=actor)


def membership_remove(*, membership: Membership, actor: AbstractBaseUser | None) -> None:
    memberships_apply(
        tenant=membership.tenant, changes=[MembershipChange(membership.user, None)], actor=actor
    )


def _tenant_membership(*, tenant: Tenant, membership_id: int | None) -> Membership:
    return Membership.objects.select_related("tenant", "user").get(tenant=tenant, pk=membership_id)


def membership_change_role_by_id(
    *, tenant: Tenant, membership_id: int | None, role: str, actor: AbstractBaseUser | None
) -> Membership:
    """``membership_change_role`` for the tenant's membership ``membership_id``; raises
    ``Membership.DoesNotExist`` when the tenant has none by that id."""
    membership = _tenant_membership(tenant=tenant, membership_id=membership_id)
    return membership_change_role(membership=membership, role=role, actor=actor)


def membership_remove_by_id(
    *, tenant: Tenant, membership_id: int | None, actor: AbstractBaseUser | None
) -> None:
    """``membership_remove`` for the tenant's membership ``membership_id``; raises
    ``Membership.DoesNotExist`` when the tenant has none by that id."""
    membership = _tenant_membership(tenant=tenant, membership_id=membership_id)
    membership_remove(membership=membership, actor=actor)


def users_removal_check(*, users: list[AbstractBaseUser]) -> None:
    """Raise ``LastOwnerError`` when deactivating or deleting ``users`` together would leave a
    tenant without an active owner."""
    alone = tenants_owned_alone(users=users)
    if alone:
        slugs = ", ".join(tenant.slug for tenant in alone)
        names = ", ".join(user.get_username() for user in users)
        raise LastOwnerError(
            f"{names}: the last owner of {slugs}. Make someone else an owner first."
        )


@transaction.atomic
def user_deactivate(*, user: AbstractBaseUser, actor: AbstractBaseUser | None = None) -> None:
    """Deactivate a user, unless that leaves a tenant without an owner."""
    tenant_ids = Membership.objects.filter(user=user, role=Membership.Role.OWNER).values("tenant")
    list(Tenant.objects.select_for_update().filter(pk__in=tenant_ids))
    users_removal_check(users=[user])
    if not user.is_active:
        return
    user.is_active = False
    user.save(update_fields=["is_active"])
    audit_record(
        action=AuditEvent.Action.USER_UPDATED,
        actor=actor,
        target=user,
        changes={"is_active": [True, False]},
    )
    api_keys_revoke_made_by(user=user, tenant=None, actor=actor)
