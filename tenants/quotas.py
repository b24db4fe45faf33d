"""Admission: requests per minute, tokens per minute, concurrent requests and the monthly
token budget, per tenant and per API key.

Counters live in Django's cache (Redis in production, so every web process shares them;
local memory in the embedded mode). Every check is increment-then-compare on an atomic
counter, so no burst over-admits however many processes race: of N racing requests against
a limit L, the ones that drew the values 1..L get in. An attempt that fails, refused or by
any error (the cache or the database failing midway), undoes everything it added first.

Concurrent requests are leased slots (``tenants.slots``), renewed while the request runs, so
the slot of a process killed mid-request frees itself within one lease.

Per-minute limits use a sliding-window counter (the previous minute's count weighted by how
much of it still overlaps the last 60 seconds, plus the current minute's), which avoids the
double burst a fixed window allows at its edge.

A request holds one concurrency lease per engine sequence it fans out to (prompts × n).

Tokens per minute and the month are *reserved* on admission (prompt estimate plus
``max_tokens``) and reconciled with the engine's real counts by ``admission_release``.
The month counter is seeded from the usage records when the cache has none, so a cache
restart does not reset anybody's budget (``tenants.month_locks`` keeps the requests settling
meanwhile from being counted twice or not at all). A month reservation is a lease
(``tenants.reservations``), renewed with the slots: one held by a process that died comes off
the counter when its lease runs out, so the counter returns to the sum of the records. (A
minute's counter needs none: it is gone in two minutes.)

Public API: ``admission_acquire`` -> ``AdmissionTicket`` or ``QuotaExceeded``, each with the
``windows`` where the per-minute limits stand (the API reports them as ``x-ratelimit-*``
headers); ``admission_release`` (idempotent, call it in ``finally``; or its two halves,
``admission_free`` as soon as the answer is out and ``admission_settle_month`` with the
record); ``quota_usage`` for dashboards.
"""

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.core.cache import cache

from tenants import month_locks
from tenants.models import ApiKey, Tenant
from tenants.reservations import (
    Reservation,
    counter_held,
    counter_rebuild,
    counter_seed,
    counter_value,
    reservation_add,
    reservation_settle,
)
from tenants.selectors import Limits, api_key_limits, month_tokens_used, tenant_limits
from tenants.slots import Slot, slot_acquire, slot_count, slot_release
from tenants.window_counters import counter_add, counter_adjust

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 60
MONTH_TTL_SECONDS = 40 * 24 * 3600


def _now() -> float:
    return time.time()


HOPELESS_KINDS = frozenset(
    {"request_too_large", "budget_too_small", "too_many_sequences", "no_requests"}
)
# a monthly refusal while requests in flight hold what would admit this one: their
# reservations come off as they settle, so the wait is theirs, not the month's
MONTH_HELD_RETRY_SECONDS = 10


@dataclass(frozen=True)
class Window:
    """Where one per-minute limit ("requests" or "tokens") stands after an admission: the
    tighter of the tenant's and the key's."""

    limit: int
    remaining: int
    # until the current minute's window ends; on a refusal for this limit, until a request
    # like the one refused would fit (its Retry-After)
    reset_seconds: float


