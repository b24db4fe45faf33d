from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from tenants import services
from tenants.models import ApiKey, Membership, Plan, UsageRecord
from tests.conftest import staff_user
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db


def test_tenant_is_created_on_the_default_plan_with_an_owner(user):
    tenant = services.tenant_create(slug="acme", name="Acme Inc", owner=user)

    assert tenant.plan.slug == "default"
    assert tenant.is_active
    membership = Membership.objects.get(tenant=tenant, user=user)
    assert membership.role == Membership.Role.OWNER


def test_tenant_name_defaults_to_slug():
    assert services.tenant_create(slug="initech").name == "initech"


@pytest.mark.parametrize("slug", ["", "has space", "émoji-☃", "x" * 65])
def test_invalid_slug_is_refused(slug):
    with pytest.raises(ValidationError):
        services.tenant_create(slug=slug)


def test_duplicate_slug_is_refused(tenant):
    with pytest.raises(ValidationError):
        services.tenant_create(slug=tenant.slug)


def test_unknown_limit_is_refused():
    with pytest.raises(ValidationError, match="Unknown limits"):
        services.tenant_create(slug="acme", requests_per_hour=3)


def test_user_may_belong_to_several_tenants_with_different_roles(user, tenant, other_tenant):
    services.membership_set(tenant=tenant, user=user, role="admin", actor=None)
    services.membership_set(tenant=other_tenant, user=user, role="member", actor=None)
    services.membership_set(tenant=other_tenant, user=user, role="owner", actor=None)

    roles = dict(Membership.objects.filter(user=user).values_list("tenant__slug", "role"))
    assert roles == {"acme": "admin", "globex": "owner"}


def test_unknown_role_is_refused(user, tenant):
    with pytest.raises(ValidationError):
        services.membership_set(tenant=tenant, user=user, role="emperor", actor=None)


def test_custom_plan_is_used():
    plan = Plan.objects.create(slug="pro", name="Pro", requests_per_minute=600)
    assert services.tenant_create(slug="acme", plan=plan).plan == plan


def _usage(tenant, api_key, **fields):
    now = timezone.now()
    values = {
        "request_id": "req-1",
        "tenant": tenant,
        "api_key": api_key,
        "model": "demo-chat",
        "source": UsageRecord.Source.API,
        "status": UsageRecord.Status.OK,
        "started_at": now - timedelta(seconds=2),
        "finished_at": now,
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "cached_tokens": 8,
        "time_to_first_token_ms": 41.5,
        "latency_ms": 2000.0,
    }
    values.update(fields)
    return usage_record_add(**values)


def test_usage_is_recorded_exactly_once_per_request(tenant):
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")

    first = _usage(tenant, api_key)
    again = _usage(tenant, api_key, completion_tokens=999)

    assert again.pk == first.pk
    assert UsageRecord.objects.count() == 1
    assert UsageRecord.objects.get().completion_tokens == 30
    assert first.total_tokens == 42


def test_usage_needs_a_key_or_a_user(tenant):
    with pytest.raises(ValidationError):
        _usage(tenant, None)


def test_usage_for_a_chat_user_without_key(tenant, user):
    record = _usage(tenant, None, user=user, source=UsageRecord.Source.CHAT)
    assert record.user == user and record.api_key is None


def test_usage_cannot_charge_another_tenants_key(tenant, other_tenant):
    api_key, _ = services.api_key_create(tenant=other_tenant, name="theirs")
    with pytest.raises(ValidationError):
        _usage(tenant, api_key)


def test_usage_with_invalid_status_is_refused(tenant):
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    with pytest.raises(ValidationError):
        _usage(tenant, api_key, status="great")


# --- memberships: who may touch an owner, and a tenant never loses its last owner ----------


def _role(tenant, user) -> str | None:
    membership = Membership.objects.filter(tenant=tenant, user=user).first()
    return membership.role if membership else None


def test_an_admin_cannot_demote_an_owner_by_setting_their_role(crew, tenant):
    with pytest.raises(services.OwnerRequiredError):
        services.membership_set(
            tenant=tenant, user=crew["owner"], role="member", actor=crew["admin"]
        )
    assert _role(tenant, crew["owner"]) == "owner"


def test_an_admin_cannot_change_or_remove_an_owner_even_when_others_remain(
    crew, tenant, django_user_model
):
    second = django_user_model.objects.create_user("second-owner")
    services.membership_set(tenant=tenant, user=second, role="owner", actor=crew["owner"])
    owner = Membership.objects.get(tenant=tenant, user=crew["owner"])
    with pytest.raises(services.OwnerRequiredError):
        services.membership_change_role(membership=owner, role="admin", actor=crew["admin"])
    with pytest.raises(services.OwnerRequiredError):
        services.membership_remove(membership=owner, actor=crew["admin"])
    assert _role(tenant, crew["owner"]) == "owner"


