"""Invitations to join a tenant: how its owners and admins bring someone in.

An owner or admin (or staff who may add members) makes an invitation for a role and gets a
link, shown once: it carries a random code of which only the SHA-256 is kept. A signed-in user
who opens the link sees the tenant and the role and accepts. Nobody becomes a member without
accepting, and making one asks for no name, so no answer tells which users exist (adding a
user by name did both).

An invitation is used once, before it expires, unless revoked; and it gives its role only
while its maker still may give it (a maker removed from the tenant, deactivated or made a plain
member since invites nobody). The acceptance is the member's own change in the audit log,
naming the invitation and its maker.
"""

import hashlib
import secrets
from datetime import timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tenants.audit import audit_record
from tenants.models import AuditEvent, Invitation, Membership, Tenant
from tenants.services import MembershipChange, memberships_apply, role_give_check

CODE_PREFIX = "inv_"
# a closed invitation (used, revoked, expired) is kept this long, then purged (the audit log
# keeps its story)
CLOSED_KEPT_DAYS = 30
EXPIRY_DAYS = (1, 7, 30)
DEFAULT_EXPIRY_DAYS = 7


class InvitationInvalid(Exception):
    """The code names no invitation that may be accepted now; the message says why, in
    words for the person who opened the link."""


def _code_hash(code: str) -> str:
    return hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()


@transaction.atomic
def invitation_create(
    *,
    tenant: Tenant,
    role: str,
    actor: AbstractBaseUser,
    expires_in_days: int = DEFAULT_EXPIRY_DAYS,
    note: str = "",
) -> tuple[Invitation, str]:
    """An invitation to ``tenant`` as ``role``, made by ``actor`` (who must be able to give
    the role), and its code: the only time the code exists outside the link. ``note`` says
    whom it is for."""
    if expires_in_days not in EXPIRY_DAYS:
        raise ValidationError({"expires_in_days": f"Expires in one of {EXPIRY_DAYS} days."})
    role_give_check(tenant=tenant, actor=actor, role=role)
    code, now = CODE_PREFIX + secrets.token_urlsafe(24), timezone.now()
    invitation = Invitation.objects.create(
        tenant=tenant,
        role=role,
        code_hash=_code_hash(code),
        note=note.strip()[:200],
        created_by=actor,
        created_at=now,
        expires_at=now + timedelta(days=expires_in_days),
    )
    audit_record(
        action=AuditEvent.Action.INVITATION_CREATED,
        actor=actor,
        target=invitation,
        tenant=tenant,
        changes={
            "role": [None, role],
            "note": [None, invitation.note],
            "expires_at": [None, invitation.expires_at.isoformat()],
        },
    )
    return invitation, code


@transaction.atomic
def invitation_revoke_by_id(
    *, tenant: Tenant, invitation_id: int | None, actor: AbstractBaseUser
) -> Invitation:
    """Revoke ``tenant``'s invitation ``invitation_id`` (once; one used already stays used).
    Whoever could make it may revoke it. Raises ``Invitation.DoesNotExist`` when the tenant
    has none by that id."""
    invitation = Invitation.objects.select_for_update().get(tenant=tenant, pk=invitation_id)
    role_give_check(tenant=tenant, actor=actor, role=invitation.role)
    if invitation.revoked_at is None and invitation.accepted_at is None:
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit_record(
            action=AuditEvent.Action.INVITATION_REVOKED,
            actor=actor,
            target=invitation,
            tenant=tenant,
        )
    return invitation


def code_hash(code: str) -> str:
    """What is kept of a code, and all that a session keeps of the link it opened: the
    invitation is found by it. "" for what is not a code."""
    return _code_hash(code) if code.startswith(CODE_PREFIX) else ""


def invitation_by_code(code: str) -> Invitation:
    """The invitation the code opens, if it may be accepted now; ``InvitationInvalid``
    otherwise."""
    return invitation_by_hash(code_hash(code))


