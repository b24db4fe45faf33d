"""The end of a metered request, settled in groups: requests that end together release their
admissions and write their usage records in one trip to a worker thread and one transaction.

Settling each request on its own costs a worker-thread trip and a transaction of its own.
When a batch of streams ends in the same moment (64 finish on the same engine step), those
transactions queue on the database's write lock (SQLite's busy handler then sleeps for whole
milliseconds) and the last stream's end waits behind all of them. Here the first request to
end starts a settling task at once; whatever ends while that trip is under way goes in the
next one. So a lone request waits no longer than before, and a burst of N costs a few
transactions instead of N.

A request still waits until its own record is committed: ``settle`` returns only then, and
raises what went wrong for that request alone (one invalid record does not lose the others
of its group).
"""

import asyncio
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError, connection, transaction

from config.workers import database_worker
from serving import usage_spool
from tenants import month_locks, quotas, services
from tenants.models import UsageRecord

logger = logging.getLogger(__name__)

MAX_GROUP = 256
# a group whose connection the database dropped is tried again on a new one this many times
CONNECTION_RETRIES = 1


@dataclass
class Settlement:
    """One request's end: its admission to release and the usage record to write."""

    ticket: quotas.AdmissionTicket
    actual_tokens: int
    record: dict[str, Any]  # usage_record_build's arguments


async def settle(settlement: Settlement) -> None:
    """Release the admission and write the record, grouped with others that end meanwhile."""
    loop = asyncio.get_running_loop()
    settler = _settlers.get(loop)
    if settler is None:
        settler = _settlers[loop] = _Settler()
    await settler.submit(settlement)


class _Settler:
    """Per event loop: a queue of settlements and at most one task draining it. (It holds no
    reference to its loop, which keys it weakly.)"""

    def __init__(self) -> None:
        self._queue: list[tuple[Settlement, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def submit(self, settlement: Settlement) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((settlement, future))
        if self._task is None:
            self._task = loop.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                group, self._queue = self._queue[:MAX_GROUP], self._queue[MAX_GROUP:]
                try:
                    outcomes = await _settle_group([settlement for settlement, _ in group])
                except Exception as exc:  # the trip itself failed (say, no database)
                    outcomes = [exc] * len(group)
                except BaseException:  # cancelled, at shutdown: nobody settles the rest
                    for _, future in group + self._queue:
                        future.cancel()
                    self._queue = []
                    raise
                for (_, future), outcome in zip(group, outcomes, strict=True):
                    if future.done():
                        continue
                    if outcome is None:
                        future.set_result(None)
                    else:
                        future.set_exception(outcome)
        finally:
            self._task = None


_settlers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Settler]" = (
    weakref.WeakKeyDictionary()
)


def _recorded_already(group: list[Settlement]) -> set[str]:
    """The request ids of the group's batch lines that have their record already: a runner
    that died after writing it, before the line's result, left the line to be run again under
    the same id. (Every other request has an id of its own: nothing to look up for it.)"""
    ids = [
        settlement.record.get("request_id")
        for settlement in group
        if settlement.record.get("source") == UsageRecord.Source.BATCH
    ]
    if not ids:
        return set()
    try:
        return set(
            UsageRecord.objects.filter(request_id__in=ids).values_list("request_id", flat=True)
        )
    except Exception:  # the save will tell: nothing counts twice for want of this look-up
        logger.exception("looking up the usage records of %d batch lines failed", len(ids))
        return set()