def format_wait(seconds: float) -> str:
    """A wait as OpenAI writes one (850ms, 12s, 1m30s), and past an hour 1h1m, past a day
    4d12h (a monthly refusal's)."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    seconds = math.ceil(seconds)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


class QuotaExceeded(Exception):
    """A refusal: which limit, whose, and when to retry. Maps to HTTP 429, except a request
    that no wait would admit (``is_hopeless``: larger than a limit by itself), a 400."""

    def __init__(
        self, *, kind: str, scope: str, limit: int, retry_after: int, windows: dict[str, Window]
    ) -> None:
        self.kind = kind
        self.scope = scope
        self.limit = limit
        self.retry_after = retry_after
        self.windows = windows
        super().__init__(self._describe())

    def _describe(self) -> str:
        owner = "your organization" if self.scope == "tenant" else "this API key"
        what = {
            "requests": f"requests per minute (limit {self.limit})",
            "tokens": f"tokens per minute (limit {self.limit})",
            "concurrency": f"concurrent requests (limit {self.limit})",
            "monthly_tokens": f"the monthly token budget ({self.limit} tokens)",
            "request_too_large": f"tokens per minute: this request alone needs more than the "
            f"limit of {self.limit}",
            "budget_too_small": f"the monthly token budget: this request alone needs more than "
            f"the budget of {self.limit}",
            "too_many_sequences": f"concurrent requests: this request alone runs more "
            f"sequences (prompts × n) than the limit of {self.limit}",
            "no_requests": "requests per minute: the limit is 0, so no request is admitted",
        }[self.kind]
        if self.is_hopeless:
            return f"Rate limit reached for {owner} on {what}."
        wait = format_wait(self.retry_after)
        return f"Rate limit reached for {owner} on {what}. Please try again in {wait}."

    @property
    def is_hopeless(self) -> bool:
        return self.kind in HOPELESS_KINDS


@dataclass
class _Scope:
    name: str  # "tenant" or "key"
    ident: str
    limits: Limits

    def key(self, *parts: object) -> str:
        return ":".join(["quota", self.name, self.ident, *map(str, parts)])


@dataclass
class AdmissionTicket:
    """What an admitted request holds until ``admission_release``."""

    tenant_id: int
    api_key_id: int | None
    reserved_tokens: int
    windows: dict[str, Window]  # "requests", "tokens": where the per-minute limits stand
    # Cache keys of the per-minute counters that hold the token reservation.
    token_counters: list[str] = field(default_factory=list)
    # the month's leased reservations, the tenant's and the key's
    reservations: list[Reservation] = field(default_factory=list)
    # what a counter holds when it is not ``reserved_tokens`` (a per-minute limit's share)
    counter_reservations: dict[str, int] = field(default_factory=dict)
    slots: list[Slot] = field(default_factory=list)
    is_freed: bool = False  # the slots and the per-minute counters (``admission_free``)
    is_month_settled: bool = False  # the month's reservations (``admission_settle_month``)

    @property
    def is_released(self) -> bool:
        return self.is_freed and self.is_month_settled

    @property
    def concurrency_counters(self) -> list[str]:
        """The keys of the scopes whose concurrency slots this request holds."""
        return [slot.key for slot in self.slots]


def _scopes(tenant: Tenant, api_key: ApiKey | None) -> list[_Scope]:
    scopes = [_Scope("tenant", str(tenant.pk), tenant_limits(tenant=tenant))]
    if api_key is not None:
        scopes.append(_Scope("key", str(api_key.pk), api_key_limits(api_key=api_key)))
    return scopes


def _undo(step: Callable[..., None], *args: object) -> None:
    try:
        step(*args)
    except Exception:
        logger.exception("could not roll back part of a failed admission")


class _Admission:
    """One attempt to admit; remembers what it added so a failed attempt can undo it."""

    def __init__(self, now: float, month_of: float | None = None) -> None:
        self.now = now
        # the month charged: the request's start's, which its record is filed by
        self.month_start = _month_start(now if month_of is None else min(month_of, now))
        self.window = int(now // WINDOW_SECONDS)
        self.elapsed = now - self.window * WINDOW_SECONDS
        self.previous_weight = 1 - self.elapsed / WINDOW_SECONDS
        self.added: list[tuple[str, int]] = []
        self.reservations: list[Reservation] = []
        self.slots: list[Slot] = []
        self.windows: dict[str, Window] = {}
        # the same, as they stand without this request: what a refusal reports, since it
        # takes back everything the attempt counted
        self.windows_without: dict[str, Window] = {}

    def rollback(self) -> None:
        """Undo what the attempt added, as far as the cache lets us: one undo failing does
        not keep the others from happening (a slot left behind expires with its lease)."""
        for slot in reversed(self.slots):
            _undo(slot_release, slot)
        for reservation in reversed(self.reservations):
            _undo(_cancel_reservation, reservation)
        for key, amount in reversed(self.added):
            _undo(counter_adjust, key, -amount)

    def per_minute(
        self, scope: _Scope, kind: str, limit: int | None, amount: int, likely: int | None = None
    ) -> tuple[str, int] | None:
        """Count ``amount`` against a per-minute limit; the counter's key and what it holds.
        A request likely to need more than the limit is refused for good. One that may
        (``amount``) need more than is left of the limit, but likely won't, is admitted while
        what it likely needs is left, and holds what is left until it settles: so a request
        that may run to a context longer than the limit (a chat without max_tokens) is not
        refused after every other request of the minute, and its use past the limit is owed
        by the next ones."""
        if limit is None:
            return None
        needed = amount if likely is None else likely
        if needed > limit:
            hopeless = "no_requests" if kind == "requests" else "request_too_large"
            raise self._refuse(hopeless, scope, limit, WINDOW_SECONDS)
        key, previous_key = scope.key(kind, self.window), scope.key(kind, self.window - 1)
        if amount > needed:
            # what is left (read, not held: a request racing in makes one of the two refused),
            # in the one round trip that reads the previous minute
            counts = cache.get_many([previous_key, key])
            previous = counts.get(previous_key, 0)
            used_before = previous * self.previous_weight + counts.get(key, 0)
            amount = min(amount, max(math.floor(limit - used_before), needed))
        else:
            previous = cache.get(previous_key, 0)
        current = counter_add(key, amount, ttl=2 * WINDOW_SECONDS + 5)
        self.added.append((key, amount))
        used = previous * self.previous_weight + current
        until_next_window = WINDOW_SECONDS - self.elapsed
        if used > limit:
            # when what it needs fits (a request that may need more holds what is left then)
            retry = self._seconds_until_fits(previous, current - amount, needed, limit)
            raise self._refuse(kind, scope, limit, max(1, math.ceil(retry)))
        self._record_window(kind, limit, limit - used, limit - used + amount, until_next_window)
        return key, amount

    def _seconds_until_fits(self, previous: int, current: int, amount: int, limit: int) -> float:
        """How long until ``amount`` more fits under ``limit`` if nothing else comes, with the
        previous minute's count at ``previous`` and this minute's at ``current``: the previous
        minute's share decays to nothing over this minute, then this minute's over the next
        (a client that waits the time a window's end is refused again: this minute's count
        still weighs in full there)."""
        until_next_window = WINDOW_SECONDS - self.elapsed
        excess = previous * self.previous_weight + current + amount - limit
        if previous and excess <= previous * self.previous_weight:
            return excess / (previous / WINDOW_SECONDS)
        excess_next = current + amount - limit
        if excess_next <= 0 or not current:
            return until_next_window
        return until_next_window + min(WINDOW_SECONDS, excess_next / (current / WINDOW_SECONDS))

    def concurrency(self, scope: _Scope, limit: int | None, num_sequences: int) -> None:
        """Hold one lease per engine sequence against the concurrency limit."""
        if limit is None:
            return
        if num_sequences > limit:
            raise self._refuse("too_many_sequences", scope, limit, 1)
        slot = slot_acquire(name=scope.key("slots"), limit=limit, size=num_sequences)
        if slot is None:
            raise self._refuse("concurrency", scope, limit, 1)
        self.slots.append(slot)

    def month(
        self,
        scope: _Scope,
        tenant: Tenant,
        api_key: ApiKey | None,
        amount: int,
        likely: int | None = None,
    ) -> Reservation | None:
        """Reserve ``amount`` against the monthly budget, as ``per_minute`` does a minute's:
        a request that may need more than is left (a chat without max_tokens may run to the
        context) but likely won't is admitted while what it likely needs is left, and holds
        what is left until it settles."""
        budget = scope.limits.monthly_token_budget
        if budget is None:
            return None
        needed = amount if likely is None else likely
        if needed > budget:
            raise self._refuse("budget_too_small", scope, budget, _seconds_to_next_month(self.now))
        month_start = self.month_start
        key = month_counter_name(scope.name, scope.ident, month_start)
        used_before = counter_value(name=key)
        if used_before is None:
            with month_locks.counter_rebuilding(tenant.pk) as generation:
                used_before = month_tokens_used(
                    tenant=tenant,
                    api_key=api_key if scope.name == "key" else None,
                    since=month_start,
                    until=_month_after(month_start),  # a month just ended: its records only
                )
                counter_seed(
                    name=key, value=used_before, ttl=MONTH_TTL_SECONDS, generation=generation
                )
        if amount > needed:
            # read, not held: a request racing in makes one of the two refused
            amount = min(amount, max(budget - used_before, needed))
        reservation, current = reservation_add(name=key, tokens=amount, ttl=MONTH_TTL_SECONDS)
        self.reservations.append(reservation)
        if current > budget:
            settled = current - counter_held(name=key)
            if self.month_start < _month_start(self.now):
                retry = 1  # the month charged (its start's) has ended: a retry is the new one's
            elif settled + needed <= budget:
                retry = MONTH_HELD_RETRY_SECONDS
            else:
                retry = _seconds_to_next_month(self.now)
            raise self._refuse("monthly_tokens", scope, budget, retry)
        return reservation

    def _record_window(
        self, kind: str, limit: int, remaining: float, remaining_without: float, reset: float
    ) -> None:
        """Keep the tighter of the tenant's and the key's limits, as they stand with this
        request and without it."""
        for windows, left in ((self.windows, remaining), (self.windows_without, remaining_without)):
            left = min(limit, max(0, int(left)))
            previous = windows.get(kind)
            if previous is None or left < previous.remaining:
                windows[kind] = Window(limit=limit, remaining=left, reset_seconds=reset)

    def _refuse(self, kind: str, scope: _Scope, limit: int, retry_after: int) -> QuotaExceeded:
        windows = dict(self.windows_without)
        if kind in ("requests", "tokens"):
            windows[kind] = Window(limit=limit, remaining=0, reset_seconds=retry_after)
        return QuotaExceeded(
            kind=kind,
            scope=scope.name,
            limit=limit,
            retry_after=retry_after,
            windows=windows,
        )


def month_counter_name(scope_name: str, ident: object, month_start: datetime) -> str:
    """The cache key of a scope's ("tenant" or "key") token counter for a month."""
    return _Scope(scope_name, str(ident), Limits()).key("month", month_start.strftime("%Y%m"))


