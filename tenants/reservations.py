"""Token reservations on a counter, held as leases: a reservation that nobody renews comes off
the counter when its lease runs out.

Admission adds the most a request may use to the monthly token counter at once (so no burst
over-admits) and settles it with the engine's count at the end. A process killed in between
never settles, and its reservation stayed on the counter for the rest of the month (a killed
web process left 1,032 tokens there, with no usage record). So every reservation is also a
lease in a set kept beside its counter (the reservation's id -> its expiry and its tokens),
renewed with the process's concurrency slots by ``tenants.slots.renewer``. Whoever next adds
to the counter or reads it first takes the expired reservations off it; the counter is thus
the settled tokens plus the live reservations. Settling removes the lease and corrects the
counter by the tokens used less the tokens reserved, or, if the reservation had already
expired and come off, adds the tokens used. A settle the store did not take (Redis down) is
tried again by the renewer each round, its lease kept meanwhile, until the store answers; a
settle tried again after its first try went through (its answer lost) changes nothing, and
one tried again after the counter was recounted from the records (a seed, a rebuild: a later
generation, ``tenants.month_locks``) adds nothing, the recount having read its record.

Two stores, as for the slots: Redis (a Lua script per step, so each is atomic, with leases on
the server's clock) and in-process (the embedded mode's local memory, under the slots' lock).

A counter that is missing (a new month, an evicted key) is seeded from the usage records by
``counter_seed``, which in one step creates it and drops any leases left from before (the
records hold none of them): only the request that created it drops them, so a reservation
another request added to the new counter meanwhile is never lost (it was, when the creation
and the drop were two steps: its tokens stayed on the counter with no lease to take them off).

Public API: ``counter_seed``; ``reservation_add`` -> (``Reservation``, the counter's new
value); ``reservation_settle``; ``counter_value`` (the counter once the expired reservations
are off it); ``counter_held`` (what its live reservations hold); ``counter_rebuild``.
"""

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from django.core.cache import BaseCache, caches
from django.core.cache.backends.redis import RedisCache
from redis.commands.core import Script

from tenants import slots

logger = logging.getLogger(__name__)

# how long a settled reservation's id is remembered, so that settling it again changes nothing
SETTLED_MEMORY_MS = 15 * 60 * 1000

# KEYS: the counter, its leases (a sorted set: id -> expiry in ms), its reservations (a hash:
# id -> tokens). Takes the expired reservations off the counter.
_EXPIRE = b"""
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
local freed = 0
for _, id in ipairs(expired) do
  freed = freed + tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
end
if freed > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DECRBY', KEYS[1], freed)
end
"""

# ARGV: tokens, lease (ms), the reservation's id, the keys' TTL (s). Returns the new value.
_ADD = Script(
    None,
    _EXPIRE
    + b"""
local value = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[3], ARGV[4])
return value
""",
)

# Returns the counter's value (false when it has none).
_VALUE = Script(None, _EXPIRE + b"return redis.call('GET', KEYS[1])")

# Sums what the live reservations hold into ``held`` (KEYS[3]: the reservations' hash).
_HELD_SUM = b"""
local held = 0
for _, tokens in ipairs(redis.call('HVALS', KEYS[3])) do
  held = held + tonumber(tokens)
end
"""

# KEYS[4]: the counter's generation. ARGV: the settled tokens, the rebuild's generation. Sets
# an existing counter to them plus what its live reservations hold (a counter that is missing
# stays missing: the next admission seeds it), and its generation. Returns 1 when it was there.
_REBUILD = Script(
    None,
    _EXPIRE
    + b"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
"""
    + _HELD_SUM
    + b"""
redis.call('SET', KEYS[1], tonumber(ARGV[1]) + held, 'KEEPTTL')
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then
  redis.call('SET', KEYS[4], ARGV[2], 'EX', ttl)
else
  redis.call('SET', KEYS[4], ARGV[2])
end
return 1
""",
)

# Returns the tokens the live reservations hold.
_HELD = Script(
    None,
    _EXPIRE + _HELD_SUM + b"return held\n",
)

# KEYS[4]: the counter's generation. ARGV: the seed, the keys' TTL (s), the seed's generation.
# Returns 1 when it created the counter, 0 when it was there.
_SEED = Script(
    None,
    b"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('SET', KEYS[4], ARGV[3], 'EX', ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
""",
)

