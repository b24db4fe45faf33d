"""Concurrency slots as leases, against both stores: the in-process one (local memory) and
Redis (REDIS_URL, or a Redis on localhost; skipped when none answers). Leases are short here
(LEASE and RENEWED_LEASE seconds), so expiry and renewal take seconds, never a real minute."""

import os
import signal
import subprocess
import threading
import time
import uuid

import pytest
from django.core.cache import cache
from django.test import override_settings

from tenants import quotas, services, slots
from tests.conftest import PYTHON, ROOT, subprocess_env
from tests.tenants.racers import race_processes, subprocess_database_url
from tests.tenants.racers import tenant_with as _tenant

pytestmark = pytest.mark.django_db

LEASE = 0.5
# Where a slot must survive on renewals: a third of this is how late a renewal may be on a
# loaded machine before the test fails.
RENEWED_LEASE = 1.5
# Without REDIS_URL, a database of its own on a local Redis: the suite's Redis runs flush
# database 0 between tests and bench/reliability.py flushes 15, maybe while this one runs.
REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/13"


def _redis_or_skip() -> None:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis answers at {REDIS_URL}")


@pytest.fixture(params=["local", "redis"])
def store(request):
    """The default cache is the store's, with short leases; nothing else on that Redis is
    touched (the keys have a prefix of their own and only they are deleted)."""
    if request.param == "redis":
        _redis_or_skip()
        prefix = f"test-slots-{uuid.uuid4().hex[:8]}"
        backend = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": prefix,
        }
    else:
        backend = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "slots"}
    with override_settings(CACHES={"default": backend}, QUOTA_SLOT_LEASE_SECONDS=LEASE):
        yield request.param
        slots.renewer.stop()
        if request.param == "redis":
            client = cache._cache.get_client(write=True)
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
        else:
            cache.clear()


def _admit(tenant, api_key=None):
    return quotas.admission_acquire(tenant=tenant, api_key=api_key, estimated_tokens=1)


def _is_admitted(tenant) -> bool:
    try:
        ticket = _admit(tenant)
    except quotas.QuotaExceeded as refused:
        assert refused.kind == "concurrency"
        return False
    quotas.admission_release(ticket=ticket, actual_tokens=1)
    return True


def _held(tenant, api_key=None) -> int:
    return quotas.quota_usage(tenant=tenant, api_key=api_key).concurrent_requests


def test_a_leaked_slot_frees_itself_after_its_lease(store):
    tenant = _tenant(max_concurrent_requests=1)
    _admit(tenant)  # never released
    slots.renewer.stop()  # the process that held it dies

    assert not _is_admitted(tenant)
    assert _held(tenant) == 1
    time.sleep(LEASE * 1.2)
    assert _held(tenant) == 0
    assert _is_admitted(tenant)


@override_settings(QUOTA_SLOT_LEASE_SECONDS=RENEWED_LEASE)
def test_a_running_requests_slot_outlives_its_lease_while_renewed(store):
    tenant = _tenant(max_concurrent_requests=1)
    ticket = _admit(tenant)

    time.sleep(RENEWED_LEASE * 2)
    assert _held(tenant) == 1
    assert not _is_admitted(tenant)
    quotas.admission_release(ticket=ticket, actual_tokens=1)
    assert _held(tenant) == 0
    assert _is_admitted(tenant)


def test_refused_attempts_extend_nothing(store):
    tenant = _tenant(max_concurrent_requests=1)
    leaked_at = time.monotonic()
    _admit(tenant)
    slots.renewer.stop()

    # Knock ten times a lease: were a refusal to renew anything, the slot would never free.
    while not _is_admitted(tenant):
        assert time.monotonic() - leaked_at < LEASE * 3, "the leaked slot never expired"
        time.sleep(LEASE / 10)
    assert time.monotonic() - leaked_at >= LEASE


def test_key_and_tenant_slots_are_leased_apart(store):
    tenant = _tenant(max_concurrent_requests=3)
    api_key, _ = services.api_key_create(tenant=tenant, name="ci", max_concurrent_requests=1)
    held = _admit(tenant, api_key)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        _admit(tenant, api_key)
    assert refused.value.scope == "key"
    assert (_held(tenant), _held(tenant, api_key)) == (1, 1)  # the key's refusal gave back
    assert len(held.concurrency_counters) == 2  # the tenant's slot and the key's

    quotas.admission_release(ticket=held, actual_tokens=1)
    assert (_held(tenant), _held(tenant, api_key)) == (0, 0)
    assert slots.renewer.num_held == 0