def month_counters_rebuild(*, tenant: Tenant, api_key: ApiKey | None = None) -> None:
    """Set this month's token counter of the tenant (or of its key) to what the usage records
    hold plus what requests in flight have reserved, where one exists. For a change of
    budget: a scope without a budget keeps no counter up to date, so one left from before its
    budget was taken off missed what was used meanwhile, and a budget set again admitted the
    tenant past it. Under the month lock (``tenants.month_locks``), as a rebuild by admission:
    each settlement is counted once, by its record or by its reservation. (A request admitted
    while the scope had no budget holds no reservation: one still running as the budget is
    set is counted by its record at the next rebuild, not now.)"""
    month_start = _month_start(_now())
    scope = "tenant" if api_key is None else "key"
    name = month_counter_name(scope, tenant.pk if api_key is None else api_key.pk, month_start)
    if counter_value(name=name) is None:
        return  # none to correct: the next admission under the budget seeds it
    with month_locks.counter_rebuilding(tenant.pk) as generation:
        used = month_tokens_used(tenant=tenant, api_key=api_key, since=month_start)
        counter_rebuild(name=name, settled=used, generation=generation)


def _month_start(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )


def _month_after(month_start: datetime) -> datetime:
    year, month = divmod(month_start.year * 12 + month_start.month, 12)  # the next, 0-based
    return datetime(year, month + 1, 1, tzinfo=UTC)