# KEYS: the counter, its leases, its reservations, the reservations settled in the last
# SETTLED_MEMORY_MS (a sorted set: id -> when), the counter's generation. ARGV: the
# reservation's id, the tokens used, SETTLED_MEMORY_MS, the generation its record was written
# in (-1: none known). Settling one again (a try again whose first try went through, its
# answer lost) changes nothing; one whose record a later generation counted adds nothing.
_SETTLE = Script(
    None,
    b"""
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then
  return 0
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[3]))
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
local reserved = redis.call('HGET', KEYS[3], ARGV[1])
local correction = tonumber(ARGV[2])
local generation = redis.call('GET', KEYS[5])
if tonumber(ARGV[4]) >= 0 and generation and tonumber(generation) > tonumber(ARGV[4]) then
  correction = 0
end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 and reserved then
  correction = correction - tonumber(reserved)
end
redis.call('HDEL', KEYS[3], ARGV[1])
if correction ~= 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('INCRBY', KEYS[1], correction)
end
return 1
""",
)

# KEYS: leases, one per reservation. ARGV: lease (ms), then the ids in KEYS' order. An expired
# lease is left for _EXPIRE, which takes its tokens off the counter with it.
_RENEW = Script(
    None,
    b"""
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease = tonumber(ARGV[1])
local renewed = {}
for i, key in ipairs(KEYS) do
  local score = redis.call('ZSCORE', key, ARGV[i + 1])
  if score and tonumber(score) > now then
    redis.call('ZADD', key, now + lease, ARGV[i + 1])
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
""",
)


@dataclass(frozen=True, eq=False)
class Reservation:
    """Tokens held on one counter under one lease (renewed like a concurrency slot)."""

    key: str  # the store's key of the counter
    reservation_id: str
    tokens: int
    lease_seconds: float
    store: "_RedisStore | _LocalStore"


class _RedisStore(slots._StoreIdentity):
    def __init__(self, backend: RedisCache) -> None:
        self._backend = backend
        self._identity = ("redis-reservations", backend._servers[0])

    def _keys(self, key: str) -> list[str]:
        return [key, f"{key}:leases", f"{key}:reserved"]

    def _client(self):
        return self._backend._cache.get_client(write=True)

    def key_for(self, name: str) -> str:
        return self._backend.make_key(name)

    def add(self, reservation: Reservation, ttl: int) -> int:
        args = [reservation.tokens, slots._ms(reservation.lease_seconds)]
        args += [reservation.reservation_id, ttl]
        return int(_ADD(keys=self._keys(reservation.key), args=args, client=self._client()))

    def settle(
        self, reservation: Reservation, actual_tokens: int, written_in: int | None = None
    ) -> None:
        key = reservation.key
        keys = [*self._keys(key), f"{key}:settled", f"{key}:generation"]
        written = -1 if written_in is None else written_in
        args = [reservation.reservation_id, actual_tokens, SETTLED_MEMORY_MS, written]
        _SETTLE(keys=keys, args=args, client=self._client())

    def value(self, key: str) -> int | None:
        value = _VALUE(keys=self._keys(key), client=self._client())
        return None if value is None else int(value)

    def held(self, key: str) -> int:
        return int(_HELD(keys=self._keys(key), client=self._client()))

    def rebuild(self, key: str, settled: int, generation: int) -> bool:
        keys = [*self._keys(key), f"{key}:generation"]
        return bool(_REBUILD(keys=keys, args=[settled, generation], client=self._client()))

    def seed(self, key: str, value: int, ttl: int, generation: int) -> bool:
        keys = [*self._keys(key), f"{key}:generation"]
        return bool(_SEED(keys=keys, args=[value, ttl, generation], client=self._client()))

    def renew(self, reservations: list[Reservation], lease: float) -> list[bool]:
        keys = [self._keys(r.key)[1] for r in reservations]
        args = [slots._ms(lease), *(r.reservation_id for r in reservations)]
        return [bool(r) for r in _RENEW(keys=keys, args=args, client=self._client())]