@database_worker
def _settle_group(group: list[Settlement]) -> list[BaseException | None]:
    """Settle each; return what failed for each one (None where all went well).

    The slots and the per-minute counters are freed first, at once: a client may send its
    next request the moment it has read the end of the last. Then the records are written
    and the month's reservations settled in one transaction that no rebuild of those
    tenants' month counters overlaps (``tenants.month_locks``), tried again once on a new
    connection where the database dropped the one it ran on. Where the database stays out of
    reach, the records are kept on disk for later (``_spool``); where the transaction fails
    otherwise, the month's reservations are settled all the same (to nothing: no record
    counts them)."""
    _release(group, _counted_tokens(group, set()), quotas.admission_free)
    for attempt in range(1 + CONNECTION_RETRIES):
        outcomes: list[BaseException | None] = [None] * len(group)
        try:
            with month_locks.records_settling({s.ticket.tenant_id for s in group}):
                tokens = _counted_tokens(group, _recorded_already(group))
                _write_records(group, outcomes)
                _release(group, tokens, quotas.admission_settle_month)
            return outcomes
        except (OperationalError, InterfaceError) as exc:
            if attempt < CONNECTION_RETRIES:
                logger.warning("settling %d requests: %s; trying a new connection", len(group), exc)
                connection.close()
                continue
            return _spool(group, exc)
        except Exception as exc:  # the transaction failed: none of its records stands
            _release(group, [0] * len(group), quotas.admission_settle_month)
            return [outcome or exc for outcome in outcomes]
    raise AssertionError("unreachable: the last attempt returns")


def _spool(group: list[Settlement], failure: Exception) -> list[BaseException | None]:
    """The database out of reach: keep the group's records on disk until it answers
    (``serving.usage_spool``), and settle the month's reservations with what the requests
    used, as if the records were written. Where the disk refuses them too, the requests hear
    ``failure``, and their reservations are settled to nothing."""
    outcomes: list[BaseException | None] = [None] * len(group)
    built = [record for _, record in _build_records(group, outcomes)]
    if not built:  # not one valid record: nothing to keep
        _release(group, [0] * len(group), quotas.admission_settle_month)
        return outcomes
    try:
        path = usage_spool.spool_write(built)
    except OSError:
        logger.exception("could not keep %d usage records on disk either", len(built))
        _release(group, [0] * len(group), quotas.admission_settle_month)
        return [outcome or failure for outcome in outcomes]
    logger.error(
        "database out of reach (%s): %d usage records kept in %s", failure, len(built), path
    )
    counted = _counted_tokens(group, set())
    tokens = [0 if outcome else used for outcome, used in zip(outcomes, counted, strict=True)]
    _release(group, tokens, quotas.admission_settle_month)
    return outcomes


def _counted_tokens(group: list[Settlement], recorded: set[str]) -> list[int]:
    """The tokens each settlement counts against the budgets: a request id's first record
    stands and is what the counters count, so one recorded already (``recorded``), or
    earlier in the group, counts nothing."""
    seen, tokens = set(recorded), []
    for settlement in group:
        request_id = settlement.record.get("request_id")
        tokens.append(0 if request_id in seen else settlement.actual_tokens)
        seen.add(request_id)
    return tokens


def _build_records(
    group: list[Settlement], outcomes: list[BaseException | None]
) -> list[tuple[int, UsageRecord]]:
    """Each settlement's record, built, with its index in the group; one that is invalid has
    its error in ``outcomes`` instead."""
    built: list[tuple[int, UsageRecord]] = []
    for index, settlement in enumerate(group):
        try:
            built.append((index, services.usage_record_build(**settlement.record)))
        except Exception as exc:
            outcomes[index] = exc
    return built


def _write_records(group: list[Settlement], outcomes: list[BaseException | None]) -> None:
    """Write each settlement's record (a request id's second is skipped: the first stands)."""
    built = _build_records(group, outcomes)
    try:
        with transaction.atomic():
            services.usage_records_save([record for _, record in built])
    except (OperationalError, InterfaceError):
        raise  # the connection, not a record: the whole group is tried again
    except Exception:
        for index, record in built:  # one at a time, so that one bad record loses no other
            try:
                with transaction.atomic():
                    services.usage_records_save([record])
            except (OperationalError, InterfaceError):
                raise
            except Exception as exc:
                outcomes[index] = exc


def _release(group: list[Settlement], tokens: list[int], step: Callable[..., None]) -> None:
    """``step`` (``quotas.admission_free`` or ``admission_settle_month``) for each admission,
    with what it counts; each acts once however often it is called. A cache that fails to
    take it is the log's to tell, not the request's: its slots' leases run out, and its month
    reservation is settled again until the cache answers (``tenants.reservations``)."""
    for settlement, used in zip(group, tokens, strict=True):
        try:
            step(ticket=settlement.ticket, actual_tokens=used)
        except Exception:
            logger.exception(
                "releasing the admission of %s failed", settlement.record.get("request_id")
            )
