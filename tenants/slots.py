"""Concurrency slots as leases: a slot that nobody renews frees itself.

A scope (a tenant, an API key) has a set of slot ids, each with the time its lease runs out.
Acquiring drops the expired leases, counts the live ones and adds the new slot's if that
count leaves room for them, in one atomic step; releasing removes them. A slot may be several
leases under one id (``size``: an API request fanned out to prompts × ``n`` engine sequences
holds one per sequence). While a request runs,
one renewer thread per process extends every slot the process holds, all in one call per
store, every third of a lease. So a long stream keeps its slot, and the slots of a process
that dies (killed between acquire and release) expire within one lease, however hard the
tenant keeps knocking: a refused attempt changes nothing.

Two stores, one interface, chosen by the default cache:

- Redis (``RedisCache``, production): a sorted set per scope, slot ids scored by lease expiry
  in milliseconds of the *server's* clock, so web hosts whose clocks differ agree on who is
  expired. Acquire, renew and count are Lua scripts; the set's own TTL follows its latest
  lease, so an abandoned scope leaves nothing behind.
- in-process (any other cache; the embedded mode's ``LocMemCache``, one web process): a dict
  of slot id -> expiry kept in that cache under a process-wide lock, so ``cache.clear()``
  clears it like every other counter.

The lease is ``settings.QUOTA_SLOT_LEASE_SECONDS`` (default 60 s), read at each acquire.

Public API: ``slot_acquire`` -> ``Slot`` or None (full); ``slot_release``; ``slot_count``
(live leases); ``renewer`` (the process's ``SlotRenewer``).
"""

import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from django.conf import settings
from django.core.cache import BaseCache, caches
from django.core.cache.backends.redis import RedisCache
from redis.commands.core import Script

logger = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 60.0
RENEWALS_PER_LEASE = 3  # a renewal may fail twice before a running request loses its slot


def lease_seconds() -> float:
    return float(getattr(settings, "QUOTA_SLOT_LEASE_SECONDS", DEFAULT_LEASE_SECONDS))


class _Store(Protocol):
    """Where the leases live. ``key`` is the store's own key for a scope's set."""

    def key_for(self, name: str) -> str: ...

    def acquire(self, key: str, members: list[str], limit: int, lease: float) -> bool: ...

    def release(self, key: str, members: list[str]) -> None: ...

    def renew(self, slots: "list[Slot]", lease: float) -> list[bool]:
        """Extend each slot's lease; False for a slot whose lease had already run out."""
        ...

    def count(self, key: str) -> int: ...


@dataclass(frozen=True, eq=False)
class Slot:
    """One held concurrency slot: ``size`` leases of one id in one scope's set."""

    key: str  # the store's key of the scope's set
    slot_id: str
    lease_seconds: float
    store: _Store
    size: int = 1

    @property
    def members(self) -> list[str]:
        """The set's entries this slot holds, one per lease."""
        if self.size == 1:
            return [self.slot_id]
        return [f"{self.slot_id}:{i}" for i in range(self.size)]


# KEYS[1]: the scope's set. ARGV: limit, lease (ms), the slot's members. Returns 1 (admitted)
# or 0.
_ACQUIRE = Script(
    None,
    b"""
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) + #ARGV - 2 > tonumber(ARGV[1]) then
  return 0
end
local lease = tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
end
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('PEXPIREAT', KEYS[1], now + lease + 1)
end
return 1
""",
)

# KEYS: the sets, one per member. ARGV: lease (ms), then the members in KEYS' order.
# Returns 1 per member renewed, 0 per member whose lease had run out (it stays gone).
_RENEW = Script(
    None,
    b"""
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease = tonumber(ARGV[1])
local expiry = now + lease
local renewed = {}
for i, key in ipairs(KEYS) do
  local slot_id = ARGV[i + 1]
  local score = redis.call('ZSCORE', key, slot_id)
  if score and tonumber(score) > now then
    redis.call('ZADD', key, expiry, slot_id)
    if redis.call('PTTL', key) < lease then
      redis.call('PEXPIREAT', key, expiry + 1)
    end
    renewed[i] = 1
  else
    if score then
      redis.call('ZREM', key, slot_id)
    end
    renewed[i] = 0
  end
end
return renewed
""",
)

# KEYS[1]: the scope's set. Returns the number of live leases.
_COUNT = Script(
    None,
    b"""
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
""",
)


class _StoreIdentity:
    """Stores compare equal when they reach the same data, so that the renewer makes one
    call per Redis server (or local cache), not one per thread's cache object."""

    _identity: tuple

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StoreIdentity) and self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)