class _LocalStore(slots._StoreIdentity):
    """One process's reservations in its local cache: the counter, and its leases under
    ``<counter>:leases`` (id -> (expiry, tokens)), changed under the slots' process lock."""

    def __init__(self, backend: BaseCache) -> None:
        self._backend = backend
        self._identity = ("local-reservations", id(getattr(backend, "_cache", backend)))

    def key_for(self, name: str) -> str:
        return name

    def add(self, reservation: Reservation, ttl: int) -> int:
        with slots._LocalStore._lock:
            leases = self._expire(reservation.key)
            self._backend.add(reservation.key, 0, timeout=ttl)
            value = self._backend.incr(reservation.key, reservation.tokens)
            expiry = time.time() + reservation.lease_seconds
            leases[reservation.reservation_id] = (expiry, reservation.tokens)
            self._backend.set(f"{reservation.key}:leases", leases, timeout=ttl)
            return value

    # (counter, reservation id) -> when it was settled (monotonic), oldest first: the local
    # cache pickles what it holds, so the memory of settled ids stays in the process
    _settled: "OrderedDict[tuple[str, str], float]" = OrderedDict()

    def settle(
        self, reservation: Reservation, actual_tokens: int, written_in: int | None = None
    ) -> None:
        with slots._LocalStore._lock:
            now, settled = time.monotonic(), self._settled
            while settled and next(iter(settled.values())) < now - SETTLED_MEMORY_MS / 1000:
                settled.popitem(last=False)
            if (reservation.key, reservation.reservation_id) in settled:
                return
            settled[reservation.key, reservation.reservation_id] = now
            leases = self._backend.get(f"{reservation.key}:leases") or {}
            generation = self._backend.get(f"{reservation.key}:generation")
            is_counted = written_in is not None and generation is not None
            correction = 0 if is_counted and generation > written_in else actual_tokens
            held = leases.pop(reservation.reservation_id, None)
            if held is not None:
                correction -= held[1]
                self._backend.set(f"{reservation.key}:leases", leases, timeout=None)
            if correction and self._backend.has_key(reservation.key):
                self._backend.incr(reservation.key, correction)

    def value(self, key: str) -> int | None:
        with slots._LocalStore._lock:
            self._expire(key)
            return self._backend.get(key)

    def held(self, key: str) -> int:
        with slots._LocalStore._lock:
            return sum(tokens for _, tokens in self._expire(key).values())

    def rebuild(self, key: str, settled: int, generation: int) -> bool:
        with slots._LocalStore._lock:
            leases = self._expire(key)
            if not self._backend.has_key(key):
                return False
            held = sum(tokens for _, tokens in leases.values())
            # by its difference: ``incr`` keeps the counter's time to live
            self._backend.incr(key, settled + held - self._backend.get(key))
            self._backend.set(f"{key}:generation", generation, timeout=None)
            return True

    def seed(self, key: str, value: int, ttl: int, generation: int) -> bool:
        with slots._LocalStore._lock:
            if not self._backend.add(key, value, timeout=ttl):
                return False
            self._backend.set(f"{key}:generation", generation, timeout=ttl)
            self._backend.delete(f"{key}:leases")
            return True

    def renew(self, reservations: list[Reservation], lease: float) -> list[bool]:
        now = time.time()
        renewed = []
        with slots._LocalStore._lock:
            for reservation in reservations:
                leases_key = f"{reservation.key}:leases"
                leases = self._backend.get(leases_key) or {}
                held = leases.get(reservation.reservation_id)
                is_live = held is not None and held[0] > now
                if is_live:
                    leases[reservation.reservation_id] = (now + lease, held[1])
                    self._backend.set(leases_key, leases, timeout=None)
                renewed.append(is_live)
        return renewed

    def _expire(self, key: str) -> dict[str, tuple[float, int]]:
        """Take the expired reservations off the counter; the live leases."""
        leases = self._backend.get(f"{key}:leases") or {}
        now = time.time()
        expired = [rid for rid, (expiry, _) in leases.items() if expiry <= now]
        if not expired:
            return leases
        freed = sum(leases.pop(rid)[1] for rid in expired)
        if self._backend.has_key(key):
            self._backend.incr(key, -freed)
        self._backend.set(f"{key}:leases", leases, timeout=None)
        return leases


