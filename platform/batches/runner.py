"""Running a batch: its lines go through the API's own request path (``serving.runs``, parsed
by ``gateway.validation``, answered by ``gateway.responses.Responder``), so that a line's
response is what the online API returns for it, at the batch tier, metered with
``source=batch`` and counted against the monthly budget and concurrency, not the per-minute
limits.

``batch_run`` (the Celery task's body) takes a lease on the batch, validates it, runs its
pending lines with at most ``BATCH_MAX_IN_FLIGHT`` in flight, writes each line's result as it
ends, and finishes the batch (``batches.services.batch_finish``). A killed worker loses no
finished line: once its lease runs out, the sweep starts another runner, which skips what is
done and runs again what was left running, under the same request ids where the first run
was not metered or was metered whole (``batches.services.batch_request_next_id``).

A cancelled batch takes no new line; lines in flight run to their end, under the runner's
lease, which it renews until its last line ends. So do the lines a dead runner had metered
whole but not written (``batches.services.batch_request_is_owed``): the tenant has paid for
their answers, and the next runner runs them again first, cancelled or expired batch or not.
A line refused for a while (a rate limit, no ready replica) waits and tries again within the
batch's window.

Each line is authorized as the online API would authorize it then: once the key that created
the batch is revoked, expires or is deleted, or its tenant is deactivated, the lines not yet
started are answered with the API's 401 or 403 and nothing more runs. The runner reads the key
and the tenant again when the API's auth generation changes (any process's change to a key,
tenant, plan or deployment) and at least every ``GATEWAY_AUTH_CACHE_SECONDS``.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from batches import selectors, services
from batches.models import Batch, BatchRequest
from config.workers import database_worker
from gateway.auth import refusal_of
from gateway.authorization import GENERATION_KEY, model_not_found
from gateway.errors import SERVER_ERROR, ApiError, from_run_error, invalid
from gateway.handling import new_response_id
from gateway.responses import Responder
from gateway.tool_calls import check_auto_tool_choice
from gateway.validation import GenerationPlan, plan_chat, plan_completion
from serving.pool import get_pool
from serving.runs import UNREACHABLE_STORE_ERRORS, Caller, Run, RunError, count_refusal
from serving.selectors import deployment_for_tenant
from tenants.models import ApiKey, Plan, Tenant, UsageRecord
from tenants.selectors import SERVICE_TIER_PRIORITY

logger = logging.getLogger(__name__)

# a batch's endpoint -> the response kind and the parser of a line's body
ENDPOINT_PLANS: dict[str, tuple[str, Callable[[bytes], GenerationPlan]]] = {
    "/v1/chat/completions": ("chat", plan_chat),
    "/v1/completions": ("completion", plan_completion),
}
# a run's refusals that a later try may get past (within the batch's window)
RETRIED_CODES = frozenset(
    {
        "rate_limit_exceeded",
        "engine_unavailable",
        "engine_overloaded",
        "model_loading",
        "service_unavailable",
    }
)
SERVER_FAILURE = ApiError(500, SERVER_ERROR, code="server_error")
PAGE_SIZE = 500  # pending lines read at a time
# how long a line owed its answer is tried again past its batch's window (or, for a batch
# already past it, past the start of the pass that runs it), while its refusals may pass
OWED_RETRY_SECONDS = 600


def batch_run(*, batch_id: str) -> str:
    """Run the batch to its end (or until it is cancelled or expires) unless another runner
    holds it; the batch's status after, or ``"held"`` when another runner has it."""
    runner = uuid.uuid4().hex
    lease_seconds = settings.BATCH_LEASE_SECONDS
    batch = services.batch_claim(batch_id=batch_id, runner=runner, lease_seconds=lease_seconds)
    if batch is None:
        return "held"
    try:
        batch = services.batch_validate(batch=batch)
        # validating a large file can outlast the lease: another runner may have the batch now
        if (
            services.batch_lease_renew(batch=batch, runner=runner, lease_seconds=lease_seconds)
            is None
        ):
            return "held"
        services.batch_requests_resume(batch=batch)
        if batch.status in (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING):
            asyncio.run(BatchRun(batch, _credentials_of(batch), runner).run())
        return services.batch_finish(batch=batch, runner=runner).status
    finally:
        services.batch_release(batch=batch, runner=runner)


@dataclass(frozen=True)
class Credentials:
    """The batch's key (``None``: deleted) and tenant, as read under an auth generation."""

    tenant: Tenant
    api_key: ApiKey | None
    generation: str | None
    read_at: float

    def is_current(self, generation: str | None) -> bool:
        age = time.monotonic() - self.read_at
        return generation == self.generation and age < settings.GATEWAY_AUTH_CACHE_SECONDS


def _credentials_of(batch: Batch) -> Credentials:
    # the generation first: a change made while the rows are read leaves them stale
    generation = cache.get(GENERATION_KEY)
    return Credentials(
        tenant=Tenant.objects.select_related("plan").get(pk=batch.tenant_id),
        api_key=ApiKey.objects.select_related("tenant").filter(pk=batch.api_key_id).first(),
        generation=generation,
        read_at=time.monotonic(),
    )


