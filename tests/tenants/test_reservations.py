"""Month token reservations as leases (tenants.reservations), against both stores: one held
by a process that died comes off the counter when its lease runs out, so the counter returns
to the sum of the usage records; one that is renewed holds. Leases are short here (see
test_slots)."""

import time

import pytest
from django.core.cache import cache
from django.test import override_settings
from django.utils import timezone

from tenants import quotas, services, slots
from tenants.models import UsageRecord
from tenants.reservations import counter_seed, counter_value, reservation_add, reservation_settle
from tenants.selectors import month_tokens_used
from tests.tenants.racers import tenant_with as _tenant
from tests.tenants.test_slots import LEASE, RENEWED_LEASE, store  # noqa: F401  (fixture)
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db

RESERVED = 1032


def _recorded(tenant, tokens: int) -> None:
    now = timezone.now()
    api_key, _ = services.api_key_create(tenant=tenant, name=f"k{time.monotonic_ns()}")
    usage_record_add(
        request_id=f"r-{tokens}-{time.monotonic_ns()}",
        tenant=tenant,
        api_key=api_key,
        model="m",
        source=UsageRecord.Source.API,
        status=UsageRecord.Status.OK,
        started_at=now,
        finished_at=now,
        prompt_tokens=tokens,
    )


def _month(tenant) -> int:
    return quotas.quota_usage(tenant=tenant).month_tokens


def _records_sum(tenant) -> int:
    month_start = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return month_tokens_used(tenant=tenant, api_key=None, since=month_start)


def _eventually(predicate, within: float) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(LEASE / 10)
    return True


def _store_down(monkeypatch, reservation) -> list[bool]:
    """Make the reservation's store refuse every settle while the list returned holds True
    (clear it to bring the store back)."""
    store_class = type(reservation.store)
    settle, is_down = store_class.settle, [True]

    def settle_unless_down(self, reservation, actual_tokens, *args) -> None:
        if is_down:
            raise ConnectionError("Error 111 connecting to the store. Connection refused.")
        settle(self, reservation, actual_tokens, *args)

    monkeypatch.setattr(store_class, "settle", settle_unless_down)
    return is_down


def _settle_with_a_record(ticket, api_key, request_id: str, tokens: int) -> None:
    """End the ticket's request as the platform does (``serving.settlement``): its record
    written and its month settled in one transaction."""
    import asyncio

    from serving import settlement

    now = timezone.now()
    record = {
        "request_id": request_id, "tenant": api_key.tenant, "api_key": api_key, "model": "m",
        "source": UsageRecord.Source.API, "status": UsageRecord.Status.OK,
        "started_at": now, "finished_at": now, "completion_tokens": tokens,
    }  # fmt: skip
    asyncio.run(settlement.settle(settlement.Settlement(ticket, tokens, record)))


def test_a_dead_processes_reservation_comes_off_the_month_with_its_lease(store):  # noqa: F811
    """A web process killed mid-request never settles: its reservation stayed on the month
    counter (1,032 tokens, with no record) for the rest of the month."""
    tenant = _tenant(monthly_token_budget=100_000)
    _recorded(tenant, 500)
    quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)  # never released
    assert _month(tenant) == 500 + RESERVED
    slots.renewer.stop()  # the process dies: nothing renews its leases

    assert _eventually(lambda: _month(tenant) == _records_sum(tenant) == 500, LEASE * 20)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=100)
    quotas.admission_release(ticket=ticket, actual_tokens=10)
    assert _month(tenant) == 510


@override_settings(QUOTA_SLOT_LEASE_SECONDS=RENEWED_LEASE)
def test_a_running_requests_reservation_holds_while_renewed(store):  # noqa: F811
    tenant = _tenant(monthly_token_budget=100_000)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)
    time.sleep(RENEWED_LEASE * 2)  # two leases: only renewals keep it
    assert _month(tenant) == RESERVED
    quotas.admission_release(ticket=ticket, actual_tokens=30)
    assert _month(tenant) == 30


def test_a_reservation_settled_after_its_lease_ran_out_counts_what_was_used(store):  # noqa: F811
    """A process that stalled past its lease settles late: its reservation is already off
    the counter, so only its real count goes on."""
    tenant = _tenant(monthly_token_budget=100_000)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)
    slots.renewer.stop()
    assert _eventually(lambda: _month(tenant) == 0, LEASE * 20)
    quotas.admission_release(ticket=ticket, actual_tokens=40)
    assert _month(tenant) == 40


def test_a_refused_admission_leaves_no_reservation_behind(store):  # noqa: F811
    tenant = _tenant(monthly_token_budget=100_000, max_concurrent_requests=1)
    held = quotas.admission_acquire(tenant=tenant, estimated_tokens=100)
    with pytest.raises(quotas.QuotaExceeded) as refused:
        quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)
    assert refused.value.kind == "concurrency"
    assert _month(tenant) == 100
    quotas.admission_release(ticket=held, actual_tokens=100)
    time.sleep(LEASE * 1.5)  # were a lease of the refused one left, it would come off now
    assert _month(tenant) == 100


