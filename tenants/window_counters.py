"""The per-minute counters of requests and tokens: atomic on Redis.

Django's ``cache.incr`` looks whether the key exists, then increments it: two round trips.
A counter that expires between them is made again by the increment, with no expiry: a key
left in Redis for good (its window's name is never used again), which no eviction policy
of volatile keys removes. Here each change is one script: an addition that makes a missing
counter with its expiry, and a correction that changes only a counter still there. Any other
cache (the embedded mode's in-process one) keeps Django's way, whose increments hold a lock.
"""

from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from redis.commands.core import Script

# ARGV: amount, the TTL (s) of a counter made now. Returns the new value.
_ADD = Script(
    None,
    b"""
local value = redis.call('INCRBY', KEYS[1], ARGV[1])
if redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return value
""",
)
# ARGV: amount. Changes a counter that is still there; returns whether it was.
_ADJUST = Script(
    None,
    b"""
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('INCRBY', KEYS[1], ARGV[1])
return 1
""",
)


def counter_add(key: str, amount: int, ttl: int) -> int:
    """Add ``amount`` to the counter ``key`` (a cache key), made with ``ttl`` seconds to live
    when missing; the new value."""
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        client = backend._cache.get_client(write=True)
        return int(_ADD(keys=[backend.make_key(key)], args=[amount, ttl], client=client))
    for _ in range(3):
        backend.add(key, 0, timeout=ttl)
        try:
            return backend.incr(key, amount)
        except ValueError:  # evicted between add and incr
            continue
    raise RuntimeError(f"quota counter {key} keeps disappearing")


def counter_adjust(key: str, amount: int) -> bool:
    """Add ``amount`` (negative: take it back) to the counter ``key`` if it is still there
    (gone, its window ended: nothing is left to correct); whether it was."""
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        client = backend._cache.get_client(write=True)
        return bool(_ADJUST(keys=[backend.make_key(key)], args=[amount], client=client))
    try:
        backend.incr(key, amount)
    except ValueError:
        return False
    return True
