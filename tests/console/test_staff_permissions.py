"""Staff hold in the console the powers the admin's permissions give them: any staff user could
revoke every tenant's keys, change their members and unload models from the console, whatever
the admin allowed them."""

import pytest
from django.urls import reverse

from serving import services as serving_services
from serving.models import ModelDeployment
from tenants import services
from tenants.models import ApiKey, Invitation, Membership
from tests.conftest import staff_user

pytestmark = pytest.mark.django_db

VIEW = "tenants.view_tenant"


@pytest.fixture
def world(tenant, django_user_model):
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    api_key, _ = services.api_key_create(tenant=tenant, name="prod")
    deployment = serving_services.deployment_register(name="m", endpoints=["ipc:///tmp/m.sock"])
    return owner, api_key, deployment


def _url(name: str, tenant=None) -> str:
    return reverse(f"console:{name}", args=[tenant.slug] if tenant else [])


def test_staff_without_the_view_permission_see_no_tenant(client, tenant, world):
    client.force_login(staff_user("nobody"))
    assert client.get(_url("home")).status_code == 403
    assert client.get(_url("platform")).status_code == 403
    for page in ("dashboard", "keys", "members", "batches", "audit"):
        assert client.get(_url(page, tenant)).status_code == 404


def test_staff_who_may_view_change_nothing(client, tenant, world):
    owner, api_key, deployment = world
    client.force_login(staff_user("viewer", VIEW))

    for page in ("dashboard", "keys", "members", "batches"):
        assert client.get(_url(page, tenant)).status_code == 200
    keys_page = client.get(_url("keys", tenant)).content.decode()
    assert "Create a key" not in keys_page and "Revoke" not in keys_page
    members_page = client.get(_url("members", tenant)).content.decode()
    assert "Invite someone" not in members_page and "Remove" not in members_page
    platform_page = client.get(_url("platform")).content.decode()
    assert "Register a deployment" not in platform_page and "Disable" not in platform_page

    keys = _url("keys", tenant)
    assert client.post(keys, {"action": "create", "name": "x"}).status_code == 403
    assert client.post(keys, {"action": "revoke", "key_id": api_key.pk}).status_code == 403
    membership = Membership.objects.get(tenant=tenant, user=owner)
    members = _url("members", tenant)
    form = {"action": "remove", "membership_id": membership.pk}
    assert client.post(members, form).status_code == 403
    invite = {"action": "invite", "role": "member", "expires_in_days": 7, "form_token": "t"}
    assert client.post(members, invite).status_code == 403
    assert not Invitation.objects.exists()
    actions = _url("deployment-action")
    assert (
        client.post(actions, {"action": "disable", "deployment_id": deployment.pk}).status_code
        == 403
    )
    assert (
        client.post(
            actions, {"action": "register", "name": "n", "endpoints": "ipc:///x"}
        ).status_code
        == 403
    )
    assert client.get(_url("audit", tenant)).status_code == 403
    assert client.get(_url("platform-audit")).status_code == 403
    assert (
        client.get(reverse("console:batch-cancel", args=[tenant.slug, "batch_x"])).status_code
        == 403
    )
    assert (
        client.get(reverse("console:batch-file", args=[tenant.slug, "file-x"])).status_code == 403
    )

    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at is None
    assert Membership.objects.filter(pk=membership.pk).exists()
    assert ModelDeployment.objects.get(pk=deployment.pk).is_enabled
    assert not ModelDeployment.objects.filter(name="n").exists()


def test_each_change_takes_its_own_permission(client, tenant, world):
    _, api_key, deployment = world
    client.force_login(staff_user("keymaker", VIEW, "tenants.add_apikey"))
    keys = _url("keys", tenant)
    page = client.get(keys).content.decode()
    assert "Create a key" in page and "Revoke" not in page
    assert client.post(keys, {"action": "create", "name": "x"}).status_code == 200
    assert client.post(keys, {"action": "revoke", "key_id": api_key.pk}).status_code == 403
    assert ApiKey.objects.filter(tenant=tenant).count() == 2

    client.force_login(staff_user("operator", VIEW, "serving.change_modeldeployment"))
    actions = _url("deployment-action")
    assert (
        client.post(actions, {"action": "disable", "deployment_id": deployment.pk}).status_code
        == 302
    )
    assert not ModelDeployment.objects.get(pk=deployment.pk).is_enabled
    assert (
        client.post(
            actions, {"action": "register", "name": "n", "endpoints": "ipc:///x"}
        ).status_code
        == 403
    )

    # adding is not changing: a name that is taken would rewrite its deployment
    client.force_login(staff_user("registrar", VIEW, "serving.add_modeldeployment"))
    taken = {"action": "register", "name": "m", "endpoints": "tcp://evil.example:5555"}
    assert client.post(actions, taken).status_code == 403
    assert ModelDeployment.objects.get(pk=deployment.pk).endpoints == ["ipc:///tmp/m.sock"]
    fresh = {"action": "register", "name": "new-model", "endpoints": "ipc:///tmp/new.sock"}
    assert client.post(actions, fresh).status_code == 302
    assert ModelDeployment.objects.filter(name="new-model").exists()

    client.force_login(staff_user("auditor", VIEW, "tenants.view_auditevent"))
    assert client.get(_url("audit", tenant)).status_code == 200
    assert client.get(_url("platform-audit")).status_code == 200


def test_a_staff_user_who_owns_a_tenant_manages_it_by_their_role(client, tenant, world):
    staff = staff_user("staff-owner")
    services.membership_set(tenant=tenant, user=staff, role="owner", actor=None)
    client.force_login(staff)

    assert client.get(_url("home")).status_code == 302  # to their tenant, not the platform
    keys = _url("keys", tenant)
    assert client.post(keys, {"action": "create", "name": "mine"}).status_code == 200
    assert client.get(_url("audit", tenant)).status_code == 200
    assert client.get(_url("platform")).status_code == 403
