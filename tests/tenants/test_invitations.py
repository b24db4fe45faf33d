"""Invitations: made by whoever may give their role, accepted once by a signed-in user,
revoked, expired, and worthless once their maker may no longer give the role."""

import hashlib
import threading
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone

from tenants import invitations, services
from tenants.invitations import InvitationInvalid
from tenants.models import AuditEvent, Invitation, Membership
from tenants.tasks import purge_closed_invitations
from tests.conftest import staff_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def crew(crew, django_user_model):
    """Acme's owner, admin and member, and a guest of no tenant."""
    return {**crew, "guest": django_user_model.objects.create_user("guest")}


def _role(tenant, user) -> str | None:
    return (
        Membership.objects.filter(tenant=tenant, user=user).values_list("role", flat=True).first()
    )


def test_an_invitation_is_a_code_kept_only_as_its_hash_and_accepted_once(
    crew, tenant, django_user_model
):
    invitation, code = invitations.invitation_create(
        tenant=tenant, role="admin", actor=crew["admin"]
    )
    assert code.startswith("inv_") and len(code) > 30
    assert invitation.code_hash == hashlib.sha256(code.encode()).hexdigest()
    assert code not in str(Invitation.objects.filter(pk=invitation.pk).values().get())
    assert _role(tenant, crew["guest"]) is None  # nobody joins without accepting

    membership = invitations.invitation_accept(code=code, user=crew["guest"])
    assert membership.role == "admin" and _role(tenant, crew["guest"]) == "admin"
    invitation.refresh_from_db()
    assert invitation.accepted_by == crew["guest"] and invitation.accepted_at is not None
    other = django_user_model.objects.create_user("other")
    with pytest.raises(InvitationInvalid, match="used already"):
        invitations.invitation_accept(code=code, user=other)
    assert _role(tenant, other) is None


def test_the_audit_log_names_the_maker_the_revoker_and_the_member_who_accepted(crew, tenant):
    invitation, code = invitations.invitation_create(
        tenant=tenant, role="member", actor=crew["owner"]
    )
    invitations.invitation_accept(code=code, user=crew["guest"])
    revoked, _ = invitations.invitation_create(tenant=tenant, role="admin", actor=crew["owner"])
    invitations.invitation_revoke_by_id(
        tenant=tenant, invitation_id=revoked.pk, actor=crew["admin"]
    )
    invitations.invitation_revoke_by_id(
        tenant=tenant, invitation_id=revoked.pk, actor=crew["admin"]
    )
    events = [
        (event.action, event.actor_name, event.changes.get("role"))
        for event in AuditEvent.objects.filter(tenant=tenant, created_at__gte=invitation.created_at)
        .exclude(action=AuditEvent.Action.MEMBER_ADDED, actor_name="")
        .order_by("pk")
    ]
    assert events == [
        (AuditEvent.Action.INVITATION_CREATED, "owner", [None, "member"]),
        (AuditEvent.Action.MEMBER_ADDED, "guest", [None, "member"]),
        (AuditEvent.Action.INVITATION_CREATED, "owner", [None, "admin"]),
        (AuditEvent.Action.INVITATION_REVOKED, "admin", None),  # once
    ]
    added = AuditEvent.objects.get(action=AuditEvent.Action.MEMBER_ADDED, actor_name="guest")
    assert added.changes["invited_by"] == [None, "owner"]
    assert added.changes["invitation"] == [None, invitation.pk]


def test_only_who_may_give_a_role_invites_to_it(crew, tenant):
    with pytest.raises(services.MembershipNotAllowed):
        invitations.invitation_create(tenant=tenant, role="member", actor=crew["member"])
    with pytest.raises(services.OwnerRequiredError):
        invitations.invitation_create(tenant=tenant, role="owner", actor=crew["admin"])
    with pytest.raises(services.MembershipNotAllowed):
        invitations.invitation_create(tenant=tenant, role="member", actor=crew["guest"])
    with pytest.raises(ValidationError):
        invitations.invitation_create(tenant=tenant, role="root", actor=crew["owner"])
    with pytest.raises(ValidationError):
        invitations.invitation_create(
            tenant=tenant, role="member", actor=crew["owner"], expires_in_days=3650
        )
    assert not Invitation.objects.exists()
    _, code = invitations.invitation_create(tenant=tenant, role="owner", actor=crew["owner"])
    invitations.invitation_accept(code=code, user=crew["guest"])
    assert _role(tenant, crew["guest"]) == "owner"
    staff = staff_user("clerk", "tenants.add_membership")
    invitations.invitation_create(tenant=tenant, role="admin", actor=staff)