def test_racing_threads_take_exactly_the_limit(store):
    tenant = _tenant(max_concurrent_requests=7)
    admitted, refused = [], []
    start = threading.Barrier(40)

    def attempt() -> None:
        start.wait()
        try:
            admitted.append(_admit(tenant))
        except quotas.QuotaExceeded:
            refused.append(1)

    threads = [threading.Thread(target=attempt) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (len(admitted), len(refused), _held(tenant)) == (7, 33, 7)
    for ticket in admitted:
        quotas.admission_release(ticket=ticket, actual_tokens=1)
    assert _held(tenant) == 0


def test_a_lost_lease_is_not_renewed_back(store):
    """A slot whose lease ran out before its renewal (a stalled process) stays gone: the
    renewer drops it instead of resurrecting it over someone else's."""
    tenant = _tenant(max_concurrent_requests=1)
    ticket = _admit(tenant)
    slots.renewer.stop()
    time.sleep(LEASE * 1.2)
    slots.renewer.add(ticket.slots[0])  # the stalled process wakes up

    slots.renewer.renew()
    assert slots.renewer.num_held == 0
    assert _held(tenant) == 0
    quotas.admission_release(ticket=ticket, actual_tokens=1)  # late, and harmless


def test_a_fanned_out_request_holds_a_lease_per_sequence(store):
    tenant = _tenant(max_concurrent_requests=256)
    fanned = quotas.admission_acquire(tenant=tenant, estimated_tokens=1, num_sequences=255)
    assert _held(tenant) == 255
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=1, num_sequences=2)
    assert refused.value.kind == "concurrency" and not refused.value.is_hopeless
    assert _is_admitted(tenant)  # the 256th

    quotas.admission_release(ticket=fanned, actual_tokens=1)
    assert _held(tenant) == 0
    full = quotas.admission_acquire(tenant=tenant, estimated_tokens=1, num_sequences=256)
    assert _held(tenant) == 256
    quotas.admission_release(ticket=full, actual_tokens=1)


def test_more_sequences_than_the_limit_is_hopeless(store):
    tenant = _tenant(max_concurrent_requests=4)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=1, num_sequences=5)
    assert (refused.value.kind, refused.value.is_hopeless) == ("too_many_sequences", True)
    assert _held(tenant) == 0


@override_settings(QUOTA_SLOT_LEASE_SECONDS=RENEWED_LEASE)
def test_every_lease_of_a_fanned_out_slot_is_renewed(store):
    tenant = _tenant(max_concurrent_requests=3)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=1, num_sequences=3)

    time.sleep(RENEWED_LEASE * 2)
    assert _held(tenant) == 3
    assert not _is_admitted(tenant)
    quotas.admission_release(ticket=ticket, actual_tokens=1)
    assert _held(tenant) == 0


# Across processes: only with the suite's shared Redis and PostgreSQL (REDIS_URL set).
needs_shared_redis = pytest.mark.skipif(
    not os.environ.get("REDIS_URL"), reason="needs REDIS_URL: slots shared across processes"
)


@pytest.fixture
def shared_cache():
    yield
    slots.renewer.stop()
    cache.clear()  # what the racers left behind


@needs_shared_redis
@pytest.mark.django_db(transaction=True)
def test_processes_racing_for_slots_take_exactly_the_limit(tmp_path, shared_cache):
    tenant = _tenant(max_concurrent_requests=10)
    counts = race_processes(tenant, tmp_path, num_processes=4, num_threads=25)
    assert sum(counts) == 10
    assert _held(tenant) == 10  # the racers exited holding them: the leases still run


HOLDER = """
import sys, time, django
django.setup()
from django.conf import settings
settings.QUOTA_SLOT_LEASE_SECONDS = float(sys.argv[2])
from tenants import quotas
from tenants.models import Tenant
tenant = Tenant.objects.select_related("plan").get(pk=int(sys.argv[1]))
quotas.admission_acquire(tenant=tenant, estimated_tokens=1)
print("admitted", flush=True)
time.sleep(600)
"""


@needs_shared_redis
@pytest.mark.django_db(transaction=True)
def test_a_killed_process_slot_frees_itself_while_a_live_ones_holds(tmp_path, shared_cache):
    tenant = _tenant(max_concurrent_requests=1)
    holder = subprocess.Popen(
        [PYTHON, "-c", HOLDER, str(tenant.pk), str(RENEWED_LEASE)],
        cwd=ROOT,
        env=subprocess_env(DATABASE_URL=subprocess_database_url()),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "admitted"
        time.sleep(RENEWED_LEASE * 2)  # its renewer keeps the slot
        assert not _is_admitted(tenant)

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert not _is_admitted(tenant)
        time.sleep(RENEWED_LEASE * 1.2)
        assert _is_admitted(tenant)
    finally:
        holder.kill()
        holder.wait(timeout=10)
