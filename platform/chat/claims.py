"""Who is generating a conversation's reply: a lease in the shared cache, so that only one
reply per conversation runs at a time across sockets and processes.

The holder renews the lease while its reply runs; a process that dies stops renewing, and the
conversation is free again within ``LEASE_SECONDS`` (not after a fixed long timeout). Each
claim has its own token, so a holder whose lease ran out cannot free a later holder's claim.

A conversation deleted while its reply runs (from another window, or another process) is
marked so in the same cache; the holder looks every ``DELETED_CHECK_SECONDS`` and stops the
reply (sockets subscribe to no channel-layer group, which would cost each a connection).
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from django.core.cache import cache

from chat.models import Conversation

logger = logging.getLogger(__name__)

LEASE_SECONDS = 30
RENEW_SECONDS = 10
DELETED_CHECK_SECONDS = 1.0
DELETED_MARK_SECONDS = 120  # longer than any holder takes to look


def claim_key(conversation: Conversation) -> str:
    return f"chat:generating:{conversation.tenant_id}:{conversation.pk}"


def deleted_key(conversation: Conversation) -> str:
    return f"chat:deleted:{conversation.tenant_id}:{conversation.pk}"


def mark_deleted(key: str) -> None:
    """Tell the holder of the conversation whose ``deleted_key`` this is that it is gone.
    Never raises: with the cache unreachable the reply runs to its end, and is not saved."""
    try:
        cache.set(key, 1, DELETED_MARK_SECONDS)
    except Exception:  # noqa: BLE001 - the deletion stands whatever the cache does
        logger.warning("could not mark %s deleted for its reply's holder", key)


def is_claimed(conversation: Conversation) -> bool:
    return cache.get(claim_key(conversation)) is not None


async def ais_claimed(conversation: Conversation) -> bool:
    return await cache.aget(claim_key(conversation)) is not None


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


async def akeep(
    conversation: Conversation, token: str, on_deleted: Callable[[], None] | None = None
) -> None:
    """Renew the claim every ``RENEW_SECONDS`` until cancelled. A claim found gone (the cache
    lost it, or this process stalled past the lease) is taken again when it is free. When the
    conversation is found deleted, call ``on_deleted`` and return."""
    key, deleted = claim_key(conversation), deleted_key(conversation)
    renewed_at = time.monotonic()
    while True:
        await asyncio.sleep(min(RENEW_SECONDS, DELETED_CHECK_SECONDS))
        try:
            if on_deleted is not None and await cache.aget(deleted) is not None:
                on_deleted()
                return
            if time.monotonic() - renewed_at < RENEW_SECONDS:
                continue
            renewed_at = time.monotonic()
            if await cache.aget(key) == token:
                await cache.atouch(key, LEASE_SECONDS)
            elif not await cache.aadd(key, token, LEASE_SECONDS):
                logger.warning("conversation %s: another process claimed it", conversation.pk)
        except Exception:  # noqa: BLE001 - the cache being down must not end the reply
            logger.warning("conversation %s: could not renew its claim", conversation.pk)
