"""The per-minute counters change in one step: a correction never makes a counter whose
window ended again (Django's incr looked, then incremented: a key that expired between the
two was made anew, with no expiry, and stayed in Redis for good)."""

import pytest
from django.core.cache import cache, caches
from django.core.cache.backends.redis import RedisCache

from tenants.window_counters import counter_add, counter_adjust


@pytest.fixture(autouse=True)
def _clean():
    cache.clear()
    yield
    cache.clear()


def _ttl(key: str) -> int | None:
    """The key's seconds to live on Redis (-1: none, -2: no key); None on another cache."""
    backend = caches["default"]
    if not isinstance(backend, RedisCache):
        return None
    return backend._cache.get_client(write=True).ttl(backend.make_key(key))


def test_an_addition_makes_a_missing_counter_with_its_expiry():
    assert counter_add("quota:t:1:tokens:9", 5, ttl=125) == 5
    assert counter_add("quota:t:1:tokens:9", 7, ttl=125) == 12
    assert cache.get("quota:t:1:tokens:9") == 12
    ttl = _ttl("quota:t:1:tokens:9")
    assert ttl is None or 0 < ttl <= 125


def test_a_correction_of_a_counter_gone_makes_none():
    assert not counter_adjust("quota:t:1:tokens:8", -5)
    assert cache.get("quota:t:1:tokens:8") is None
    assert _ttl("quota:t:1:tokens:8") in (None, -2)  # no key left behind, with or without TTL


def test_a_correction_keeps_the_counters_expiry():
    counter_add("quota:t:1:tokens:7", 10, ttl=125)
    assert counter_adjust("quota:t:1:tokens:7", -4)
    assert cache.get("quota:t:1:tokens:7") == 6
    ttl = _ttl("quota:t:1:tokens:7")
    assert ttl is None or 0 < ttl <= 125
