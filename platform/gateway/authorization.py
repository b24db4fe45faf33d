"""Who may call which model: an API key, its tenant and plan, and the deployment it asked for,
kept in memory for a few seconds so that the hot path does not query the database.

Looking the key and the deployment up costs two queries and a trip to a worker thread, about
half of what the gateway adds before a first token. So each web process keeps what it found
for ``GATEWAY_AUTH_CACHE_SECONDS`` and checks it is still current where it goes to a worker
thread anyway, on admission:

- Saving or deleting an API key, tenant, plan or deployment (or a deployment's plans) in any
  process replaces a token in Django's cache, the *auth generation*. Admission compares it
  with the one the entry was read under and, when it changed, the request is authorized
  again from the database. With Redis, a revoked key or a deactivated tenant is refused on
  its very next request, in every web process.
- The same signals clear this process's entries at once.
- Without a shared cache (the embedded mode: one web process, local memory), a change made
  by another process (a management command, a shell) reaches the web process when its
  entries expire, within ``GATEWAY_AUTH_CACHE_SECONDS``.

Keys are held by their SHA-256, never in the clear. Failed lookups are not cached. Requests
that miss together (a burst after the entry expired) share one lookup instead of one each.
"""

import asyncio
import hashlib
import time
import uuid
import weakref
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.utils import timezone

from config.workers import database_worker
from gateway.auth import api_key_for
from gateway.errors import ApiError
from serving.models import ModelDeployment
from serving.selectors import deployment_for_tenant, prefix_cache_salt
from tenants.models import ApiKey, Plan, Tenant, UsageRecord
from tenants.refusals import refusal_record
from tenants.selectors import tenant_priority, tenant_share

GENERATION_KEY = "gateway:auth-generation"
HEALTH_FIELDS = frozenset({"replicas", "health", "checked_at"})
MAX_ENTRIES = 10_000


class StaleAuthorization(Exception):
    """What an entry was read from has changed since; authorize again."""


@dataclass(frozen=True)
class Authorization:
    api_key: ApiKey  # with its tenant and plan loaded
    deployment: ModelDeployment
    cache_salt: str | None
    generation: str | None
    fetched_at: float
    priority: int = 1  # the engine priority of the tenant's plan tier (lower goes first)
    tenant_weight: float = 1.0  # the plan's share under fair scheduling

    def ensure_current(self) -> None:
        """Raise ``StaleAuthorization`` if anything it was read from changed since. Sync: it
        reads the shared cache, so call it from a worker thread (admission does)."""
        if cache.get(GENERATION_KEY) != self.generation:
            forget(self)
            raise StaleAuthorization


_entries: dict[tuple[str, str], Authorization] = {}
# lookups under way, per event loop, that later misses for the same key and model wait for
_lookups: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


async def authorize(raw_key: str, model: str) -> Authorization:
    """The key's authorization for ``model``; ``ApiError`` 401/403/404 as the API answers."""
    entry_key = _entry_key(raw_key, model)
    entry = _entries.get(entry_key)
    max_age = settings.GATEWAY_AUTH_CACHE_SECONDS
    if (
        entry is not None
        and time.monotonic() - entry.fetched_at < max_age
        and not entry.api_key.is_expired(timezone.now())
    ):
        return entry
    if max_age <= 0:
        return await _fetch(raw_key, model)
    lookups = _lookups.setdefault(asyncio.get_running_loop(), {})
    lookup = lookups.get(entry_key)
    if lookup is None:
        lookup = lookups[entry_key] = asyncio.ensure_future(_fetch(raw_key, model))
        lookup.add_done_callback(lambda done: _store(lookups, entry_key, done))
    # shielded: a waiter that goes away (a client disconnect) leaves the lookup to the others
    return await asyncio.shield(lookup)


def _store(lookups: dict, entry_key: tuple[str, str], lookup: asyncio.Future) -> None:
    if lookups.get(entry_key) is lookup:
        del lookups[entry_key]
    if lookup.cancelled() or lookup.exception() is not None:
        return
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[entry_key] = lookup.result()


def forget(entry: Authorization | None = None) -> None:
    """Drop one entry, or all of them."""
    if entry is None:
        _entries.clear()
        return
    # a snapshot: other threads (signal receivers, admission) may change the dict meanwhile
    for key, value in list(_entries.items()):
        if value is entry:
            _entries.pop(key, None)


@database_worker
def _fetch(raw_key: str, model: str) -> Authorization:
    # The generation is read first: a change made during the lookup leaves the entry stale.
    generation = cache.get(GENERATION_KEY)
    api_key = api_key_for(raw_key)
    deployment = deployment_for_tenant(tenant=api_key.tenant, name=model)
    if deployment is None:
        # the asked name is the client's text: not kept, so it cannot grow the counts' groups
        refusal_record(
            tenant_id=api_key.tenant_id,
            api_key_id=api_key.pk,
            source=UsageRecord.Source.API,
            code="model_not_found",
        )
        raise model_not_found(model)
    return Authorization(
        api_key=api_key,
        deployment=deployment,
        cache_salt=prefix_cache_salt(tenant=api_key.tenant, deployment=deployment),
        generation=generation,
        fetched_at=time.monotonic(),
        priority=tenant_priority(tenant=api_key.tenant),
        tenant_weight=tenant_share(tenant=api_key.tenant),
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _entry_key(raw_key: str, model: str) -> tuple[str, str]:
    return hashlib.sha256(raw_key.encode()).hexdigest(), model


def _changed(update_fields: frozenset[str] | None = None, **kwargs: object) -> None:
    if update_fields is not None and update_fields <= HEALTH_FIELDS:
        return  # the health poll's writes say nothing about who may call what
    _entries.clear()
    # after the commit, so that nobody reads the old rows under the new generation
    transaction.on_commit(_new_generation)


def _new_generation() -> None:
    _entries.clear()
    cache.set(GENERATION_KEY, uuid.uuid4().hex, timeout=None)


def connect_signals() -> None:
    """Called once from the app's ``ready()``."""
    for model in (ApiKey, Tenant, Plan, ModelDeployment):
        post_save.connect(_changed, sender=model, dispatch_uid=f"auth-{model.__name__}-save")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"auth-{model.__name__}-delete")
    m2m_changed.connect(
        _changed, sender=ModelDeployment.plans.through, dispatch_uid="auth-deployment-plans"
    )