def _store() -> "_RedisStore | _LocalStore":
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        return _RedisStore(backend)
    return _LocalStore(backend)


def reservation_add(*, name: str, tokens: int, ttl: int) -> tuple[Reservation, int]:
    """Add ``tokens`` to the counter ``name`` (a cache key; made with ``ttl`` seconds to live
    when missing) under a new lease, renewed until ``reservation_settle``; the reservation and
    the counter's new value."""
    store = _store()
    reservation = Reservation(
        key=store.key_for(name),
        reservation_id=uuid.uuid4().hex,
        tokens=tokens,
        lease_seconds=slots.lease_seconds(),
        store=store,
    )
    try:
        value = store.add(reservation, ttl)
        slots.renewer.add(reservation)
    except BaseException:
        slots.renewer.discard(reservation)
        raise
    return reservation, value


def reservation_settle(
    reservation: Reservation,
    *,
    actual_tokens: int,
    generation: Callable[[], int] | None = None,
) -> None:
    """Replace the reservation with ``actual_tokens`` on its counter (see the module
    docstring). Call it once. If the store fails, the error propagates, and the process's
    renewer keeps the lease and settles it again each round until the store answers (a lease
    left to run out would take the reservation off and never put what was used on).
    ``generation``: the generation the request's record is written in
    (``tenants.month_locks``), read only then: tried again, the settle adds nothing to a
    counter recounted from the records since."""
    slots.renewer.discard(reservation)
    try:
        reservation.store.settle(reservation, actual_tokens)
    except Exception:
        slots.renewer.settle_later(reservation, actual_tokens, _read(generation))
        raise


def _read(generation: Callable[[], int] | None) -> int | None:
    if generation is None:
        return None
    try:
        return generation()
    except Exception:  # noqa: BLE001 - the database too: tried again as before, unguarded
        logger.exception("could not read the month counters' generation")
        return None


def counter_value(*, name: str) -> int | None:
    """The counter ``name`` with its expired reservations taken off; None when it has none."""
    store = _store()
    return store.value(store.key_for(name))


def counter_held(*, name: str) -> int:
    """The tokens the counter ``name``'s live reservations hold (its value less what was
    settled)."""
    store = _store()
    return store.held(store.key_for(name))


def counter_rebuild(*, name: str, settled: int, generation: int) -> bool:
    """Set the counter ``name`` to ``settled`` plus what its live reservations hold, in one
    step, if it exists (True then), and keep the rebuild's ``generation``; a missing one stays
    missing."""
    store = _store()
    return store.rebuild(store.key_for(name), settled, generation)


def counter_seed(*, name: str, value: int, ttl: int, generation: int) -> bool:
    """Create the counter ``name`` at ``value`` (``ttl`` seconds to live), keeping the seed's
    ``generation``, and drop its old leases, in one step, unless it exists; True when this call
    created it. A reservation whose lease is dropped so, settled later, adds its tokens used,
    as an expired one does."""
    store = _store()
    return store.seed(store.key_for(name), value, ttl, generation)
