"""The conversation claim (``chat.claims``) on the configured cache (Redis in CI): one holder
at a time, a token that frees only its own claim, and renewal that outlives the lease."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache

from chat import claims, services

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def conversation(django_user_model):
    from tenants import services as tenant_services
    from tenants.models import Plan

    alice = django_user_model.objects.create_user("alice", password="x-password-1")
    acme = tenant_services.tenant_create(
        slug="acme", plan=Plan.objects.create(slug="open", name="Open"), owner=alice
    )
    conversation = services.conversation_create(user=alice, tenant=acme)
    yield conversation
    cache.delete(claims.claim_key(conversation))


async def test_one_holder_at_a_time_and_only_the_holder_frees_it(conversation):
    token = await claims.aclaim(conversation)
    assert token and await claims.aclaim(conversation) is None
    await claims.arelease(conversation, "someone-else")
    assert await sync_to_async(claims.is_claimed)(conversation)
    await claims.arelease(conversation, token)
    assert not await sync_to_async(claims.is_claimed)(conversation)
    assert await claims.aclaim(conversation) is not None


async def test_a_kept_claim_outlives_its_lease_and_is_taken_back_when_lost(
    conversation, monkeypatch
):
    monkeypatch.setattr(claims, "LEASE_SECONDS", 1)
    monkeypatch.setattr(claims, "RENEW_SECONDS", 0.2)
    token = await claims.aclaim(conversation)
    keeper = asyncio.create_task(claims.akeep(conversation, token))
    try:
        await asyncio.sleep(2.5)
        assert await cache.aget(claims.claim_key(conversation)) == token
        await cache.adelete(claims.claim_key(conversation))  # e.g. evicted from the cache
        await asyncio.sleep(0.5)
        assert await cache.aget(claims.claim_key(conversation)) == token
    finally:
        keeper.cancel()
    await asyncio.sleep(1.5)
    assert await claims.aclaim(conversation) is not None  # no longer renewed: it ran out
