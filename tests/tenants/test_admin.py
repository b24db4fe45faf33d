import json
import re

import pytest
from django.contrib.auth.models import Permission
from django.contrib.sessions.models import Session
from django.urls import reverse
from django.utils import timezone

from tenants import api_keys, services
from tenants.models import ApiKey, Membership, UsageRecord
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db

CHANGELISTS = ["plan", "tenant", "membership", "apikey", "usagerecord"]


@pytest.fixture
def staff_client(client, admin_user):
    client.force_login(admin_user)
    return client


@pytest.mark.parametrize("model", CHANGELISTS)
def test_staff_can_open_every_tenants_page(staff_client, tenant, model):
    services.api_key_create(tenant=tenant, name="ci")
    assert staff_client.get(reverse(f"admin:tenants_{model}_changelist")).status_code == 200
    if model != "usagerecord":
        assert staff_client.get(reverse(f"admin:tenants_{model}_add")).status_code == 200


def test_anonymous_and_non_staff_users_are_refused(client, user):
    index = reverse("admin:index")
    response = client.get(index)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]

    client.force_login(user)
    for model in CHANGELISTS:
        response = client.get(reverse(f"admin:tenants_{model}_changelist"))
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert client.get(index).status_code == 302


def test_staff_login_through_the_form(client, django_user_model):
    django_user_model.objects.create_superuser("root", "", "s3cret-pass-phrase")
    response = client.post(
        reverse("admin:login"),
        {"username": "root", "password": "s3cret-pass-phrase", "next": "/admin/"},
    )
    assert response.status_code == 302
    assert client.get(reverse("admin:index")).status_code == 200


def test_adding_a_key_in_the_admin_shows_it_once(staff_client, tenant):
    created = staff_client.post(
        reverse("admin:tenants_apikey_add"), {"tenant": tenant.pk, "name": "from-admin"}
    )
    # on the answer to the form itself, which no cache keeps
    assert created.status_code == 200
    assert "no-store" in created["Cache-Control"]
    shown = re.findall(r"sk-[A-Za-z0-9]{48}", created.content.decode())
    assert len(shown) == 1
    api_key = ApiKey.objects.get(name="from-admin")
    assert api_key.key_hash == api_keys.hash_key(shown[0])
    # not through a message: the session, a database row, would hold the key until the next
    # page (for weeks, where the browser never asks for it), and backups with it
    for session in Session.objects.all():
        assert shown[0] not in json.dumps(session.get_decoded())
    assert not created.cookies.get("messages", None) or not created.cookies["messages"].value
    page = staff_client.get(reverse("admin:tenants_apikey_change", args=[api_key.pk]))
    assert shown[0] not in page.content.decode()


def test_revoke_action(staff_client, tenant):
    api_key, raw_key = services.api_key_create(tenant=tenant, name="ci")
    staff_client.post(
        reverse("admin:tenants_apikey_changelist"),
        {"action": "revoke_selected", "_selected_action": [api_key.pk]},
    )
    with pytest.raises(services.ApiKeyInvalid):
        services.api_key_authenticate(raw_key=raw_key)


def test_staff_who_may_only_view_keys_cannot_revoke_them(client, django_user_model, tenant):
    viewer = django_user_model.objects.create_user("auditor", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    api_key, _ = services.api_key_create(tenant=tenant, name="prod")
    client.force_login(viewer)
    changelist = reverse("admin:tenants_apikey_changelist")
    assert "revoke_selected" not in client.get(changelist).content.decode()

    client.post(changelist, {"action": "revoke_selected", "_selected_action": [api_key.pk]})
    api_key.refresh_from_db()
    assert api_key.revoked_at is None


def test_a_revoked_key_stays_revoked_when_its_page_is_saved(staff_client, tenant):
    """Revocation cannot be undone (as the console says): the change form shows when, and a
    save cannot clear it."""
    api_key, raw_key = services.api_key_create(tenant=tenant, name="prod")
    services.api_key_revoke(api_key=api_key)
    url = reverse("admin:tenants_apikey_change", args=[api_key.pk])
    assert 'name="revoked_at_0"' not in staff_client.get(url).content.decode()

    staff_client.post(
        url,
        {
            "name": "prod",
            "expires_at_0": "",
            "expires_at_1": "",
            "revoked_at_0": "",
            "revoked_at_1": "",
        },
    )
    api_key.refresh_from_db()
    assert api_key.revoked_at is not None
    with pytest.raises(services.ApiKeyInvalid):
        services.api_key_authenticate(raw_key=raw_key)


# --- the owner rule holds in the admin too ----------------------------------------------


@pytest.fixture
def owned(tenant, django_user_model):
    """Acme with its one owner, and that owner's membership."""
    owner = django_user_model.objects.create_user("owner", password="pw-owner-123")
    return services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)


