"""A tenant's month counters and its usage records, kept in step while a counter is rebuilt.

A month counter the cache lost (a Redis restart, an eviction) is rebuilt from the usage
records by the next admission (``tenants.quotas``). A request that was running meanwhile
settles twice over: it writes its record, and it corrects the counter (which, rebuilt, no
longer holds its reservation: the correction adds all of its tokens). The rebuild must see
exactly one of the two. Without a lock it could see neither (it read the records before the
request's record was committed, and the request corrected the counter before it was back)
or both (it read the record, and the correction then added the tokens again).

So a settlement writes its records and corrects the counters in one transaction holding each
of its tenants *shared*, and a rebuild reads the records and creates the counter holding the
tenant *exclusively*: a settlement is either wholly before a rebuild (its record is read; its
correction met no counter) or wholly after it (its record is not read; its correction adds to
the rebuilt counter). On PostgreSQL these are transaction-level advisory locks (settlements do
not wait on one another); SQLite runs one writing transaction at a time already (the project's
``transaction_mode`` is ``IMMEDIATE``: a transaction takes the write lock as it begins).

A settle the cache did not take is tried again later, outside any transaction (the cache was
down): after a rebuild that read its record, it must add nothing. So each rebuild counts one
more *generation* of the tenant's counters (``MonthCounterGeneration``), and the counters it
makes keep it; a settlement whose settle fails reads the tenant's generation in its
transaction, and the settle tried again adds nothing to a counter of a later one.

Public API: ``records_settling(tenant_ids)`` and ``counter_rebuilding(tenant_id)`` (which
gives the rebuild's generation), context managers that each open a transaction;
``generation_of(tenant_id)``.
"""

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from django.db import connection, transaction
from django.db.models import F

from tenants.models import MonthCounterGeneration


def _lock_key(tenant_id: int) -> int:
    digest = hashlib.sha256(f"usage-month:{tenant_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _lock(tenant_ids: Iterable[int], *, shared: bool) -> None:
    if connection.vendor != "postgresql":
        return
    keys = sorted({_lock_key(tenant_id) for tenant_id in tenant_ids})
    if not keys:
        return
    function = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {function}(key) FROM unnest(%s::bigint[]) AS key", [keys])


@contextmanager
def records_settling(tenant_ids: Iterable[int]) -> Iterator[None]:
    """A transaction in which records of these tenants are written and their counters
    corrected: no counter of theirs is rebuilt meanwhile."""
    with transaction.atomic():
        _lock(tenant_ids, shared=True)
        yield


@contextmanager
def counter_rebuilding(tenant_id: int) -> Iterator[int]:
    """A transaction in which a counter of the tenant is rebuilt from its records: no
    settlement of the tenant's runs meanwhile. Gives the rebuild's generation, for the
    counter to keep."""
    with transaction.atomic():
        _lock([tenant_id], shared=False)
        MonthCounterGeneration.objects.get_or_create(tenant_id=tenant_id)
        MonthCounterGeneration.objects.filter(tenant_id=tenant_id).update(value=F("value") + 1)
        yield generation_of(tenant_id)


def generation_of(tenant_id: int) -> int:
    """The generation of the tenant's last rebuild (0: none yet). Within ``records_settling``,
    the last before the settlement: a rebuild after it has a higher one. Read in a savepoint:
    a failure to read it leaves the transaction around it (a settlement's records) whole."""
    with transaction.atomic():
        values = MonthCounterGeneration.objects.filter(tenant_id=tenant_id).values_list("value")
        return next(iter(values), (0,))[0]
