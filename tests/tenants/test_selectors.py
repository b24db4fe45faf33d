from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import selectors, services
from tenants.models import Plan, UsageRecord
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db


def test_tenant_limits_apply_overrides_over_the_plan():
    plan = Plan.objects.create(
        slug="pro",
        name="Pro",
        requests_per_minute=100,
        tokens_per_minute=10_000,
        max_concurrent_requests=4,
        monthly_token_budget=None,
    )
    tenant = services.tenant_create(
        slug="acme", plan=plan, tokens_per_minute=50_000, monthly_token_budget=1_000_000
    )

    assert selectors.tenant_limits(tenant=tenant) == selectors.Limits(
        requests_per_minute=100,
        tokens_per_minute=50_000,
        max_concurrent_requests=4,
        monthly_token_budget=1_000_000,
    )


def test_zero_override_is_a_limit_not_a_fallback():
    tenant = services.tenant_create(slug="acme", requests_per_minute=0)
    assert selectors.tenant_limits(tenant=tenant).requests_per_minute == 0


def test_api_key_limits_are_its_own(tenant):
    api_key, _ = services.api_key_create(tenant=tenant, name="ci", requests_per_minute=5)
    assert selectors.api_key_limits(api_key=api_key) == selectors.Limits(requests_per_minute=5)


def test_user_tenants_lists_only_active_memberships(user, tenant, other_tenant):
    services.membership_set(tenant=tenant, user=user, role="member", actor=None)
    services.membership_set(tenant=other_tenant, user=user, role="admin", actor=None)
    other_tenant.is_active = False
    other_tenant.save()
    services.tenant_create(slug="unrelated")

    assert list(selectors.user_tenants(user=user)) == [tenant]
    assert selectors.user_role(user=user, tenant=other_tenant) == "admin"
    assert selectors.user_role(user=user, tenant=selectors.tenant_get(slug="unrelated")) is None


def test_api_keys_and_usage_are_filtered_by_tenant_and_time(tenant, other_tenant):
    mine, _ = services.api_key_create(tenant=tenant, name="mine")
    theirs, _ = services.api_key_create(tenant=other_tenant, name="theirs")
    now = timezone.now()
    for index, (owner, key, age) in enumerate(
        [(tenant, mine, 1), (tenant, mine, 30), (other_tenant, theirs, 1)]
    ):
        usage_record_add(
            request_id=f"req-{index}",
            tenant=owner,
            api_key=key,
            model="demo-chat",
            source=UsageRecord.Source.API,
            status=UsageRecord.Status.OK,
            started_at=now - timedelta(days=age),
            finished_at=now - timedelta(days=age),
        )

    assert list(selectors.tenant_api_keys(tenant=tenant)) == [mine]
    all_mine = selectors.tenant_usage_records(tenant=tenant)
    assert {record.request_id for record in all_mine} == {"req-0", "req-1"}
    recent = selectors.tenant_usage_records(tenant=tenant, start=now - timedelta(days=7), end=now)
    assert [record.request_id for record in recent] == ["req-0"]


def test_tenant_memberships_are_its_own_by_username(tenant, other_tenant, django_user_model):
    zed, amy = (django_user_model.objects.create_user(name) for name in ("zed", "amy"))
    for user in (zed, amy):
        services.membership_set(tenant=tenant, user=user, role="member", actor=None)
    services.membership_set(tenant=other_tenant, user=amy, role="admin", actor=None)

    memberships = list(selectors.tenant_memberships(tenant=tenant))

    assert [m.user.username for m in memberships] == ["amy", "zed"]
    assert {m.tenant_id for m in memberships} == {tenant.pk}