def test_an_invitation_dies_with_its_makers_right_to_give_the_role(crew, tenant):
    """An admin removed from the tenant (or made a plain member, or deactivated) kept the
    power to bring people in through the links they had made."""
    _, removed_code = invitations.invitation_create(
        tenant=tenant, role="admin", actor=crew["admin"]
    )
    services.membership_remove(
        membership=Membership.objects.get(tenant=tenant, user=crew["admin"]), actor=crew["owner"]
    )
    with pytest.raises(InvitationInvalid, match="can no longer give its role"):
        invitations.invitation_accept(code=removed_code, user=crew["guest"])
    assert _role(tenant, crew["guest"]) is None

    services.membership_set(tenant=tenant, user=crew["admin"], role="admin", actor=None)
    _, code = invitations.invitation_create(tenant=tenant, role="member", actor=crew["admin"])
    crew["admin"].is_active = False
    crew["admin"].save()
    with pytest.raises(InvitationInvalid, match="can no longer give its role"):
        invitations.invitation_accept(code=code, user=crew["guest"])
    crew["admin"].is_active = True
    crew["admin"].save()
    invitations.invitation_accept(code=code, user=crew["guest"])  # still open: it works now
    assert _role(tenant, crew["guest"]) == "member"


def test_expired_revoked_unknown_and_already_member(crew, tenant):
    invitation, code = invitations.invitation_create(
        tenant=tenant, role="member", actor=crew["owner"]
    )
    with pytest.raises(InvitationInvalid, match="member of Acme already"):
        invitations.invitation_accept(code=code, user=crew["admin"])
    assert _role(tenant, crew["admin"]) == "admin"  # no change of role through a link
    assert Invitation.objects.get(pk=invitation.pk).is_open()  # and the link still works

    Invitation.objects.filter(pk=invitation.pk).update(expires_at=timezone.now() - timedelta(1))
    with pytest.raises(InvitationInvalid, match="expired"):
        invitations.invitation_accept(code=code, user=crew["guest"])
    revoked, revoked_code = invitations.invitation_create(
        tenant=tenant, role="member", actor=crew["owner"]
    )
    invitations.invitation_revoke_by_id(
        tenant=tenant, invitation_id=revoked.pk, actor=crew["owner"]
    )
    with pytest.raises(InvitationInvalid, match="revoked"):
        invitations.invitation_accept(code=revoked_code, user=crew["guest"])
    for wrong in ("", "inv_nothing", code[:-1], "inv_\x00", "x" * 10_000, "inv_\ud800"):
        with pytest.raises(InvitationInvalid, match="not an invitation"):
            invitations.invitation_by_code(wrong)
    tenant.is_active = False
    tenant.save()
    _, fresh = invitations.invitation_create(tenant=tenant, role="member", actor=crew["owner"])
    with pytest.raises(InvitationInvalid, match="deactivated"):
        invitations.invitation_accept(code=fresh, user=crew["guest"])
    assert _role(tenant, crew["guest"]) is None


def test_only_who_may_give_its_role_revokes_and_only_within_the_tenant(crew, tenant, other_tenant):
    invitation, _ = invitations.invitation_create(tenant=tenant, role="owner", actor=crew["owner"])
    with pytest.raises(services.OwnerRequiredError):
        invitations.invitation_revoke_by_id(
            tenant=tenant, invitation_id=invitation.pk, actor=crew["admin"]
        )
    with pytest.raises(Invitation.DoesNotExist):
        invitations.invitation_revoke_by_id(
            tenant=other_tenant, invitation_id=invitation.pk, actor=crew["owner"]
        )
    assert Invitation.objects.get(pk=invitation.pk).is_open()
    assert invitations.tenant_invitations_open(tenant=tenant) == [invitation]
    assert invitations.tenant_invitations_open(tenant=other_tenant) == []


@pytest.mark.django_db(transaction=True)
def test_two_acceptances_of_one_link_at_once_make_one_member(django_user_model, tenant):
    if connection.vendor != "postgresql":
        pytest.skip("rows lock on PostgreSQL (SQLite runs one writer at a time)")
    owner = django_user_model.objects.create_user("boss")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    guests = [django_user_model.objects.create_user(f"guest{i}") for i in range(2)]
    _, code = invitations.invitation_create(tenant=tenant, role="member", actor=owner)
    barrier, outcomes = threading.Barrier(2), []

    def accept(user) -> None:
        barrier.wait()
        try:
            invitations.invitation_accept(code=code, user=user)
            outcomes.append("joined")
        except InvitationInvalid:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=accept, args=(guest,)) for guest in guests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["joined", "refused"]
    assert Membership.objects.filter(tenant=tenant, user__in=guests).count() == 1


def test_closed_invitations_are_purged_a_month_on(crew, tenant):
    used, code = invitations.invitation_create(tenant=tenant, role="member", actor=crew["owner"])
    invitations.invitation_accept(code=code, user=crew["guest"])
    revoked, _ = invitations.invitation_create(tenant=tenant, role="member", actor=crew["owner"])
    invitations.invitation_revoke_by_id(
        tenant=tenant, invitation_id=revoked.pk, actor=crew["owner"]
    )
    expired, _ = invitations.invitation_create(tenant=tenant, role="member", actor=crew["owner"])
    Invitation.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(1))
    open_one, _ = invitations.invitation_create(
        tenant=tenant, role="member", actor=crew["owner"], expires_in_days=30
    )
    assert purge_closed_invitations() == 0
    soon = timezone.now() + timedelta(days=invitations.CLOSED_KEPT_DAYS + 1)
    assert invitations.invitations_purge_closed(now=soon) == 3  # the used, revoked, expired
    assert list(Invitation.objects.all()) == [open_one]
