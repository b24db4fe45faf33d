"""Who is generating a conversation's reply: a lease in the shared cache, so that only one
reply per conversation runs at a time across sockets and processes.

The holder renews the lease while its reply runs; a process that dies stops renewing, and the
conversation is free again within ``LEASE_SECONDS`` (not after a fixed long timeout). Each
claim has its own token, so a holder whose lease ran out cannot free a later holder's claim.
"""

import asyncio
import logging
import uuid

from django.core.cache import cache

from chat.models import Conversation

logger = logging.getLogger(__name__)

LEASE_SECONDS = 30
RENEW_SECONDS = 10


def claim_key(conversation: Conversation) -> str:
    return f"chat:generating:{conversation.tenant_id}:{conversation.pk}"


def is_claimed(conversation: Conversation) -> bool:
    return cache.get(claim_key(conversation)) is not None


async def aclaim(conversation: Conversation) -> str | None:
    """The new claim's token, or None when someone holds the conversation."""
    token = uuid.uuid4().hex
    if await cache.aadd(claim_key(conversation), token, LEASE_SECONDS):
        return token
    return None


async def arelease(conversation: Conversation, token: str) -> None:
    """Free the claim if ``token`` still holds it. Never raises: with the cache unreachable
    the lease simply runs out."""
    key = claim_key(conversation)
    try:
        if await cache.aget(key) == token:
            await cache.adelete(key)
    except Exception:  # noqa: BLE001 - a reply must end cleanly whatever the cache does
        logger.warning("conversation %s: could not release its claim", conversation.pk)


async def akeep(conversation: Conversation, token: str) -> None:
    """Renew the claim every ``RENEW_SECONDS`` until cancelled. A claim found gone (the cache
    lost it, or this process stalled past the lease) is taken again when it is free."""
    key = claim_key(conversation)
    while True:
        await asyncio.sleep(RENEW_SECONDS)
        try:
            if await cache.aget(key) == token:
                await cache.atouch(key, LEASE_SECONDS)
            elif not await cache.aadd(key, token, LEASE_SECONDS):
                logger.warning("conversation %s: another process claimed it", conversation.pk)
        except Exception:  # noqa: BLE001 - the cache being down must not end the reply
            logger.warning("conversation %s: could not renew its claim", conversation.pk)