def _seconds_to_next_month(now: float) -> int:
    return max(1, math.ceil(_month_after(_month_start(now)).timestamp() - now))


def admission_acquire(
    *,
    tenant: Tenant,
    api_key: ApiKey | None = None,
    estimated_tokens: int,
    likely_tokens: int | None = None,
    num_sequences: int = 1,
    counts_per_minute: bool = True,
    month_of: float | None = None,
) -> AdmissionTicket:
    """Admit one request that may use up to ``estimated_tokens`` (prompt plus max tokens),
    or raise ``QuotaExceeded`` having changed nothing. Any other error also propagates having
    changed nothing (as far as the failing cache allows). ``likely_tokens`` (default: the
    same) is what it will probably use: a request is refused for good (``is_hopeless``) only
    when that alone is past a limit; the budgets hold ``estimated_tokens`` (a per-minute limit
    at most what is left of it, see ``per_minute``) until the request settles with its real
    count. A request fanned
    out to ``num_sequences`` engine sequences (prompts × n) counts that many against the
    concurrency limits. A request that does not ``counts_per_minute`` (a batch line: OpenAI keeps
    batches in a pool of their own) skips the per-minute limits; the monthly budget and the
    concurrency limits hold for it all the same. ``month_of`` (a timestamp: when the request
    started, which its usage record is filed by) names the month it is charged to; now if
    omitted."""
    if estimated_tokens < 0 or num_sequences < 1:
        raise ValueError("estimated_tokens must be >= 0 and num_sequences >= 1")
    attempt = _Admission(_now(), month_of=month_of)
    ticket = AdmissionTicket(
        tenant_id=tenant.pk,
        api_key_id=api_key.pk if api_key else None,
        reserved_tokens=estimated_tokens,
        windows=attempt.windows,
        slots=attempt.slots,
    )
    try:
        for scope in _scopes(tenant, api_key):
            limits = scope.limits
            attempt.month(scope, tenant, api_key, estimated_tokens, likely_tokens)
            tokens = None
            if counts_per_minute:
                attempt.per_minute(scope, "requests", limits.requests_per_minute, 1)
                tokens = attempt.per_minute(
                    scope, "tokens", limits.tokens_per_minute, estimated_tokens, likely_tokens
                )
            if tokens is not None and tokens[1] != estimated_tokens:
                ticket.counter_reservations[tokens[0]] = tokens[1]
            attempt.concurrency(scope, limits.max_concurrent_requests, num_sequences)
            if tokens is not None:
                ticket.token_counters.append(tokens[0])
    except BaseException:
        attempt.rollback()
        raise
    ticket.reservations = attempt.reservations
    return ticket