def invitation_by_hash(hashed: str) -> Invitation:
    """The invitation of the code whose ``code_hash`` this is, if it may be accepted now;
    ``InvitationInvalid`` otherwise."""
    invitation = (
        Invitation.objects.select_related("tenant", "created_by").filter(code_hash=hashed).first()
        if hashed
        else None
    )
    if invitation is None:
        raise InvitationInvalid("This link is not an invitation: check that it was copied whole.")
    if invitation.accepted_at is not None:
        raise InvitationInvalid("This invitation was used already: ask for a new one.")
    if invitation.revoked_at is not None:
        raise InvitationInvalid("This invitation was revoked: ask for a new one.")
    if not invitation.is_open():
        raise InvitationInvalid("This invitation has expired: ask for a new one.")
    if not invitation.tenant.is_active:
        raise InvitationInvalid("This tenant is deactivated.")
    return invitation


def invitation_accept(*, code: str, user: AbstractBaseUser) -> Membership:
    """``invitation_accept_by_hash`` of the code."""
    return invitation_accept_by_hash(code_hash=code_hash(code), user=user)


@transaction.atomic
def invitation_accept_by_hash(
    *, code_hash: str, user: AbstractBaseUser, invitation_id: int | None = None
) -> Membership:
    """Make ``user`` a member of the invitation's tenant in its role, and use it up.
    ``InvitationInvalid`` when it may not be accepted (used, revoked, expired, its maker no
    longer able to give the role, ``user`` a member already: then it stays open), or when it
    is not ``invitation_id`` (the one the accepting page showed, where another link was
    opened since). The member's addition in the audit log names the invitation and its
    maker."""
    found = invitation_by_hash(code_hash)
    if invitation_id is not None and found.pk != invitation_id:
        raise InvitationInvalid(
            "Another invitation link was opened since this page was shown: open the link of "
            "the one you mean to accept again."
        )
    # the tenant's membership lock first (as every membership change takes it), then the
    # invitation: two acceptances of one link at once, one of them wins
    Tenant.objects.select_for_update().filter(pk=found.tenant_id).first()
    invitation = Invitation.objects.select_for_update().get(pk=found.pk)
    if not invitation.is_open():
        raise InvitationInvalid("This invitation was used or revoked just now.")
    tenant = found.tenant
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise InvitationInvalid(f"You are a member of {tenant.name} already.")
    maker = found.created_by
    if not maker_may_give(invitation, maker):
        raise InvitationInvalid(
            "Whoever made this invitation can no longer give its role: ask for a new one."
        )
    memberships_apply(
        tenant=tenant,
        changes=[MembershipChange(user, invitation.role)],
        actor=None,
        audit_actor=user,
        audit_changes={
            "invitation": [None, invitation.pk],
            "invited_by": [None, maker.get_username()],
        },
    )
    invitation.accepted_by, invitation.accepted_at = user, timezone.now()
    invitation.save(update_fields=["accepted_by", "accepted_at"])
    return Membership.objects.get(tenant=tenant, user=user)


def maker_may_give(invitation: Invitation, maker: AbstractBaseUser | None) -> bool:
    """Whether the invitation's maker (its ``created_by``) may still give its role."""
    if maker is None or not maker.is_active:
        return False
    try:
        role_give_check(tenant=invitation.tenant, actor=maker, role=invitation.role)
    except ValidationError:
        return False
    return True


def tenant_invitations_open(*, tenant: Tenant) -> list[Invitation]:
    """The tenant's invitations not used, revoked or expired, newest first; each says
    whether it still works (``is_usable``: its maker may still give its role)."""
    invitations = list(
        Invitation.objects.filter(
            tenant=tenant,
            accepted_at__isnull=True,
            revoked_at__isnull=True,
            expires_at__gt=timezone.now(),
        )
        .select_related("tenant", "created_by")
        .order_by("-created_at")
    )
    for invitation in invitations:
        invitation.is_usable = maker_may_give(invitation, invitation.created_by)
    return invitations


def invitations_purge_closed(now=None) -> int:
    """Delete the invitations closed more than ``CLOSED_KEPT_DAYS`` ago; the number deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=CLOSED_KEPT_DAYS)
    deleted, _ = Invitation.objects.filter(
        Q(accepted_at__lt=cutoff) | Q(revoked_at__lt=cutoff) | Q(expires_at__lt=cutoff)
    ).delete()
    return deleted
