"""The console's audit log pages: a tenant's managers read its events only, staff every event;
filters, pages and bad input."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from tenants import invitations, services
from tenants.models import AuditEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def people(django_user_model, tenant, other_tenant):
    make = django_user_model.objects.create_user
    people = {
        "member": make("member", password="pw-member-123"),
        "admin_a": make("admin_a", password="pw-admin-123"),
        "owner_a": make("owner_a", password="pw-owner-123"),
        "owner_b": make("owner_b", password="pw-owner-123"),
        "staff": make("staffer", password="pw-staff-123", is_staff=True, is_superuser=True),
    }
    services.membership_set(tenant=tenant, user=people["member"], role="member", actor=None)
    services.membership_set(tenant=tenant, user=people["admin_a"], role="admin", actor=None)
    services.membership_set(tenant=tenant, user=people["owner_a"], role="owner", actor=None)
    services.membership_set(tenant=other_tenant, user=people["owner_b"], role="owner", actor=None)
    return people


def _audit(slug: str | None = None, **query) -> str:
    url = reverse("console:audit", args=[slug]) if slug else reverse("console:platform-audit")
    return url + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


@pytest.mark.parametrize(
    ("who", "own", "other", "platform"),
    [
        ("member", 404, 404, 302),
        ("admin_a", 200, 404, 302),
        ("owner_a", 200, 404, 302),
        ("staff", 200, 200, 200),
    ],
)
def test_who_reads_which_log(client, people, tenant, other_tenant, who, own, other, platform):
    client.force_login(people[who])
    assert client.get(_audit(tenant.slug)).status_code == own
    assert client.get(_audit(other_tenant.slug)).status_code == other
    assert client.get(_audit()).status_code == platform


def test_a_tenant_reads_its_own_events_only(client, people, tenant, other_tenant):
    services.api_key_create(tenant=tenant, name="acme-key", actor=people["owner_a"])
    services.api_key_create(tenant=other_tenant, name="globex-secret-key", actor=people["owner_b"])
    client.force_login(people["owner_a"])
    page = client.get(_audit(tenant.slug)).content.decode()
    assert "acme-key" in page and "API key created" in page and "owner_a" in page
    assert "globex-secret-key" not in page and "owner_b" not in page

    client.force_login(people["staff"])
    page = client.get(_audit()).content.decode()
    assert "acme-key" in page and "globex-secret-key" in page


def test_console_actions_show_with_who_and_what_changed(client, people, tenant):
    client.force_login(people["owner_a"])
    members = reverse("console:members", args=[tenant.slug])
    membership = tenant.memberships.get(user=people["member"])
    client.post(members, {"action": "role", "membership_id": membership.pk, "role": "admin"})

    page = client.get(_audit(tenant.slug)).content.decode()
    assert "Member&#x27;s role changed" in page or "Member's role changed" in page
    assert "member → admin" in page


def test_the_platform_log_shows_platform_events_and_tenants(client, people, tenant):
    from serving import services as serving_services

    serving_services.deployment_register(
        name="big-model", endpoints=["ipc:///tmp/big.sock"], actor=people["staff"]
    )
    client.force_login(people["staff"])
    page = client.get(_audit()).content.decode()
    assert "Deployment registered" in page and "big-model" in page
    assert reverse("console:audit", args=[tenant.slug]) in page  # a tenant's event links to it

    client.force_login(people["owner_a"])
    assert "big-model" not in client.get(_audit(tenant.slug)).content.decode()


def test_filters_narrow_the_log(client, people, tenant):
    old = services.api_key_create(tenant=tenant, name="old-key", actor=people["admin_a"])[0]
    AuditEvent.objects.filter(target_id=str(old.pk), action="api_key.created").update(
        created_at=timezone.now() - timedelta(days=30)
    )
    services.api_key_create(tenant=tenant, name="new-key", actor=people["owner_a"])
    client.force_login(people["owner_a"])

    assert "<td>Member added<br>" in client.get(_audit(tenant.slug)).content.decode()
    by_action = client.get(_audit(tenant.slug, action="api_key.created")).content.decode()
    assert "old-key" in by_action and "new-key" in by_action
    assert "<td>API key created<br>" in by_action and "<td>Member added<br>" not in by_action
    by_actor = client.get(_audit(tenant.slug, actor="ADMIN_A")).content.decode()
    assert "old-key" in by_actor and "new-key" not in by_actor
    today = timezone.now().date()
    recent = client.get(_audit(tenant.slug, start=today, end=today)).content.decode()
    assert "new-key" in recent and "old-key" not in recent
    backwards = client.get(_audit(tenant.slug, start=today, end=today - timedelta(days=40)))
    assert "old-key" in backwards.content.decode()


@pytest.mark.parametrize(
    "query",
    [
        {"start": "2026-13-01"},
        {"end": "9999-01-01"},
        {"action": "plan.created"},  # a platform action is no tenant's to filter by
        {"action": "%00"},
        {"actor": "x" * 151},
        {"actor": "%00"},
    ],
)
def test_bad_filters_are_a_400_that_shows_the_log_unfiltered(client, people, tenant, query):
    services.api_key_create(tenant=tenant, name="shown-key")
    client.force_login(people["owner_a"])
    response = client.get(_audit(tenant.slug, **query))
    assert response.status_code == 400
    page = response.content.decode()
    assert "shown-key" in page and 'class="msg error"' in page


def test_the_log_pages_by_fifty_and_keeps_its_filters(client, people, tenant):
    for n in range(120):
        services.api_key_create(tenant=tenant, name=f"key-{n:03}")
    client.force_login(people["owner_a"])

    first = client.get(_audit(tenant.slug, action="api_key.created")).content.decode()
    assert "key-119" in first and "key-070" in first and "key-069" not in first
    assert "?action=api_key.created&amp;page=2" in first
    last = client.get(_audit(tenant.slug, action="api_key.created", page=3)).content.decode()
    assert "key-019" in last and "key-020" not in last and "page 3 of 3" in last
    for page in ("abc", "0", "99", "%00"):
        assert client.get(_audit(tenant.slug, page=page)).status_code == 200


def test_names_are_escaped(client, people, tenant):
    services.api_key_create(tenant=tenant, name="<script>alert(1)</script>")
    client.force_login(people["owner_a"])
    page = client.get(_audit(tenant.slug)).content.decode()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page


def test_a_tenants_log_shows_its_members_addresses_not_staffs(client, people, tenant):
    client.force_login(people["owner_a"])
    keys = reverse("console:keys", args=[tenant.slug])
    client.post(keys, {"action": "create", "name": "by-owner"}, REMOTE_ADDR="203.0.113.7")
    client.force_login(people["staff"])
    client.post(keys, {"action": "create", "name": "by-staff"}, REMOTE_ADDR="198.51.100.99")

    client.force_login(people["owner_a"])
    page = client.get(_audit(tenant.slug)).content.decode()
    assert "203.0.113.7" in page and "by-staff" in page and "198.51.100.99" not in page
    client.force_login(people["staff"])
    assert "198.51.100.99" in client.get(_audit()).content.decode()


def test_a_tenants_admin_cannot_reveal_staffs_addresses_by_making_staff_a_member(
    client, people, tenant
):
    """Staff too may join a tenant (by an invitation): their addresses then showed."""
    client.force_login(people["staff"])
    keys = reverse("console:keys", args=[tenant.slug])
    client.post(keys, {"action": "create", "name": "by-staff"}, REMOTE_ADDR="198.51.100.99")

    client.force_login(people["admin_a"])
    invitation, code = invitations.invitation_create(
        tenant=tenant, role="member", actor=people["admin_a"]
    )
    client.force_login(people["staff"])
    client.get(reverse("console:join-link", args=[code]))
    joined = client.post(reverse("console:join"), {"invitation_id": invitation.pk})
    assert joined.status_code == 302
    client.force_login(people["admin_a"])
    assert tenant.memberships.filter(user=people["staff"]).exists()
    page = client.get(_audit(tenant.slug)).content.decode()
    assert "by-staff" in page and "198.51.100.99" not in page