class _RedisStore(_StoreIdentity):
    def __init__(self, backend: RedisCache) -> None:
        self._backend = backend
        # Keys are made before they reach the store, so the server alone names the data.
        self._identity = ("redis", backend._servers[0])

    def _client(self):
        return self._backend._cache.get_client(write=True)

    def key_for(self, name: str) -> str:
        return self._backend.make_key(name)

    def acquire(self, key: str, members: list[str], limit: int, lease: float) -> bool:
        args = [limit, _ms(lease), *members]
        return bool(_ACQUIRE(keys=[key], args=args, client=self._client()))

    def release(self, key: str, members: list[str]) -> None:
        self._client().zrem(key, *members)

    def renew(self, slots: "list[Slot]", lease: float) -> list[bool]:
        keys = [slot.key for slot in slots for _ in range(slot.size)]
        args = [_ms(lease), *(member for slot in slots for member in slot.members)]
        renewed = iter(_RENEW(keys=keys, args=args, client=self._client()))
        # a slot's members share one expiry: renewed together, or all run out
        return [all([bool(next(renewed)) for _ in range(slot.size)]) for slot in slots]

    def count(self, key: str) -> int:
        return int(_COUNT(keys=[key], client=self._client()))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class _LocalStore(_StoreIdentity):
    """One process's leases, kept in its (local) cache: every change happens under one lock,
    which makes get-modify-set atomic for every thread of the process."""

    _lock = threading.Lock()

    def __init__(self, backend: BaseCache) -> None:
        self._backend = backend
        # Every LocMemCache object of one name shares one dict: that dict names the data.
        self._identity = ("local", id(getattr(backend, "_cache", backend)))

    def key_for(self, name: str) -> str:
        return name  # the cache makes its own key

    def acquire(self, key: str, members: list[str], limit: int, lease: float) -> bool:
        now = time.time()
        with self._lock:
            leases = self._live(key, now)
            if len(leases) + len(members) > limit:
                return False
            leases.update(dict.fromkeys(members, now + lease))
            self._save(key, leases, now)
            return True

    def release(self, key: str, members: list[str]) -> None:
        now = time.time()
        with self._lock:
            leases = self._live(key, now)
            held = [member for member in members if leases.pop(member, None) is not None]
            if held:
                self._save(key, leases, now)

    def renew(self, slots: "list[Slot]", lease: float) -> list[bool]:
        now = time.time()
        renewed = []
        with self._lock:
            by_key: dict[str, dict[str, float]] = {}
            for slot in slots:
                leases = by_key.get(slot.key)
                if leases is None:
                    leases = by_key[slot.key] = self._live(slot.key, now)
                is_live = all(member in leases for member in slot.members)
                for member in slot.members:
                    if is_live:
                        leases[member] = now + lease
                    else:
                        leases.pop(member, None)
                renewed.append(is_live)
            for key, leases in by_key.items():
                self._save(key, leases, now)
        return renewed

    def count(self, key: str) -> int:
        with self._lock:
            return len(self._live(key, time.time()))

    def _live(self, key: str, now: float) -> dict[str, float]:
        leases = self._backend.get(key) or {}
        return {slot_id: expiry for slot_id, expiry in leases.items() if expiry > now}

    def _save(self, key: str, leases: dict[str, float], now: float) -> None:
        if leases:
            self._backend.set(key, leases, timeout=max(leases.values()) - now)
        else:
            self._backend.delete(key)


def _store() -> _Store:
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        return _RedisStore(backend)
    return _LocalStore(backend)


