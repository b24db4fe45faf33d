"""Cached authorizations: a hit reads nothing, any change to what an entry was read from is
seen, and nothing is trusted longer than GATEWAY_AUTH_CACHE_SECONDS."""

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache
from django.utils import timezone

from gateway import authorization
from gateway.errors import ApiError
from serving.models import ModelDeployment
from serving.services import deployment_register
from tenants import services
from tenants.models import ApiKey, Plan

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def key(async_db, settings):
    settings.GATEWAY_AUTH_CACHE_SECONDS = 60
    cache.clear()
    authorization.forget()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan)
    deployment_register(name="m", endpoints=["ipc:///tmp/m.sock"])
    api_key, raw_key = services.api_key_create(tenant=tenant, name="k")
    return api_key, raw_key


async def test_a_second_request_reads_nothing(key):
    _, raw_key = key
    first = await authorization.authorize(raw_key, "m")
    assert first.deployment.name == "m" and first.api_key.tenant.slug == "acme"
    assert await authorization.authorize(raw_key, "m") is first
    first.ensure_current()  # nothing changed


async def test_revoking_a_key_here_is_seen_at_once(key):
    api_key, raw_key = key
    await authorization.authorize(raw_key, "m")
    await _sync(services.api_key_revoke, api_key=api_key)
    with pytest.raises(ApiError) as refused:
        await authorization.authorize(raw_key, "m")
    assert refused.value.status == 401


async def test_a_change_made_by_another_process_makes_the_entry_stale(key):
    api_key, raw_key = key
    entry = await authorization.authorize(raw_key, "m")
    # another process: the row changes and the shared generation moves; nothing local ran
    await _sync(lambda: ApiKey.objects.filter(pk=api_key.pk).update(revoked_at=timezone.now()))
    await _sync(cache.set, authorization.GENERATION_KEY, "elsewhere")
    with pytest.raises(authorization.StaleAuthorization):
        await _sync(entry.ensure_current)
    with pytest.raises(ApiError):  # the entry is gone: the next read finds the revocation
        await authorization.authorize(raw_key, "m")


async def test_health_writes_do_not_invalidate(key):
    _, raw_key = key
    entry = await authorization.authorize(raw_key, "m")
    deployment = await ModelDeployment.objects.aget(name="m")
    deployment.health = "ready"
    await _sync(deployment.save, update_fields=["health", "checked_at"])
    assert await authorization.authorize(raw_key, "m") is entry
    await _sync(entry.ensure_current)


async def test_entries_expire(key, settings):
    _, raw_key = key
    entry = await authorization.authorize(raw_key, "m")
    settings.GATEWAY_AUTH_CACHE_SECONDS = 0
    assert await authorization.authorize(raw_key, "m") is not entry


async def test_a_key_that_expires_while_cached_is_refused(key, monkeypatch):
    api_key, raw_key = key
    api_key.expires_at = timezone.now() + timedelta(hours=1)
    await _sync(api_key.save)
    await authorization.authorize(raw_key, "m")
    later = timezone.now() + timedelta(hours=2)
    monkeypatch.setattr(timezone, "now", lambda: later)
    with pytest.raises(ApiError) as refused:
        await authorization.authorize(raw_key, "m")
    assert refused.value.code == "invalid_api_key"


async def test_keys_are_not_held_in_the_clear(key):
    _, raw_key = key
    await authorization.authorize(raw_key, "m")
    assert all(raw_key not in entry_key for entry_key, _ in authorization._entries)


async def test_requests_that_miss_together_share_one_lookup(key, monkeypatch):
    _, raw_key = key
    fetch, calls = authorization._fetch, []

    async def counted(*args):
        calls.append(args)
        return await fetch(*args)

    monkeypatch.setattr(authorization, "_fetch", counted)
    entries = await asyncio.gather(*(authorization.authorize(raw_key, "m") for _ in range(20)))
    assert len(calls) == 1 and all(entry is entries[0] for entry in entries)
    assert await authorization.authorize(raw_key, "m") is entries[0]  # and it is kept

    authorization.forget()
    refusals = await asyncio.gather(
        *(authorization.authorize("sk-wrong", "m") for _ in range(5)), return_exceptions=True
    )
    assert len(calls) == 2 and all(isinstance(r, ApiError) for r in refusals)
    assert all(r.status == 401 for r in refusals)
    await authorization.authorize(raw_key, "m")
    assert len(calls) == 3  # the refusal was not kept, the first entry was forgotten


async def test_a_waiter_that_goes_away_leaves_the_lookup_to_the_others(key, monkeypatch):
    _, raw_key = key
    fetch, gate = authorization._fetch, asyncio.Event()

    async def slow(*args):
        await gate.wait()
        return await fetch(*args)

    monkeypatch.setattr(authorization, "_fetch", slow)
    leaving = asyncio.create_task(authorization.authorize(raw_key, "m"))
    staying = asyncio.create_task(authorization.authorize(raw_key, "m"))
    await asyncio.sleep(0)
    leaving.cancel()
    gate.set()
    entry = await staying
    assert entry.deployment.name == "m" and leaving.cancelled()


async def _sync(function, *args, **kwargs):
    return await sync_to_async(function)(*args, **kwargs)
