"""Admission plus metering around one request, shared by the API and the chat.

``metered()`` admits the request (or raises ``QuotaExceeded`` having recorded nothing),
yields a ``Meter`` for the caller to fill with the engine's real counts, and on the way out,
whatever happens (success, engine failure, client disconnect, cancellation), releases the
admission with the real token count and writes exactly one ``UsageRecord``.

A request cancelled while its admission is still on the worker thread (its client left) may
yet be admitted there: that admission is then settled as soon as the thread is done, as a
cancelled request with no tokens, so it holds no concurrency slot or reservation.
"""

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from config.workers import database_worker
from serving.settlement import Settlement, settle
from tenants import quotas
from tenants.models import ApiKey, Tenant, UsageRecord

logger = logging.getLogger(__name__)


@dataclass
class Meter:
    request_id: str
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    finished_at: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: str = UsageRecord.Status.OK
    error_code: str = ""
    windows: dict[str, quotas.Window] = field(default_factory=dict)  # where the limits stand
    # the admission this meter counts, for ``free_admission`` (set by ``metered``)
    ticket: quotas.AdmissionTicket | None = field(default=None, repr=False)

    async def free_admission(self) -> None:
        """Free the run's concurrency slots and correct its per-minute counters now, with the
        tokens counted so far: for a stream whose last tokens are in, before its client reads
        the end (and sends its next request; the settlement, which frees them otherwise,
        runs as the stream's last event goes out, and lost that race under load). The
        settlement does the rest; this happens once, whoever asks first."""
        if self.ticket is not None and not self.ticket.is_freed:
            await _admission_free(self.ticket, self.total_tokens)

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.time()

    def fail(self, error_code: str, status: str = UsageRecord.Status.ERROR) -> None:
        self.status = status
        self.error_code = error_code

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@asynccontextmanager
async def metered(
    *,
    request_id: str,
    tenant: Tenant,
    model: str,
    source: str,
    estimated_tokens: int,
    likely_tokens: int | None = None,
    num_sequences: int = 1,
    api_key: ApiKey | None = None,
    user: AbstractBaseUser | None = None,
    on_finish: Callable[[Meter], None] | None = None,
    precondition: Callable[[], None] | None = None,
    counts_per_minute: bool = True,
    labels: dict[str, Any] | None = None,
) -> AsyncIterator[Meter]:
    """See the module docstring; ``on_finish`` sees the final meter (metrics, logs).
    ``precondition`` runs on the worker thread just before admission; what it raises
    propagates with nothing admitted or recorded (the API checks its cached authorization
    there, saving a thread trip of its own). ``estimated_tokens`` is the most the request may
    use, ``likely_tokens`` what it probably will, ``num_sequences`` how many engine sequences
    it runs, and whether it ``counts_per_minute`` (see ``quotas.admission_acquire``).
    ``labels`` are the caller's own fields for the usage record (``end_user``, ``metadata``)."""
    started_at = time.time()
    admission = asyncio.ensure_future(
        _admit(
            precondition,
            tenant,
            api_key,
            estimated_tokens,
            likely_tokens,
            num_sequences,
            counts_per_minute,
            started_at,
        )
    )
    try:
        ticket = await asyncio.shield(admission)
    except asyncio.CancelledError:
        # the thread may still admit it: settle that admission once the thread is done
        settle_orphan = functools.partial(
            _settle_orphan,
            request_id=request_id,
            started_at=started_at,
            tenant=tenant,
            api_key=api_key,
            user=user,
            model=model,
            source=source,
            labels=labels,
        )
        admission.add_done_callback(settle_orphan)
        raise
    meter = Meter(
        request_id=request_id, started_at=started_at, windows=ticket.windows, ticket=ticket
    )
    try:
        yield meter
    except asyncio.CancelledError:
        if meter.status == UsageRecord.Status.OK:
            meter.fail("cancelled", UsageRecord.Status.CANCELLED)
        raise
    except BaseException:
        if meter.status == UsageRecord.Status.OK:
            meter.fail("internal_error")
        raise
    finally:
        meter.finished_at = time.time()
        # Shielded: a second cancellation must not lose the record or leak the slot.
        await asyncio.shield(
            settle(_settlement(meter, ticket, tenant, api_key, user, model, source, labels))
        )
        if on_finish is not None:
            on_finish(meter)


async def _admission_free(ticket: quotas.AdmissionTicket, actual_tokens: int) -> None:
    # the cache only, no database: a thread of the loop's executor without the database
    # worker's connection checks before and after (a round trip each, on the stream's end)
    free = functools.partial(quotas.admission_free, ticket=ticket, actual_tokens=actual_tokens)
    await asyncio.get_running_loop().run_in_executor(None, free)


def _settle_orphan(
    admission: asyncio.Future,
    *,
    request_id: str,
    started_at: float,
    tenant: Tenant,
    api_key: ApiKey | None,
    user: AbstractBaseUser | None,
    model: str,
    source: str,
    labels: dict[str, Any] | None,
) -> None:
    """The admission of a request cancelled while it ran, once it is done: settle it (if it
    admitted anything) as a cancelled request with no tokens."""
    if admission.cancelled() or admission.exception() is not None:
        return  # refused, or failed: nothing was admitted
    meter = Meter(request_id=request_id, started_at=started_at, finished_at=time.time())
    meter.fail("cancelled", UsageRecord.Status.CANCELLED)
    settlement = _settlement(
        meter, admission.result(), tenant, api_key, user, model, source, labels
    )
    task = asyncio.ensure_future(settle(settlement))
    _orphans.add(task)  # held until it is done: the loop keeps only a weak reference
    task.add_done_callback(_orphan_settled)


_orphans: set[asyncio.Future] = set()


def _orphan_settled(task: asyncio.Future) -> None:
    _orphans.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("could not settle a cancelled request's admission", exc_info=task.exception())


@database_worker
def _admit(
    precondition: Callable[[], None] | None,
    tenant: Tenant,
    api_key: ApiKey | None,
    estimated_tokens: int,
    likely_tokens: int | None,
    num_sequences: int,
    counts_per_minute: bool,
    started_at: float,
) -> quotas.AdmissionTicket:
    if precondition is not None:
        precondition()
    return quotas.admission_acquire(
        tenant=tenant,
        api_key=api_key,
        estimated_tokens=estimated_tokens,
        likely_tokens=likely_tokens,
        num_sequences=num_sequences,
        counts_per_minute=counts_per_minute,
        month_of=started_at,  # the record is filed by when the request started
    )


def _settlement(
    meter: Meter,
    ticket: quotas.AdmissionTicket,
    tenant: Tenant,
    api_key: ApiKey | None,
    user: AbstractBaseUser | None,
    model: str,
    source: str,
    labels: dict[str, Any] | None = None,
) -> Settlement:
    ttft = meter.first_token_at
    return Settlement(
        ticket=ticket,
        actual_tokens=meter.total_tokens,
        record={
            "request_id": meter.request_id,
            "tenant": tenant,
            "api_key": api_key,
            "user": user,
            "model": model,
            "source": source,
            "status": meter.status,
            "error_code": meter.error_code,
            "prompt_tokens": meter.prompt_tokens,
            "completion_tokens": meter.completion_tokens,
            "cached_tokens": meter.cached_tokens,
            "time_to_first_token_ms": (ttft - meter.started_at) * 1000 if ttft else None,
            "latency_ms": (meter.finished_at - meter.started_at) * 1000,
            "started_at": datetime.fromtimestamp(meter.started_at, UTC),
            "finished_at": datetime.fromtimestamp(meter.finished_at, UTC),
            **(labels or {}),
        },
    )
