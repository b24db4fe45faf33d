"""The console's reads of the audit log: a tenant's events (its own only) or the platform's
(every event), newest first, filtered and laid out for the page."""

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db.models import QuerySet

from tenants.models import AuditEvent, Membership, Tenant

# The actions a tenant's log can hold: what is done to it, its members and its keys.
TENANT_ACTIONS = [
    (value, label)
    for value, label in AuditEvent.Action.choices
    if value.split(".")[0] in ("tenant", "member", "api_key", "batch", "conversation")
]
EMPTY = "—"


@dataclass(frozen=True)
class AuditRow:
    event: AuditEvent
    actor: str  # the user's name, or what acted for nobody
    address: str | None  # where from, where the page may show it
    # (field, before, after) as text; before is None for what was created or asked for
    changes: list[tuple[str, str | None, str]]


def tenant_audit_events(*, tenant: Tenant) -> QuerySet[AuditEvent]:
    return AuditEvent.objects.filter(tenant=tenant).order_by("-created_at", "-id")


def platform_audit_events() -> QuerySet[AuditEvent]:
    return AuditEvent.objects.select_related("tenant").order_by("-created_at", "-id")


def audit_filter(
    events: QuerySet[AuditEvent],
    *,
    action: str = "",
    actor: str = "",
    start: date | None = None,
    end: date | None = None,
) -> QuerySet[AuditEvent]:
    """``events`` of ``action``, by the user named ``actor`` (exactly, any case), from
    ``start`` to ``end`` (UTC days, inclusive); an empty or None filter keeps them all."""
    if action:
        events = events.filter(action=action)
    if actor:
        events = events.filter(actor_name__iexact=actor)
    if start is not None:
        events = events.filter(created_at__gte=_midnight(start))
    if end is not None:
        events = events.filter(created_at__lt=_midnight(end) + timedelta(days=1))
    return events


def audit_rows(events: list[AuditEvent], *, tenant: Tenant | None) -> list[AuditRow]:
    """The events as a page shows them: on a tenant's, the address of its own members' events
    only, never staff's (the platform's business: a tenant's admin may add any user as a
    member, staff included, and their addresses then showed)."""
    members = (
        set(
            Membership.objects.filter(
                tenant=tenant, user__is_staff=False, user__is_superuser=False
            ).values_list("user_id", flat=True)
        )
        if tenant is not None
        else None
    )
    return [
        AuditRow(
            event=event,
            actor=event.actor_name or ("the platform" if event.actor_id is None else EMPTY),
            address=event.ip_address if members is None or event.actor_id in members else None,
            changes=[
                (
                    field.replace("_", " "),
                    None if values[0] is None else _text(values[0]),
                    _text(values[-1]),
                )
                for field, values in (event.changes or {}).items()
                if isinstance(values, list) and values
            ],
        )
        for event in events
    ]


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _text(value: object) -> str:
    if value is None:
        return EMPTY
    if value is True or value is False:
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_text(item) for item in value) or "none"
    return str(value)