class SlotRenewer:
    """The process's one renewer: a daemon thread, started with the first slot, that renews
    every held slot every third of its lease, one store call per store and lease length."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._changed = threading.Condition()
        self._held: set[Slot] = set()
        # month reservations whose settle failed (the store was down) -> the tokens used
        self._unsettled: dict = {}
        self._thread: threading.Thread | None = None
        self._generation = 0
        self._next_renewal = 0.0  # time.monotonic() of the thread's next round

    def add(self, slot: Slot) -> None:
        with self._changed:
            self._held.add(slot)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._generation,), name="slot-renewer", daemon=True
                )
                self._thread.start()
            elif time.monotonic() + slot.lease_seconds / RENEWALS_PER_LEASE < self._next_renewal:
                self._changed.notify()  # a shorter lease than the others: renew sooner

    def discard(self, slot: Slot) -> None:
        with self._changed:
            self._held.discard(slot)

    def settle_later(self, reservation, actual_tokens: int, written_in: int | None = None) -> None:
        """Keep renewing ``reservation`` (a ``tenants.reservations.Reservation`` whose settle
        failed) and settle it each round until its store answers; ``written_in``: the
        generation its record was written in (``tenants.month_locks``), if known."""
        with self._changed:
            self._unsettled[reservation] = (actual_tokens, written_in)
        self.add(reservation)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def stop(self) -> None:
        """Stop renewing and forget every held slot, as the process's death would: their
        leases run out. The next ``add`` starts a new thread."""
        with self._changed:
            self._held.clear()
            self._unsettled.clear()
            self._generation += 1
            thread, self._thread = self._thread, None
            self._changed.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def renew(self) -> None:
        """Renew every held slot now; a slot whose lease had run out is dropped."""
        with self._changed:
            held = list(self._held)
        groups: dict[tuple[_Store, float], list[Slot]] = defaultdict(list)
        for slot in held:
            groups[slot.store, slot.lease_seconds].append(slot)
        for (store, lease), slots in groups.items():
            try:
                renewed = store.renew(slots, lease)
            except Exception:  # the store is down: try again next round, the lease may hold
                logger.exception("could not renew %d concurrency slots", len(slots))
                continue
            with self._changed:
                # Not renewed, and not released meanwhile: its lease ran out (a stall longer
                # than a lease, the store restarted). The request runs on without a slot.
                lost = [
                    slot
                    for slot, is_renewed in zip(slots, renewed, strict=True)
                    if not is_renewed and slot in self._held
                ]
                self._held.difference_update(lost)
            if lost:
                logger.warning("%d concurrency slots had expired before renewal", len(lost))
        self._settle_unsettled()

    def _settle_unsettled(self) -> None:
        with self._changed:
            unsettled = list(self._unsettled.items())
        for reservation, (actual_tokens, written_in) in unsettled:
            try:
                reservation.store.settle(reservation, actual_tokens, written_in)
            except Exception:  # still down: again next round, the lease renewed meanwhile
                logger.warning("could not settle a month reservation yet; trying again")
                continue
            with self._changed:
                self._unsettled.pop(reservation, None)
                self._held.discard(reservation)

    def _interval(self) -> float:
        leases = [slot.lease_seconds for slot in self._held]
        return min(leases, default=DEFAULT_LEASE_SECONDS) / RENEWALS_PER_LEASE

    def _run(self, generation: int) -> None:
        renewed_at = time.monotonic()
        while True:
            with self._changed:
                if self._generation != generation:
                    return
                self._next_renewal = renewed_at + self._interval()
                wait = self._next_renewal - time.monotonic()
                if wait > 0:
                    self._changed.wait(wait)
                    continue
            renewed_at = time.monotonic()
            self.renew()


renewer = SlotRenewer()


def _after_fork_in_child() -> None:
    # The child holds none of its parent's slots, has none of its threads, and must not
    # inherit a lock that one of them held.
    renewer._reset()
    _LocalStore._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def slot_acquire(*, name: str, limit: int, size: int = 1) -> Slot | None:
    """Take a slot of ``size`` leases in the scope ``name`` (a cache key) if the leases held
    there leave room for them under ``limit``, and keep it renewed until ``slot_release``;
    None if the scope is full. If the store fails, any lease the attempt may have taken is
    given back before the error propagates."""
    if size < 1:
        raise ValueError("a slot holds at least one lease")
    store = _store()
    slot = Slot(
        key=store.key_for(name),
        slot_id=uuid.uuid4().hex,
        lease_seconds=lease_seconds(),
        store=store,
        size=size,
    )
    try:
        if not store.acquire(slot.key, slot.members, limit, slot.lease_seconds):
            return None
        renewer.add(slot)
    except BaseException:
        # The script may have run before the connection failed: give back what it took.
        renewer.discard(slot)
        try:
            store.release(slot.key, slot.members)
        except Exception:
            logger.exception("could not give back a concurrency slot; its lease will expire")
        raise
    return slot


def slot_release(slot: Slot) -> None:
    """Give the slot back. Idempotent. If the store fails, the error propagates and the
    slot, no longer renewed, expires within a lease."""
    renewer.discard(slot)
    slot.store.release(slot.key, slot.members)


def slot_count(*, name: str) -> int:
    """The live leases in the scope ``name`` (a slot of ``size`` n counts n)."""
    store = _store()
    return store.count(store.key_for(name))