def test_only_owners_and_staff_grant_owner(crew, tenant, django_user_model):
    newcomer = django_user_model.objects.create_user("newcomer")
    with pytest.raises(services.OwnerRequiredError):
        services.membership_set(tenant=tenant, user=newcomer, role="owner", actor=crew["admin"])
    member = Membership.objects.get(tenant=tenant, user=crew["member"])
    with pytest.raises(services.OwnerRequiredError):
        services.membership_change_role(membership=member, role="owner", actor=crew["admin"])
    assert _role(tenant, newcomer) is None and _role(tenant, crew["member"]) == "member"

    viewer = staff_user("viewer", "tenants.view_membership")  # the admin would not let them
    with pytest.raises(services.MembershipNotAllowed):
        services.membership_set(tenant=tenant, user=newcomer, role="owner", actor=viewer)
    staff = staff_user("staffer", "tenants.change_membership")
    services.membership_set(tenant=tenant, user=newcomer, role="owner", actor=staff)
    services.membership_change_role(membership=member, role="owner", actor=crew["owner"])
    assert _role(tenant, newcomer) == _role(tenant, crew["member"]) == "owner"


def test_an_admin_still_manages_admins_and_members(crew, tenant, django_user_model):
    newcomer = django_user_model.objects.create_user("newcomer")
    services.membership_set(tenant=tenant, user=newcomer, role="admin", actor=crew["admin"])
    member = Membership.objects.get(tenant=tenant, user=crew["member"])
    services.membership_change_role(membership=member, role="admin", actor=crew["admin"])
    services.membership_remove(membership=member, actor=crew["admin"])
    assert _role(tenant, newcomer) == "admin" and _role(tenant, crew["member"]) is None


@pytest.mark.parametrize("who", ["member", "outsider"])
def test_members_and_outsiders_manage_nobody(crew, tenant, django_user_model, who):
    actor = crew.get(who) or django_user_model.objects.create_user(who)
    newcomer = django_user_model.objects.create_user("newcomer")
    with pytest.raises(services.MembershipNotAllowed):
        services.membership_set(tenant=tenant, user=newcomer, role="member", actor=actor)
    admin = Membership.objects.get(tenant=tenant, user=crew["admin"])
    with pytest.raises(services.MembershipNotAllowed):
        services.membership_remove(membership=admin, actor=actor)
    assert _role(tenant, newcomer) is None and _role(tenant, crew["admin"]) == "admin"


@pytest.mark.parametrize("actor", ["owner", "staff", None])
def test_no_change_leaves_a_tenant_without_an_owner(crew, tenant, django_user_model, actor):
    if actor == "staff":
        actor = staff_user("staffer", "tenants.change_membership")
    elif actor == "owner":
        actor = crew["owner"]
    owner = Membership.objects.get(tenant=tenant, user=crew["owner"])
    with pytest.raises(services.LastOwnerError):
        services.membership_set(tenant=tenant, user=crew["owner"], role="admin", actor=actor)
    with pytest.raises(services.LastOwnerError):
        services.membership_change_role(membership=owner, role="member", actor=actor)
    with pytest.raises(services.LastOwnerError):
        services.membership_remove(membership=owner, actor=actor)
    with pytest.raises(services.LastOwnerError):
        services.user_deactivate(user=crew["owner"])
    crew["owner"].refresh_from_db()
    assert _role(tenant, crew["owner"]) == "owner" and crew["owner"].is_active


def test_an_inactive_owner_does_not_count(crew, tenant, django_user_model):
    gone = django_user_model.objects.create_user("gone", is_active=False)
    services.membership_set(tenant=tenant, user=gone, role="owner", actor=crew["owner"])
    owner = Membership.objects.get(tenant=tenant, user=crew["owner"])
    with pytest.raises(services.LastOwnerError):
        services.membership_change_role(membership=owner, role="admin", actor=crew["owner"])


def test_owners_can_hand_over_and_deactivate_once_another_owner_exists(crew, tenant):
    admin = Membership.objects.get(tenant=tenant, user=crew["admin"])
    services.membership_change_role(membership=admin, role="owner", actor=crew["owner"])
    owner = Membership.objects.get(tenant=tenant, user=crew["owner"])
    services.membership_change_role(membership=owner, role="member", actor=crew["owner"])
    assert _role(tenant, crew["owner"]) == "member" and _role(tenant, crew["admin"]) == "owner"
    services.user_deactivate(user=crew["member"])
    crew["member"].refresh_from_db()
    assert not crew["member"].is_active


