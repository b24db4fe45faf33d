"""What the gateway tells the engine's scheduler: the plan's tier as the priority floor (a
caller may lower its priority with vLLM's ``priority`` field, never raise it) and the plan's
share as the tenant's weight, on every fanned-out engine request (the run fills them in:
tests/serving/test_runs.py)."""

import json

import pytest
from django.core.cache import cache

from gateway import authorization
from gateway.errors import ApiError
from gateway.validation import plan_completion
from serving.services import deployment_register
from tenants import services
from tenants.models import Plan

pytestmark = pytest.mark.django_db(transaction=True)


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": ["a", "b"], "n": 2, **fields}).encode()


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 10**30])
def test_a_priority_out_of_range_is_a_400(priority):
    with pytest.raises(ApiError) as raised:
        plan_completion(body(priority=priority))
    assert raised.value.status == 400 and raised.value.param == "priority"


@pytest.fixture
def batch_key(async_db, settings):
    settings.GATEWAY_AUTH_CACHE_SECONDS = 60
    cache.clear()
    authorization.forget()
    plan = Plan.objects.create(
        slug="nightly", name="Nightly", service_tier=Plan.ServiceTier.BATCH, share=3.0
    )
    tenant = services.tenant_create(slug="batchco", plan=plan)
    deployment_register(name="m", endpoints=["ipc:///tmp/m.sock"])
    return services.api_key_create(tenant=tenant, name="k")[1]


async def test_the_plan_tier_and_share_reach_the_authorization(batch_key):
    auth = await authorization.authorize(batch_key, "m")
    assert (auth.priority, auth.tenant_weight) == (2, 3.0)