class BatchRun:
    """One runner's pass over a batch's pending lines, on one event loop."""

    def __init__(self, batch: Batch, credentials: Credentials, runner: str) -> None:
        self.batch = batch
        self.credentials = credentials
        self.runner = runner
        self.kind, self.plan_of = ENDPOINT_PLANS[batch.endpoint]
        self.max_in_flight = settings.BATCH_MAX_IN_FLIGHT
        self.lease_seconds = settings.BATCH_LEASE_SECONDS
        self.is_stopping = False  # cancelled, or the lease lost: take no new line
        self.has_lease = True  # False: another runner has the batch, take no line at all
        self.started_at = time.time()
        self._callers: dict[str, Caller | None] = {}  # model -> its caller (None: no access)
        self._attempts: dict[int, int] = {}  # a line's tries in this pass, by its row

    async def run(self) -> None:
        heartbeat = asyncio.create_task(self._keep_lease())
        in_flight: set[asyncio.Task] = set()
        try:
            async for request, is_owed in self._pending():
                while len(in_flight) >= self.max_in_flight:
                    done, in_flight = await asyncio.wait(
                        in_flight, return_when=asyncio.FIRST_COMPLETED
                    )
                    _raise_failures(done)
                if not self.has_lease or (self.is_stopping and not is_owed):
                    break
                request_id = await _next_id(request, new_response_id(self.kind))
                if not await _claim(request, request_id):
                    if is_owed:
                        continue
                    break  # cancelled or expired meanwhile
                request.request_id = request_id
                in_flight.add(asyncio.create_task(self._run_line(request, is_owed)))
            await asyncio.gather(*in_flight)
        finally:
            heartbeat.cancel()
            for task in in_flight:
                task.cancel()
            await asyncio.gather(heartbeat, *in_flight, return_exceptions=True)
            get_pool().close()

    async def _pending(self) -> AsyncIterator[tuple[BatchRequest, bool]]:
        """The lines to run, each with whether it is owed its answer: the owed first, then
        the pending by line number."""
        for request in await _owed(self.batch):
            yield request, True
        after_line = 0
        while page := await _pending_page(self.batch, after_line):
            for request in page:
                yield request, False
            after_line = page[-1].line_number

    async def _keep_lease(self) -> None:
        """Renew the lease until the run ends, its lines in flight included (the pass cancels
        this once they have): stop taking new lines once the batch is no longer in progress
        (cancelled), and any line once the lease is lost."""
        try:
            while True:
                await asyncio.sleep(self.lease_seconds / 3)
                try:
                    status = await _renew(self.batch, self.runner, self.lease_seconds)
                except Exception:  # noqa: BLE001 - the database out of reach a moment
                    # the lease is the runner's until another takes it (a renewal then finds
                    # it lost), and none can while the database is away: try again
                    logger.warning("batch %s: could not renew its lease", self.batch.pk)
                    continue
                if status != Batch.Status.IN_PROGRESS:
                    self.is_stopping = True
                if status is None:
                    self.has_lease = False
                    return
        finally:
            self.is_stopping = True

    async def _run_line(self, request: BatchRequest, is_owed: bool) -> None:
        while True:
            try:
                response = await self._answer(request)
                break
            except RunError as exc:
                if not self._may_retry(exc, is_owed):
                    if _is_passing(exc) and not is_owed:
                        # refused for a while, with no try left in this pass (cancelled, the
                        # lease lost, the window at its end): left unrun, as a line never
                        # started, which the batch's end reports (cancelled, batch_expired),
                        # not answered with a busy moment's refusal
                        await _unclaim(request)
                        return
                    await self._count_refusal(request, exc)
                    response = _response(from_run_error(exc), request.request_id)
                    break
                await asyncio.sleep(exc.retry_after)
                if not self.has_lease or (self.is_stopping and not is_owed):
                    await _unclaim(request)
                    return
                # admitted and metered, the next try is a request of its own; but a line owed
                # its answer stays under the id it paid for (its failed try's record was
                # dropped as that id's second: nothing more was charged)
                if exc.request_id is not None and not is_owed:
                    request.request_id = new_response_id(self.kind)
                    await _rename(request, request.request_id)
            except UNREACHABLE_STORE_ERRORS:
                raise  # the pass ends (``_raise_failures``): the line is run again later
            except Exception:
                # a failure of the platform's own with this line: answered as the online API
                # answers it, a 500, not an end of the pass, which the next pass would meet
                # again (every pass then ran, and billed, the lines in flight with it anew)
                logger.exception("batch %s: line %s failed", self.batch.pk, request.custom_id)
                response = _response(SERVER_FAILURE, request.request_id)
                break
        await _finish(request, response)

    async def _answer(self, request: BatchRequest) -> dict:
        """The line's response as the online API gives it (``status_code``, ``request_id``,
        ``body``); ``RunError`` where the run was refused before it started."""
        request_id = request.request_id
        try:
            plan = self.plan_of(request.body_bytes())
            if plan.stream:  # a batch answers each line whole
                raise invalid("stream is not supported in a batch.", "stream")
            caller = await self._caller(plan.model)
            await check_auto_tool_choice(plan.tool_plan, caller.deployment.endpoints)
            attempt = self._attempts[request.pk] = self._attempts.get(request.pk, -1) + 1
            run = Run(plan.run_spec(request_id, attempt), caller)
            await run.start()
            responder = Responder(kind=self.kind, plan=plan, run=run, model=caller.deployment.name)
            try:
                body = await responder.complete()
            except BaseException as exc:
                await run.aclose(exc)
                raise
            await run.aclose()
        except ApiError as exc:
            return _response(exc, request_id)
        # the body as the API's answer: encoded as it is (a choice's logprobs come encoded)
        return {"status_code": 200, "request_id": request_id, "body": body}

    async def _caller(self, model: str) -> Caller:
        """The line's caller, as the API would authorize its key now; ``ApiError`` where the
        API would refuse it."""
        if not self.credentials.is_current(await _auth_generation()):
            self.credentials = await _acredentials_of(self.batch)
            self._callers.clear()  # a plan's models or tier may have changed too
        refusal = refusal_of(self.credentials.api_key)
        if refusal is not None:
            raise refusal
        if model not in self._callers:
            tenant, api_key = self.credentials.tenant, self.credentials.api_key
            self._callers[model] = await _caller_of(tenant, api_key, model)
        caller = self._callers[model]
        if caller is None:
            raise model_not_found(model)
        return caller

    async def _count_refusal(self, request: BatchRequest, exc: RunError) -> None:
        """Count a refusal that ends the line (its callers count none of the tries: a line
        waiting out a busy engine is refused at every one)."""
        if exc.request_id is not None:  # admitted, then failed: its usage record says so
            return
        caller = self._callers.get(self.plan_of(request.body_bytes()).model)
        if caller is not None:
            await count_refusal(caller, exc.code)

    def _may_retry(self, exc: RunError, is_owed: bool) -> bool:
        """Whether a refusal that may pass is tried again: within the batch's window, while
        it takes lines; a line owed its answer also once it takes none, and for
        ``OWED_RETRY_SECONDS`` past the window's end or this pass's start."""
        if not _is_passing(exc) or not self.has_lease:
            return False
        if self.is_stopping and not is_owed:
            return False
        deadline = self.batch.expires_at.timestamp()
        if is_owed:
            deadline = max(deadline, self.started_at) + OWED_RETRY_SECONDS
        return timezone.now().timestamp() + exc.retry_after < deadline


