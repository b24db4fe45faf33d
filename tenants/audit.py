"""The audit log: who changed a tenant's or the platform's set-up, what, when and from where.

``audit_record`` adds one ``AuditEvent`` inside the caller's transaction, so a change and its
event commit or roll back together. The services that change keys, members, tenants and
deployments call it with the acting user (None: the platform itself, such as a management
command); ``tenants.audit_admin.AuditedAdmin`` does for the admin's own saves.
``AuditMiddleware`` lends every event written while a request is served that request's client
address (``client_ip``).
"""

import functools
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from datetime import date, datetime
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import models
from django.http import HttpRequest, HttpResponse

from tenants.models import AuditEvent, Tenant

# A secret's change is recorded, never its value.
HIDDEN_VALUE = "(hidden)"
HIDDEN_FIELDS = frozenset({"password", "key_hash"})
MAX_VALUE_CHARS = 1000

_client_ip: ContextVar[str | None] = ContextVar("audit_client_ip", default=None)


def audit_record(
    *,
    action: str,
    actor: AbstractBaseUser | None,
    target: models.Model | None = None,
    target_name: str | None = None,
    tenant: Tenant | None = None,
    changes: Mapping[str, list] | None = None,
) -> AuditEvent:
    """Write the event of ``actor`` doing ``action`` (an ``AuditEvent.Action``) to ``target``
    (named ``target_name``, or as ``str(target)``), within ``tenant`` (None: platform-wide).
    ``changes`` maps fields to ``[before, after]``, as ``field_changes`` builds them."""
    if action not in AuditEvent.Action.values:
        raise ValueError(f"Unknown audit action {action!r}")
    if actor is not None and not actor.is_authenticated:
        actor = None
    if target_name is None:
        target_name = str(target) if target is not None else ""
    return AuditEvent.objects.create(
        action=action,
        tenant=tenant,
        tenant_slug=tenant.slug if tenant is not None else "",
        actor=actor,
        actor_name=actor.get_username() if actor is not None else "",
        ip_address=_client_ip.get(),
        target_id=str(target.pk) if target is not None and target.pk is not None else "",
        target_name=target_name[:300],
        changes=dict(changes or {}),
    )


def model_values(instance: models.Model, names: Iterable[str]) -> dict[str, object]:
    """The audit log's view of ``instance``'s fields ``names``: plain JSON values, related
    objects by name, many-to-many fields as sorted lists of names, secrets hidden."""
    values = {}
    for name in names:
        field = instance._meta.get_field(name)
        if name in HIDDEN_FIELDS:
            values[name] = _Hidden(field.value_from_object(instance))
        elif field.many_to_many:
            values[name] = sorted(str(related) for related in getattr(instance, name).all())
        elif field.is_relation:
            related = getattr(instance, name)
            values[name] = None if related is None else str(related)
        else:
            values[name] = json_value(field.value_from_object(instance))
    return values


def field_changes(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, list]:
    """``{field: [before, after]}`` for each field of ``after`` whose value differs from
    ``before``'s (a field ``before`` lacks was created: its ``before`` is None, and it is
    left out when it is empty). A hidden field that changed shows as changed, not its value."""
    changes = {}
    for name, value in after.items():
        if name not in before:
            if value not in (None, "", [], {}, _Hidden("")):
                changes[name] = [None, _shown(value)]
        elif before[name] != value:
            changes[name] = [_shown(before[name]), _shown(value)]
    return changes


class _Hidden:
    """A secret's value, compared but never written."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hidden) and other.value == self.value

    __hash__ = None


def _shown(value: object) -> object:
    return HIDDEN_VALUE if isinstance(value, _Hidden) else value


def json_value(value: object) -> object:
    """``value`` as JSON can hold it: dates as ISO text, decimals as text, long text cut."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return [json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): json_value(item) for key, item in value.items()}
    text = str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _trusted_proxies() -> tuple[Network, ...]:
    return _networks(tuple(settings.FORWARDED_ALLOW_IPS))


@functools.cache
def _networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """Parsed once per setting (a test may override it), not on every request."""
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in entries)


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address((text or "").strip())
    except ValueError:
        return None


def _is_trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return any(address in network for network in _trusted_proxies())


def client_ip(meta: Mapping[str, str]) -> str | None:
    """The request's client address: the peer's, or, where the peer is a proxy named in
    ``FORWARDED_ALLOW_IPS``, the nearest address in ``X-Forwarded-For`` that is not one (as
    uvicorn and gunicorn read it). A hop that is not an address ends the search there: what
    lies before it was written by the client. None when the peer has no IP address (a unix
    socket)."""
    client = _address(meta.get("REMOTE_ADDR"))
    if client is None or not _is_trusted(client):
        return None if client is None else str(client)
    for hop in reversed(meta.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        address = _address(hop)
        if address is None:
            break
        client = address
        if not _is_trusted(address):
            break
    return str(client)


class AuditMiddleware:
    """Lends the request's client address to the audit events written while serving it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        token = _client_ip.set(client_ip(request.META))
        try:
            return self.get_response(request)
        finally:
            _client_ip.reset(token)
