"""A world to run ``serving.runs.Run`` in without a real engine: a fake engine on an ipc
socket (``FakeEngine``: it answers STATS and shows what was sent), a deployment routed to it
and a tenant, in the real database and quota counters."""

from dataclasses import dataclass

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache

from serving.models import ModelDeployment
from serving.pool import get_pool
from serving.runs import Caller
from serving.services import deployment_register
from tenants import services
from tenants.models import ApiKey, Plan, Tenant, UsageRecord
from tests.inference_engine.test_client import FakeEngine


@dataclass
class RunWorld:
    fake: FakeEngine
    tenant: Tenant
    api_key: ApiKey
    deployment: ModelDeployment

    def caller(self, **fields) -> Caller:
        return Caller(
            tenant=self.tenant,
            deployment=self.deployment,
            source=UsageRecord.Source.API,
            api_key=self.api_key,
            **fields,
        )

    async def records(self) -> list[UsageRecord]:
        return await sync_to_async(list)(UsageRecord.objects.filter(tenant=self.tenant))


def _world(fake: FakeEngine, endpoint: str, limits: dict) -> RunWorld:
    plan = Plan.objects.create(slug="unlimited", name="Unlimited")
    tenant = services.tenant_create(slug="acme", plan=plan, **limits)
    api_key = services.api_key_create(tenant=tenant, name="k")[0]
    return RunWorld(fake, tenant, api_key, deployment_register(name="m", endpoints=[endpoint]))


@pytest.fixture
async def run_world(async_db, tmp_path, request):
    """The world; a test marked ``@pytest.mark.tenant_limits(**limits)`` gets those limits."""
    marker = request.node.get_closest_marker("tenant_limits")
    cache.clear()
    endpoint = f"ipc://{tmp_path}/fake.sock"
    fake = FakeEngine(endpoint)
    yield await sync_to_async(_world)(fake, endpoint, marker.kwargs if marker else {})
    get_pool().close()
    fake.close()
    cache.clear()