def _cancel_reservation(reservation: Reservation) -> None:
    reservation_settle(reservation, actual_tokens=0)


def admission_release(*, ticket: AdmissionTicket, actual_tokens: int) -> None:
    """``admission_free`` and ``admission_settle_month``: free the request's concurrency
    slots and replace its token reservations with what it really used. Safe to call more
    than once; only the first call of each counts. Every step is tried; the first error is
    raised after the rest."""
    _all_tried(
        lambda: admission_free(ticket=ticket, actual_tokens=actual_tokens),
        lambda: admission_settle_month(ticket=ticket, actual_tokens=actual_tokens),
    )


def admission_free(*, ticket: AdmissionTicket, actual_tokens: int) -> None:
    """Free the concurrency slots and correct the per-minute token counters, as soon as the
    answer is out (a client may send its next request the moment it has read the end). Only
    the first call counts; a slot not given back stops being renewed and expires within its
    lease, a per-minute counter within two minutes."""
    if ticket.is_freed:
        return
    ticket.is_freed = True
    corrections = [
        (key, actual_tokens - ticket.counter_reservations.get(key, ticket.reserved_tokens))
        for key in ticket.token_counters
    ]
    _all_tried(
        *(lambda slot=slot: slot_release(slot) for slot in ticket.slots),
        *(
            lambda key=key, correction=correction: counter_adjust(key, correction)
            for key, correction in corrections
            if correction
        ),
    )


def admission_settle_month(*, ticket: AdmissionTicket, actual_tokens: int) -> None:
    """Replace the month's reservations with what the request used. The settlement calls it
    in the transaction that writes the request's record (``tenants.month_locks``). Only the
    first call counts; a reservation the cache does not take is settled again later
    (``tenants.reservations``)."""
    if ticket.is_month_settled:
        return
    ticket.is_month_settled = True
    generation = functools.partial(month_locks.generation_of, ticket.tenant_id)
    _all_tried(
        *(
            lambda reservation=reservation: reservation_settle(
                reservation, actual_tokens=actual_tokens, generation=generation
            )
            for reservation in ticket.reservations
        )
    )


def _all_tried(*steps: Callable[[], None]) -> None:
    """Run every step; raise the first error after the rest."""
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class QuotaUsage:
    """Live counters against limits, for dashboards; None where there is no limit."""

    requests_this_minute: float
    tokens_this_minute: float
    concurrent_requests: int
    month_tokens: int
    limits: Limits


def quota_usage(*, tenant: Tenant, api_key: ApiKey | None = None) -> QuotaUsage:
    scope = _scopes(tenant, api_key)[-1]
    attempt = _Admission(_now())

    def sliding(kind: str) -> float:
        previous = cache.get(scope.key(kind, attempt.window - 1), 0)
        return previous * attempt.previous_weight + cache.get(scope.key(kind, attempt.window), 0)

    month_start = _month_start(attempt.now)
    month_tokens = None
    if scope.limits.monthly_token_budget is not None:
        month_tokens = counter_value(name=month_counter_name(scope.name, scope.ident, month_start))
    if month_tokens is None:
        # no budget keeps no counter, and a cache restart or a new month drops it: the records
        month_tokens = month_tokens_used(
            tenant=tenant, api_key=api_key if scope.name == "key" else None, since=month_start
        )
    return QuotaUsage(
        requests_this_minute=sliding("requests"),
        tokens_this_minute=sliding("tokens"),
        concurrent_requests=slot_count(name=scope.key("slots")),
        month_tokens=month_tokens,
        limits=scope.limits,
    )