def test_the_admin_cannot_demote_the_last_owner(staff_client, owned):
    response = staff_client.post(
        reverse("admin:tenants_membership_change", args=[owned.pk]), {"role": "member"}
    )
    assert response.status_code == 200  # the form again, with the error
    assert "at least one owner" in response.content.decode()
    assert Membership.objects.get(pk=owned.pk).role == "owner"


def test_the_admin_cannot_delete_the_last_owner(staff_client, owned):
    url = reverse("admin:tenants_membership_delete", args=[owned.pk])
    staff_client.post(url, {"post": "yes"})
    staff_client.post(
        reverse("admin:tenants_membership_changelist"),
        {"action": "delete_selected", "_selected_action": [owned.pk], "post": "yes"},
    )
    assert Membership.objects.filter(pk=owned.pk).exists()


def _inline_form(tenant, membership, **row) -> dict:
    data = {
        "name": tenant.name,
        "slug": tenant.slug,
        "plan": tenant.plan_id,
        "is_active": "on",
        "memberships-TOTAL_FORMS": "1",
        "memberships-INITIAL_FORMS": "1",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
        "memberships-0-id": membership.pk,
        "memberships-0-tenant": tenant.pk,
        "memberships-0-user": membership.user_id,
        "memberships-0-role": "owner",
    }
    data.update({f"memberships-0-{name}": value for name, value in row.items()})
    return data


@pytest.mark.parametrize("row", [{"role": "admin"}, {"DELETE": "on"}])
def test_the_tenant_page_cannot_drop_the_last_owner(staff_client, tenant, owned, row):
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    response = staff_client.post(url, _inline_form(tenant, owned, **row))
    assert response.status_code == 200
    assert "at least one owner" in response.content.decode()
    assert Membership.objects.get(pk=owned.pk).role == "owner"


def test_the_tenant_page_changes_roles_through_the_rule(staff_client, tenant, owned, user):
    services.membership_set(tenant=tenant, user=user, role="owner", actor=None)
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    response = staff_client.post(url, _inline_form(tenant, owned, role="member"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert Membership.objects.get(pk=owned.pk).role == "member"


def test_the_admin_cannot_deactivate_or_delete_a_tenants_last_owner(staff_client, owned):
    user = owned.user
    page = staff_client.get(reverse("admin:auth_user_change", args=[user.pk]))
    form = {
        "username": user.username,
        "date_joined_0": "2024-01-01",
        "date_joined_1": "00:00:00",
        "initial-date_joined_0": "2024-01-01",
        "initial-date_joined_1": "00:00:00",
    }  # is_active left out: unticked
    assert page.status_code == 200
    response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), form)
    assert response.status_code == 200
    assert "last owner" in response.content.decode()
    user.refresh_from_db()
    assert user.is_active

    staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})
    assert type(user).objects.filter(pk=user.pk).exists()


def test_the_admin_still_deletes_and_deactivates_others(staff_client, tenant, owned, user):
    member = services.membership_set(tenant=tenant, user=user, role="member", actor=None)
    staff_client.post(
        reverse("admin:tenants_membership_changelist"),
        {"action": "delete_selected", "_selected_action": [member.pk], "post": "yes"},
    )
    assert not Membership.objects.filter(pk=member.pk).exists()
    staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})
    assert not type(user).objects.filter(pk=user.pk).exists()


def _new_tenant_form(owner) -> dict:
    from tenants.models import Plan

    return {
        "name": "New Co",
        "slug": "newco",
        "plan": Plan.objects.get(slug="default").pk,
        "is_active": "on",
        "memberships-TOTAL_FORMS": "1",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
        "memberships-0-user": owner.pk,
        "memberships-0-role": "owner",
    }