def _is_passing(exc: RunError) -> bool:
    """Whether a run's refusal may pass with time (a rate limit, no ready replica)."""
    return exc.code in RETRIED_CODES and exc.retry_after is not None


def _response(error: ApiError, request_id: str) -> dict:
    return {
        "status_code": error.status,
        "request_id": request_id,
        "body": msgspec.to_builtins(error.body()),
    }


def _raise_failures(tasks: set[asyncio.Task]) -> None:
    """A line that failed for the database or the cache (out of reach) ends the pass; its
    row stays running, for the next runner. (A failure of the platform's own with one line
    is that line's 500: ``BatchRun._run_line``.)"""
    failures = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    if failures:
        raise failures[0]


_acredentials_of = database_worker(_credentials_of)


@database_worker
def _auth_generation() -> str | None:
    return cache.get(GENERATION_KEY)


@database_worker
def _caller_of(tenant: Tenant, api_key: ApiKey, model: str) -> Caller | None:
    deployment = deployment_for_tenant(tenant=tenant, name=model)
    if deployment is None:
        return None
    return Caller.of_tenant(
        tenant=tenant,
        deployment=deployment,
        source=UsageRecord.Source.BATCH,
        api_key=api_key,
        # the batch tier, or the tenant's own where that is lower still
        priority_floor=SERVICE_TIER_PRIORITY[Plan.ServiceTier.BATCH],
        counts_per_minute=False,
        counts_refusals=False,  # the runner counts the refusal that ends a line, not its tries
    )


@database_worker
def _pending_page(batch: Batch, after_line: int) -> list[BatchRequest]:
    return selectors.batch_requests_pending(batch=batch, after_line=after_line, limit=PAGE_SIZE)


@database_worker
def _owed(batch: Batch) -> list[BatchRequest]:
    return selectors.batch_requests_owed(batch=batch)


@database_worker
def _claim(request: BatchRequest, request_id: str) -> bool:
    return services.batch_request_claim(request=request, request_id=request_id)


@database_worker
def _next_id(request: BatchRequest, fresh_id: str) -> str:
    return services.batch_request_next_id(request=request, fresh_id=fresh_id)


@database_worker
def _rename(request: BatchRequest, request_id: str) -> None:
    services.batch_request_rename(request=request, request_id=request_id)


@database_worker
def _unclaim(request: BatchRequest) -> None:
    services.batch_request_unclaim(request=request)


@database_worker
def _finish(request: BatchRequest, response: dict) -> None:
    services.batch_request_finish(request=request, response=response)


@database_worker
def _renew(batch: Batch, runner: str, lease_seconds: float) -> str | None:
    return services.batch_lease_renew(batch=batch, runner=runner, lease_seconds=lease_seconds)