def test_a_tenant_created_without_an_owner_can_still_get_members(tenant, user):
    services.membership_set(tenant=tenant, user=user, role="member", actor=None)
    assert _role(tenant, user) == "member"


# --- what the console asks for: keys and memberships by id within the tenant, users by name --


def test_an_issued_key_without_a_name_is_called_unnamed_and_expires_as_asked(tenant, user):
    api_key, raw_key = services.api_key_issue(
        tenant=tenant, name="  ", created_by=user, expires_in_days=30
    )
    assert api_key.name == services.UNNAMED_KEY_NAME and api_key.created_by == user
    lifetime = api_key.expires_at - timezone.now()
    assert timedelta(days=29, hours=23) < lifetime <= timedelta(days=30)
    assert services.api_key_authenticate(raw_key=raw_key) == api_key

    named, _ = services.api_key_issue(
        tenant=tenant, name="ci", created_by=None, expires_in_days=None
    )
    assert named.name == "ci" and named.expires_at is None


@pytest.mark.parametrize("days", [0, -1, services.MAX_KEY_LIFETIME_DAYS + 1])
def test_no_key_is_issued_for_a_lifetime_out_of_bounds(tenant, days):
    with pytest.raises(ValidationError):
        services.api_key_issue(tenant=tenant, name="ci", created_by=None, expires_in_days=days)
    assert not ApiKey.objects.exists()


def test_a_key_is_revoked_by_id_only_within_its_tenant(tenant, other_tenant):
    mine, my_raw_key = services.api_key_create(tenant=tenant, name="mine")
    theirs, their_raw_key = services.api_key_create(tenant=other_tenant, name="theirs")

    for api_key_id in (theirs.pk, None):
        with pytest.raises(ApiKey.DoesNotExist):
            services.api_key_revoke_by_id(tenant=tenant, api_key_id=api_key_id)
    assert services.api_key_authenticate(raw_key=their_raw_key) == theirs

    assert services.api_key_revoke_by_id(tenant=tenant, api_key_id=mine.pk).is_revoked
    with pytest.raises(services.ApiKeyInvalid):
        services.api_key_authenticate(raw_key=my_raw_key)


def test_setting_a_role_keeps_the_membership_rules(crew, tenant):
    with pytest.raises(services.OwnerRequiredError):
        services.membership_set(
            tenant=tenant, user=crew["owner"], role="member", actor=crew["admin"]
        )
    with pytest.raises(services.MembershipNotAllowed):
        services.membership_set(
            tenant=tenant, user=crew["admin"], role="member", actor=crew["member"]
        )
    with pytest.raises(services.LastOwnerError):
        services.membership_set(
            tenant=tenant, user=crew["owner"], role="admin", actor=crew["owner"]
        )
    assert _role(tenant, crew["owner"]) == "owner" and _role(tenant, crew["admin"]) == "admin"


def test_members_are_changed_by_id_only_within_their_tenant(crew, tenant, other_tenant):
    services.membership_set(tenant=other_tenant, user=crew["member"], role="member", actor=None)
    theirs = Membership.objects.get(tenant=other_tenant, user=crew["member"])
    with pytest.raises(Membership.DoesNotExist):
        services.membership_change_role_by_id(
            tenant=tenant, membership_id=theirs.pk, role="admin", actor=crew["owner"]
        )
    with pytest.raises(Membership.DoesNotExist):
        services.membership_remove_by_id(
            tenant=tenant, membership_id=theirs.pk, actor=crew["owner"]
        )
    assert _role(other_tenant, crew["member"]) == "member"

    mine = Membership.objects.get(tenant=tenant, user=crew["member"])
    services.membership_change_role_by_id(
        tenant=tenant, membership_id=mine.pk, role="admin", actor=crew["owner"]
    )
    assert _role(tenant, crew["member"]) == "admin"
    services.membership_remove_by_id(tenant=tenant, membership_id=mine.pk, actor=crew["owner"])
    assert _role(tenant, crew["member"]) is None


def test_changing_members_by_id_keeps_the_membership_rules(crew, tenant):
    owner = Membership.objects.get(tenant=tenant, user=crew["owner"])
    with pytest.raises(services.OwnerRequiredError):
        services.membership_remove_by_id(tenant=tenant, membership_id=owner.pk, actor=crew["admin"])
    with pytest.raises(services.OwnerRequiredError):
        services.membership_change_role_by_id(
            tenant=tenant, membership_id=owner.pk, role="member", actor=crew["admin"]
        )
    with pytest.raises(services.LastOwnerError):
        services.membership_change_role_by_id(
            tenant=tenant, membership_id=owner.pk, role="admin", actor=crew["owner"]
        )
    assert _role(tenant, crew["owner"]) == "owner"