def test_staff_who_may_add_members_add_a_tenant_with_its_owner(client, django_user_model):
    """The check of their rights ran as the tenant was saved, past the form's validation,
    and asked for the power to change memberships: a 500."""
    from tests.conftest import staff_user

    staff = staff_user(
        "creator",
        "tenants.add_tenant",
        "tenants.view_tenant",
        "tenants.add_membership",
        "tenants.view_membership",
    )
    owner = django_user_model.objects.create_user("bob", password="pw-bob-123")
    client.force_login(staff)

    response = client.post(reverse("admin:tenants_tenant_add"), _new_tenant_form(owner))

    assert response.status_code == 302, response.content.decode()[-2000:]
    membership = Membership.objects.get(tenant__slug="newco")
    assert (membership.user, membership.role) == (owner, "owner")


def test_staff_who_may_only_add_members_add_but_change_no_role(tenant, owned, user):
    from tests.conftest import staff_user

    staff = staff_user("adder", "tenants.add_membership")
    services.memberships_check(
        tenant=tenant, changes=[services.MembershipChange(user, "member")], actor=staff
    )
    for change in (
        services.MembershipChange(owned.user, "member"),
        services.MembershipChange(owned.user, None),
    ):
        with pytest.raises(services.MembershipNotAllowed):
            services.memberships_check(tenant=tenant, changes=[change], actor=staff)


@pytest.mark.parametrize("allowed", ["5", '"demo-chat"', "[1, 2]", '[""]'])
def test_the_plan_admin_takes_allowed_models_only_as_a_list_of_names(staff_client, tenant, allowed):
    """Any JSON reached the deployments' lookup: a number failed every request of the plan's
    tenants (a 500), a string was taken letter by letter (no model found)."""
    plan = tenant.plan
    response = staff_client.post(
        reverse("admin:tenants_plan_change", args=[plan.pk]),
        {
            "name": plan.name,
            "slug": plan.slug,
            "allowed_models": allowed,
            "service_tier": plan.service_tier,
            "share": "1.0",
            "batch_price_factor": "0.50",
        },
    )

    assert response.status_code == 200
    assert "list of served model names" in response.content.decode()
    plan.refresh_from_db()
    assert plan.allowed_models == []


def test_usage_records_cannot_be_deleted_in_the_admin(staff_client, tenant):
    """A deletion here (no audit event) left the dashboards' roll-ups counting the tokens the
    monthly budget, built again from the records, no longer did. Retention purges them."""
    api_key, _ = services.api_key_create(tenant=tenant, name="k")
    record = usage_record_add(
        request_id="r1",
        tenant=tenant,
        api_key=api_key,
        model="m",
        source=UsageRecord.Source.API,
        status=UsageRecord.Status.OK,
        started_at=timezone.now(),
        finished_at=timezone.now(),
        prompt_tokens=1000,
        completion_tokens=1000,
    )
    url = reverse("admin:tenants_usagerecord_changelist")
    staff_client.post(
        url, {"action": "delete_selected", "_selected_action": [record.pk], "post": "yes"}
    )
    delete = reverse("admin:tenants_usagerecord_delete", args=[record.pk])
    assert staff_client.post(delete, {"post": "yes"}).status_code == 403
    assert UsageRecord.objects.filter(pk=record.pk).exists()


def test_staff_who_may_change_users_cannot_give_powers(client):
    """Django's user admin lets any staff who may change users make anybody, themselves
    included, a superuser: the powers are a superuser's to give."""
    from tests.conftest import staff_user

    clerk = staff_user("clerk", "auth.change_user", "auth.view_user")
    client.force_login(clerk)
    url = reverse("admin:auth_user_change", args=[clerk.pk])
    page = client.get(url)
    form = page.context["adminform"].form
    assert not {"is_superuser", "is_staff", "user_permissions", "groups"} & set(form.fields)

    data = {
        "username": "clerk",
        "is_active": "on",
        "is_superuser": "on",
        "is_staff": "on",
        "date_joined_0": clerk.date_joined.strftime("%Y-%m-%d"),
        "date_joined_1": clerk.date_joined.strftime("%H:%M:%S"),
    }
    assert client.post(url, data).status_code == 302
    clerk.refresh_from_db()
    assert clerk.is_staff and not clerk.is_superuser
