from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from tenants import services
from tenants.models import Membership, Plan, UsageRecord

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
    services.membership_set(tenant=tenant, user=user, role="admin")
    services.membership_set(tenant=other_tenant, user=user, role="member")
    services.membership_set(tenant=other_tenant, user=user, role="owner")

    roles = dict(Membership.objects.filter(user=user).values_list("tenant__slug", "role"))
    assert roles == {"acme": "admin", "globex": "owner"}


def test_unknown_role_is_refused(user, tenant):
    with pytest.raises(ValidationError):
        services.membership_set(tenant=tenant, user=user, role="emperor")


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
    return services.usage_record_create(**values)


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