def test_seeding_a_counter_keeps_the_reservations_added_after_it_was_created(store):  # noqa: F811
    """Two first requests of a month both find the counter missing. The one that creates it
    drops the old leases in the same step; the other's seed does nothing. A reservation added
    between the two was dropped when the drop was a step of its own: its tokens stayed on the
    counter with no lease to take them off (a killed web process's, for the rest of the month)."""
    name = f"month-{time.monotonic_ns()}"
    stale, _ = reservation_add(name=name, tokens=7, ttl=3600)  # a lease from before the seed
    reservation_settle(stale, actual_tokens=7)
    assert counter_seed(name=name, value=500, ttl=3600, generation=1) is False  # it exists
    fresh = f"{name}-new"
    leftover, _ = reservation_add(name=fresh, tokens=5, ttl=3600)  # an old lease of a counter
    cache.delete(fresh)  # ... that was evicted
    assert counter_value(name=fresh) is None
    assert counter_seed(name=fresh, value=500, ttl=3600, generation=1) is True
    reserved, value = reservation_add(name=fresh, tokens=RESERVED, ttl=3600)  # the other request
    assert value == 500 + RESERVED
    assert counter_seed(name=fresh, value=500, ttl=3600, generation=1) is False  # the late one
    assert counter_value(name=fresh) == 500 + RESERVED
    slots.renewer.stop()  # its process dies: only its lease takes it off
    assert _eventually(lambda: counter_value(name=fresh) == 500, LEASE * 20)
    reservation_settle(leftover, actual_tokens=3)  # its lease was dropped at the seed
    assert counter_value(name=fresh) == 503


def test_a_reservation_settled_while_its_store_is_down_is_settled_when_it_is_back(
    store,  # noqa: F811
    monkeypatch,
):
    """Redis was unreachable as a request settled (and came back with its data): the lease,
    no longer renewed, ran out and took the reservation off, and what the request had used
    never went on. The month counter was short of the records for the rest of the month."""
    tenant = _tenant(monthly_token_budget=100_000)
    _recorded(tenant, 500)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)
    [reservation] = ticket.reservations
    is_down = _store_down(monkeypatch, reservation)
    with pytest.raises(ConnectionError):
        quotas.admission_release(ticket=ticket, actual_tokens=40)
    slots.renewer.renew()  # a round while it is still down: the lease is kept
    assert _month(tenant) == 500 + RESERVED

    is_down.clear()
    slots.renewer.renew()  # the next round, once it answers

    assert _month(tenant) == 540
    slots.renewer.renew()
    assert _month(tenant) == 540  # settled once


def test_settling_a_reservation_again_changes_nothing(store):  # noqa: F811
    """A settle whose answer was lost after the store had run it is tried again: it must not
    count what was used twice."""
    tenant = _tenant(monthly_token_budget=100_000)
    ticket = quotas.admission_acquire(tenant=tenant, estimated_tokens=RESERVED)
    [reservation] = ticket.reservations
    reservation_settle(reservation, actual_tokens=40)
    reservation_settle(reservation, actual_tokens=40)
    assert _month(tenant) == 40


@pytest.mark.django_db(transaction=True)  # the settlement writes on a thread of its own
@pytest.mark.parametrize("recount", ["seed after the counter is lost", "rebuild"])
def test_a_settle_tried_again_after_a_recount_of_the_month_counts_once(
    store,  # noqa: F811
    monkeypatch,
    recount,
):
    """The store was down as a request's record was written: its settle was tried again
    later, outside the month lock, after a recount had read the record (the next admission's
    seed, Redis having come back without the counter; a budget change's rebuild) and added its
    tokens a second time: 1,400 on the counter for 700 in the records."""
    tenant = _tenant(monthly_token_budget=100_000)
    api_key, _ = services.api_key_create(tenant=tenant, name="k")
    _recorded(tenant, 500)
    ticket = quotas.admission_acquire(tenant=tenant, api_key=api_key, estimated_tokens=RESERVED)
    [reservation] = ticket.reservations
    is_down = _store_down(monkeypatch, reservation)
    _settle_with_a_record(ticket, api_key, "r-settled-while-down", 700)
    assert _records_sum(tenant) == 1200
    is_down.clear()
    if recount == "rebuild":
        quotas.month_counters_rebuild(tenant=tenant)
    else:
        name = quotas.month_counter_name("tenant", tenant.pk, quotas._month_start(time.time()))
        cache.delete(name)
        quotas.admission_release(
            ticket=quotas.admission_acquire(tenant=tenant, estimated_tokens=1), actual_tokens=0
        )

    slots.renewer.renew()  # the settle tried again

    assert _month(tenant) == _records_sum(tenant) == 1200
    slots.renewer.renew()
    assert _month(tenant) == 1200


@pytest.mark.django_db(transaction=True)  # the settlement writes on a thread of its own
def test_a_generation_that_cannot_be_read_loses_no_record(store, monkeypatch):  # noqa: F811
    """The generation is read inside the settlement's transaction, the store being down: a
    failed read must not spoil the transaction that writes the request's record."""
    from django.db import connection

    from tenants import month_locks

    tenant = _tenant(monthly_token_budget=100_000)
    api_key, _ = services.api_key_create(tenant=tenant, name="k")
    ticket = quotas.admission_acquire(tenant=tenant, api_key=api_key, estimated_tokens=RESERVED)

    class Unreadable:  # the generation's query fails in the database itself
        def filter(self, **kwargs):
            return self

        def values_list(self, *names):
            return self

        def __iter__(self):
            with connection.cursor() as cursor:
                cursor.execute("SELECT value FROM no_such_table")
            return iter(())

    _store_down(monkeypatch, ticket.reservations[0])
    monkeypatch.setattr(month_locks.MonthCounterGeneration, "objects", Unreadable())
    _settle_with_a_record(ticket, api_key, "r-kept", 70)
    monkeypatch.undo()

    assert UsageRecord.objects.filter(request_id="r-kept").exists()
