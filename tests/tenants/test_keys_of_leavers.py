"""Who leaves a tenant takes the API keys they made with them: a member removed (the console,
the admin), a user deactivated or deleted. A removed admin's key kept reading every file and
batch of the tenant, and spending its quota; the console promised the opposite."""

import pytest
from django.urls import reverse

from tenants import services
from tenants.models import ApiKey, AuditEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def people(django_user_model, tenant, other_tenant):
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    leaver = django_user_model.objects.create_user("leaver", password="pw-leaver-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    services.membership_set(tenant=tenant, user=leaver, role="admin", actor=None)
    services.membership_set(tenant=other_tenant, user=leaver, role="owner", actor=None)
    keys = {
        "leaver's": services.api_key_create(tenant=tenant, name="l", created_by=leaver),
        "leaver's elsewhere": services.api_key_create(
            tenant=other_tenant, name="e", created_by=leaver
        ),
        "owner's": services.api_key_create(tenant=tenant, name="o", created_by=owner),
    }
    return owner, leaver, keys


def _works(keys, name: str) -> bool:
    try:
        services.api_key_authenticate(raw_key=keys[name][1])
    except services.ApiKeyInvalid:
        return False
    return True


def test_a_member_removed_in_the_console_loses_the_keys_they_made_there(client, people, tenant):
    owner, leaver, keys = people
    client.force_login(owner)
    membership = leaver.memberships.get(tenant=tenant)

    client.post(
        reverse("console:members", args=[tenant.slug]),
        {"action": "remove", "membership_id": membership.pk},
    )

    assert not _works(keys, "leaver's")
    assert _works(keys, "leaver's elsewhere") and _works(keys, "owner's")
    [event] = AuditEvent.objects.filter(action=AuditEvent.Action.API_KEY_REVOKED)
    assert (event.tenant, event.actor) == (tenant, owner)


def test_a_user_deactivated_in_the_admin_loses_every_key_they_made(
    client, people, admin_user, other_tenant
):
    owner, leaver, keys = people
    services.membership_set(tenant=other_tenant, user=owner, role="owner", actor=None)
    client.force_login(admin_user)
    url = reverse("admin:auth_user_change", args=[leaver.pk])
    form = client.get(url).context["adminform"].form
    skipped = ("is_active", "date_joined", "last_login", "password")  # unchecked: inactive
    data = {k: v for k, v in form.initial.items() if v is not None and k not in skipped}
    data.update(
        date_joined_0=leaver.date_joined.strftime("%Y-%m-%d"),
        date_joined_1=leaver.date_joined.strftime("%H:%M:%S"),
        groups=[],
        user_permissions=[],
    )

    response = client.post(url, data)

    assert response.status_code == 302, response.content[:2000]
    leaver.refresh_from_db()
    assert not leaver.is_active
    assert not _works(keys, "leaver's") and not _works(keys, "leaver's elsewhere")
    assert _works(keys, "owner's")


def test_a_user_deactivated_by_the_service_loses_every_key_they_made(people, other_tenant):
    owner, leaver, keys = people
    services.membership_set(tenant=other_tenant, user=owner, role="owner", actor=None)

    services.user_deactivate(user=leaver)

    assert not _works(keys, "leaver's") and not _works(keys, "leaver's elsewhere")
    assert _works(keys, "owner's")


def test_a_user_deleted_in_the_admin_leaves_no_key_working(
    client, people, admin_user, other_tenant
):
    owner, leaver, keys = people
    services.membership_set(tenant=other_tenant, user=owner, role="owner", actor=None)
    client.force_login(admin_user)

    client.post(reverse("admin:auth_user_delete", args=[leaver.pk]), {"post": "yes"})

    assert not type(leaver).objects.filter(pk=leaver.pk).exists()
    assert not _works(keys, "leaver's") and not _works(keys, "leaver's elsewhere")
    assert ApiKey.objects.filter(created_by=None, revoked_at__isnull=False).count() == 2
