"""One generation from the web tier to an engine and back, for the API and the chat alike.

A ``Run`` routes to the least-loaded ready replica, decides the token budget against that
replica's context (``serving.budget``), admits and meters the request (``serving.metering``),
sends one engine request per choice, streams their deltas while counting them into the
meter, and settles exactly once: one usage record, every admission released, whatever
happens (refusal, engine error, engine loss, cancellation, a client that leaves).

    run = Run(spec, caller)
    try:
        await run.start()                 # RunError: refused, nothing streamed
        async for choice, delta in run.deltas():
            ...                           # RunError: failed mid-stream
    finally:
        await run.aclose(exc)             # settles; idempotent

It raises one error type, ``RunError(code, message, retry_after)``, in its own words; the API
maps it to OpenAI's error object and an HTTP status in one table (``gateway.errors``), the
chat to its frames in one table (``chat.replies``). Anything else it lets through (say, the
API's ``StaleAuthorization`` from the admission precondition) is raised with nothing admitted.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from django.contrib.auth.models import AbstractBaseUser
from django.db import InterfaceError, OperationalError
from redis.exceptions import RedisError

from config.workers import database_worker
from inference_engine.client import AsyncEngineClient, EngineOverloaded, EngineUnavailable
from inference_engine.protocol import ErrorCode, FinishReason, GenerateDelta, GenerateRequest, Usage
from serving.budget import ContextExceeded, PromptTokens, Reservation, reserve
from serving.metering import Meter, metered
from serving.models import ModelDeployment
from serving.pool import NoReadyReplica, get_pool
from serving.selectors import prefix_cache_salt
from tenants.models import ApiKey, Tenant, UsageRecord
from tenants.quotas import QuotaExceeded, Window
from tenants.refusals import refusal_record
from tenants.selectors import tenant_priority, tenant_share

logger = logging.getLogger(__name__)

NO_REPLICA_RETRY_AFTER_SECONDS = 5
ENGINE_BUSY_RETRY_AFTER_SECONDS = 1
UNKNOWN_RETRY_AFTER_SECONDS = 1  # an engine error code this web tier does not know yet
UNAVAILABLE_RETRY_AFTER_SECONDS = 5
# what an unreachable cache (Redis) or database raises as a request is admitted
UNREACHABLE_STORE_ERRORS = (
    RedisError,
    OperationalError,
    InterfaceError,
    ConnectionError,
    TimeoutError,
)
# What a caller is told of the engine's own failures. The engine's and its client's words (an
# exception's text, the engine's address) go to this process's log, never to a tenant; its
# refusals (an invalid request, a context too long) are the caller's to read, as they are.
ENGINE_FAILED = "The model's engine failed while generating this response."
ENGINE_LOST = "The model's engine is unavailable."
UNAVAILABLE = "The service is briefly unavailable. Please try again in a few seconds."
ENGINE_BUSY = "The model's engine is overloaded: too many requests are waiting for it."
# how long a run left early waits for the engine's count of what it computed
FINAL_USAGE_TIMEOUT_SECONDS = 2.0

# the engine's error codes -> (the run's code, the usage record's status, retry after)
ENGINE_ERRORS: dict[str, tuple[str, str, int | None]] = {
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ("context_length_exceeded", "rejected", None),
    ErrorCode.INVALID_REQUEST: ("invalid_request", "rejected", None),
    ErrorCode.OVERLOADED: ("engine_overloaded", "rejected", ENGINE_BUSY_RETRY_AFTER_SECONDS),
    ErrorCode.ENGINE_ERROR: ("engine_error", "error", None),
    ErrorCode.MODEL_LOADING: ("model_loading", "rejected", ENGINE_BUSY_RETRY_AFTER_SECONDS),
    ErrorCode.MODEL_NOT_LOADED: ("model_not_loaded", "rejected", ENGINE_BUSY_RETRY_AFTER_SECONDS),
}


class RunError(Exception):
    """Why a run was refused or failed. ``code`` is one of: ``engine_unavailable`` (no ready
    replica, or the engine was lost), ``engine_overloaded`` (the engine's waiting queue, or the
    queue of requests to it, is full), ``context_length_exceeded``, ``rate_limit_exceeded``
    (``windows`` and ``retry_after`` say where the limits stand), ``request_too_large`` (no
    wait would admit it), ``service_unavailable`` (the cache or the database could not admit
    it), or an engine error (``ENGINE_ERRORS``). ``param`` names the
    caller's field at fault, where one is; ``request_id`` the usage record of a run that was
    admitted before it failed (None: refused unadmitted, nothing recorded)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after: int | None = None,
        windows: dict[str, Window] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.windows = windows or {}
        self.param = param
        self.request_id: str | None = None


@dataclass(frozen=True)
class Caller:
    """Who runs it, as the transport resolved them."""

    tenant: Tenant
    deployment: ModelDeployment
    source: str  # UsageRecord.Source
    api_key: ApiKey | None = None
    user: AbstractBaseUser | None = None
    cache_salt: str | None = None  # see serving.selectors.prefix_cache_salt
    priority: int = 1  # the plan tier's engine priority: a request may lower it, never raise it
    tenant_weight: float = 1.0  # the tenant's share under fair scheduling
    # False for a batch line: the monthly budget and concurrency hold, per-minute limits not
    counts_per_minute: bool = True
    # False where the caller counts its own refusals (a batch line, tried again after most:
    # only the refusal that ends it is one, ``count_refusal``)
    counts_refusals: bool = True
    # runs on the worker thread just before admission; what it raises propagates unadmitted
    precondition: Callable[[], None] | None = None

    @classmethod
    def of_tenant(
        cls,
        *,
        tenant: Tenant,
        deployment: ModelDeployment,
        source: str,
        priority_floor: int = 0,
        user: AbstractBaseUser | None = None,
        **fields: object,
    ) -> "Caller":
        """The caller for ``tenant`` (and its chat ``user``) on ``deployment``, with its
        prefix cache salt, its plan tier's priority (no higher than ``priority_floor``'s
        number says) and its weight read from the database: call it on a worker thread. (The
        API reads the same from its cached authorization instead.)"""
        return cls(
            tenant=tenant,
            deployment=deployment,
            source=source,
            user=user,
            cache_salt=prefix_cache_salt(tenant=tenant, deployment=deployment, user=user),
            priority=max(tenant_priority(tenant=tenant), priority_floor),
            tenant_weight=tenant_share(tenant=tenant),
            **fields,
        )


@dataclass
class RunSpec:
    """What to run: one engine request per choice, each with its ``request_id``, prompt and
    sampling parameters (``max_tokens`` None: up to the context length), ``choices_per_prompt``
    of each prompt in a row (the prompt is billed once per prompt). The run checks
    ``max_tokens`` against the context and fills in the scheduling fields."""

    request_id: str  # the usage record's
    requests: list[GenerateRequest]
    prompt_tokens: PromptTokens  # of all the prompts together
    max_tokens_name: str = "max_tokens"  # what the caller calls it, for messages
    choices_per_prompt: int = 1
    priority: int | None = None  # as asked; the caller's tier is the floor
    # the caller's labels for its usage record: its end user and metadata (the API's)
    end_user: str | None = None
    metadata: dict[str, str] | None = None
    # the caller's names of engine fields its refusals may name (``structured_outputs``:
    # the API's ``response_format``), for their ``param`` and message
    param_names: dict[str, str] = field(default_factory=dict)

    def labels(self) -> dict[str, object]:
        labels: dict[str, object] = {}
        if self.end_user:
            labels["end_user"] = self.end_user
        if self.metadata:
            labels["metadata"] = self.metadata
        return labels


@dataclass
class Choice:
    """One engine request of a run, as counted so far."""

    index: int
    request_id: str
    is_first_of_prompt: bool
    finish_reason: FinishReason | None = None
    num_tokens: int = 0  # generated, as metered


class Run:
    def __init__(
        self,
        spec: RunSpec,
        caller: Caller,
        *,
        on_finish: Callable[[Meter], None] | None = None,
    ) -> None:
        self.spec = spec
        self.caller = caller
        self.choices = [
            Choice(i, request.request_id, i % spec.choices_per_prompt == 0)
            for i, request in enumerate(spec.requests)
        ]
        self.meter: Meter | None = None
        self._on_finish = on_finish
        self._client: AsyncEngineClient | None = None
        self._streams: list[AsyncIterator[GenerateDelta]] = []
        self._first: list[GenerateDelta] = []
        self._prompt_usage: dict[int, tuple[int, int]] = {}  # choice -> (prompt, cached)
        self._reservation: Reservation | None = None  # once the budget is decided
        self._stack = contextlib.AsyncExitStack()
        self._is_closed = False

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Route, budget, admit, send every choice and wait for its first delta. Raises
        ``RunError`` having settled (or admitted nothing)."""
        try:
            endpoint, max_context = await self._route()
            self._budget(max_context)
            self.meter = await self._admit()
            pool = get_pool()
            self._stack.enter_context(pool.track(endpoint))
            self._client = pool.client(endpoint)
            await self._send()
        except BaseException as exc:
            await self.aclose(exc)
            if isinstance(exc, RunError) and self.meter is not None:
                self._admitted(exc)
            elif isinstance(exc, RunError) and self.caller.counts_refusals:
                await count_refusal(self.caller, exc.code)  # refused unadmitted: no record
            raise

    async def _route(self) -> tuple[str, int]:
        deployment = self.caller.deployment
        try:
            return await get_pool().route(deployment.endpoints, deployment.max_context)
        except NoReadyReplica as exc:
            raise RunError(
                "engine_unavailable",
                f"The model '{deployment.name}' has no ready replica right now.",
                retry_after=NO_REPLICA_RETRY_AFTER_SECONDS,
            ) from exc

    def _budget(self, max_context: int) -> None:
        """Check ``max_tokens`` against the context, reserve, and fill in the scheduling
        fields of every engine request."""
        spec, caller = self.spec, self.caller
        asked = spec.priority if spec.priority is not None else caller.priority
        priority = max(caller.priority, asked)
        for request in spec.requests:
            request.tenant_id = str(caller.tenant.pk)
            request.cache_salt = caller.cache_salt
            request.priority = priority
            request.tenant_weight = caller.tenant_weight
            if caller.deployment.max_context is not None:
                # the engine holds the prompt and the completion to it, as to its own
                request.max_model_len = max_context
        try:
            self._reservation = reserve(
                prompt=spec.prompt_tokens,
                max_tokens=[request.params.max_tokens for request in spec.requests],
                max_context=max_context,
            )
        except ContextExceeded as exc:
            raise RunError(
                "context_length_exceeded",
                f"{exc} Please reduce {spec.max_tokens_name}.",
                param=spec.max_tokens_name,
            ) from exc

    async def _admit(self) -> Meter:
        caller, reservation = self.caller, self._reservation
        admission = metered(
            request_id=self.spec.request_id,
            tenant=caller.tenant,
            api_key=caller.api_key,
            user=caller.user,
            model=caller.deployment.name,
            source=caller.source,
            estimated_tokens=reservation.tokens,
            likely_tokens=reservation.likely_tokens,
            num_sequences=len(self.spec.requests),
            on_finish=self._on_finish,
            precondition=caller.precondition,
            counts_per_minute=caller.counts_per_minute,
            labels=self.spec.labels(),
        )
        try:
            return await self._stack.enter_async_context(admission)
        except QuotaExceeded as exc:
            raise self._refusal(exc) from exc
        except UNREACHABLE_STORE_ERRORS as exc:
            logger.warning("request %s not admitted: %s", self.spec.request_id, exc)
            raise RunError(
                "service_unavailable", UNAVAILABLE, retry_after=UNAVAILABLE_RETRY_AFTER_SECONDS
            ) from exc

    def _refusal(self, exc: QuotaExceeded) -> RunError:
        if exc.kind == "monthly_tokens":  # OpenAI's answer to a quota used up: retries fail
            return RunError(
                "insufficient_quota",
                f"You exceeded your current quota: {exc}",
                retry_after=exc.retry_after,
                windows=exc.windows,
            )
        if not exc.is_hopeless:
            return RunError(
                "rate_limit_exceeded", str(exc), retry_after=exc.retry_after, windows=exc.windows
            )
        if exc.kind == "no_requests":  # a limit of 0: no wait admits it, nor would less
            return RunError("rate_limit_exceeded", str(exc), windows=exc.windows)
        model = self.caller.deployment.name
        if exc.kind == "too_many_sequences":
            return RunError(
                "request_too_large",
                f"Request too large for {model} on concurrent requests: Limit {exc.limit}, "
                f"Requested {len(self.spec.requests)} sequences (prompts × n). Send fewer "
                "prompts or a smaller n.",
            )
        limit = "tokens per min (TPM)" if exc.kind == "request_too_large" else "monthly tokens"
        return RunError(
            "request_too_large",
            f"Request too large for {model} on {limit}: Limit {exc.limit}, Requested "
            f"{self._reservation.likely_tokens}. The input or output tokens must be reduced "
            "in order to run successfully.",
        )

    async def _send(self) -> None:
        self._streams = [self._client.generate(request) for request in self.spec.requests]
        try:
            self._first = await self._first_deltas()
        except EngineUnavailable as exc:
            raise self._lost(exc) from exc
        except EngineOverloaded as exc:  # the engine is up: its queue is full, as it says
            logger.warning("request %s refused: %s", self.meter.request_id, exc)
            self.meter.fail(str(ErrorCode.OVERLOADED), UsageRecord.Status.REJECTED)
            raise RunError(
                "engine_overloaded", ENGINE_BUSY, retry_after=ENGINE_BUSY_RETRY_AFTER_SECONDS
            ) from exc
        except StopAsyncIteration as exc:
            self.meter.fail("engine_error")
            raise RunError("engine_error", "The engine closed the stream.") from exc
        for delta in self._first:
            if delta.error is not None:
                raise self._engine_error(delta)

    async def _first_deltas(self) -> list[GenerateDelta]:
        """Each choice's first delta, counted as it arrives: when the wait ends early (the
        client left, one choice failed), a choice that had its delta (perhaps its last) is
        metered, and no read of a stream is left running to be closed under it."""

        async def first(choice: Choice, stream: AsyncIterator[GenerateDelta]) -> GenerateDelta:
            delta = await anext(stream)
            self._count(choice, delta)
            return delta

        reads = [
            asyncio.ensure_future(first(choice, stream))
            for choice, stream in zip(self.choices, self._streams, strict=True)
        ]
        try:
            return list(await asyncio.gather(*reads))
        finally:
            for read in reads:
                read.cancel()
            await asyncio.gather(*reads, return_exceptions=True)

    # --- stream --------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[tuple[Choice, GenerateDelta]]:
        """Every delta of every choice as it arrives, counted into the meter, the first ones
        included. An engine error, or the engine's loss, raises ``RunError``."""
        try:
            for choice, delta in zip(self.choices, self._first, strict=True):
                yield choice, delta
            open_streams = [
                (choice, stream)
                for choice, stream, first in zip(
                    self.choices, self._streams, self._first, strict=True
                )
                if first.finish_reason is None
            ]
            if len(open_streams) == 1:
                choice, stream = open_streams[0]
                merged = _counted(choice, stream, self._count)
            else:
                merged = _merge(open_streams, self._count)
            # closed as an error goes up, not when the collector gets to it: the merge's
            # pumps stop reading the other choices, whose streams ``aclose`` then aborts
            async with contextlib.aclosing(merged):
                async for choice, delta in merged:
                    if delta.error is not None:
                        raise self._engine_error(delta)
                    yield choice, delta
        except EngineUnavailable as exc:
            raise self._lost(exc) from exc

    def num_ready(self) -> int:
        """Deltas of a single-choice run already received and not yet taken: a consumer that
        falls behind can see that more are ready and write them out together."""
        if len(self.choices) != 1 or self._client is None:
            return 0
        return self._client.num_buffered(self.choices[0].request_id)

    def _count(self, choice: Choice, delta: GenerateDelta) -> None:
        if delta.token_ids:
            self.meter.mark_first_token()
            self.meter.completion_tokens += len(delta.token_ids)
            choice.num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
        if delta.usage is not None and choice.is_first_of_prompt:
            self._count_prompt(choice, delta.usage)

    def _count_prompt(self, choice: Choice, usage: Usage) -> None:
        """The prompt is billed once per prompt, not once per choice."""
        self._prompt_usage[choice.index] = (usage.prompt_tokens, usage.cached_tokens)
        self.meter.prompt_tokens = sum(p for p, _ in self._prompt_usage.values())
        self.meter.cached_tokens = sum(c for _, c in self._prompt_usage.values())

    def _engine_error(self, delta: GenerateDelta) -> RunError:
        code, status, retry_after = ENGINE_ERRORS.get(
            delta.error, (str(delta.error or "engine_error"), "error", UNKNOWN_RETRY_AFTER_SECONDS)
        )
        self.meter.fail(str(delta.error), status)
        if status == UsageRecord.Status.ERROR:
            logger.error(
                "request %s failed in the engine: %s: %s",
                self.meter.request_id,
                delta.error,
                delta.error_message,
            )
            return self._admitted(RunError(code, ENGINE_FAILED, retry_after=retry_after))
        message, param = delta.error_message or code, delta.error_param
        if param in self.spec.param_names:  # the caller's name for it
            message = message.replace(param, self.spec.param_names[param], 1)
            param = self.spec.param_names[param]
        return self._admitted(RunError(code, message, retry_after=retry_after, param=param))

    def _lost(self, exc: EngineUnavailable) -> RunError:
        logger.warning("request %s lost its engine: %s", self.meter.request_id, exc)
        self.meter.fail("engine_unavailable")
        return self._admitted(
            RunError("engine_unavailable", ENGINE_LOST, retry_after=NO_REPLICA_RETRY_AFTER_SECONDS)
        )

    def _admitted(self, error: RunError) -> RunError:
        """``error`` of this admitted run: its answer names the usage record it is under,
        and says where the limits stand, as a successful answer does."""
        error.request_id = self.spec.request_id
        error.windows = error.windows or self.meter.windows
        return error

    # --- settle --------------------------------------------------------------------------

    async def aclose(self, exc: BaseException | None = None) -> None:
        """End the run: abort what the engine still runs, meter what it computed (also tokens
        nobody read), release the admission and write the usage record. ``exc`` is why it
        ends early, if it does: a cancellation is recorded as one. Only the first call
        counts."""
        if self._is_closed:
            return
        self._is_closed = True
        is_cancelled = isinstance(exc, asyncio.CancelledError | GeneratorExit)
        if is_cancelled and self.meter is not None and self.meter.status == UsageRecord.Status.OK:
            self.meter.fail("cancelled", UsageRecord.Status.CANCELLED)
        try:
            await self._close_streams()
        finally:
            await self._settle(exc)

    async def _close_streams(self) -> None:
        await asyncio.gather(*(s.aclose() for s in self._streams), return_exceptions=True)
        unfinished = [c for c in self.choices[: len(self._streams)] if c.finish_reason is None]
        if not unfinished or self.meter is None:
            return
        finals = await asyncio.gather(
            *(
                self._client.final_delta(choice.request_id, FINAL_USAGE_TIMEOUT_SECONDS)
                for choice in unfinished
            )
        )
        for choice, final in zip(unfinished, finals, strict=True):
            choice.finish_reason = FinishReason.ABORT
            if final is not None and final.usage is not None:
                self.meter.completion_tokens += final.usage.completion_tokens - choice.num_tokens
                choice.num_tokens = final.usage.completion_tokens
                if choice.is_first_of_prompt:
                    self._count_prompt(choice, final.usage)

    async def _settle(self, exc: BaseException | None) -> None:
        """Leave the admission's context (which writes the record) with ``exc`` in it, so
        that metering sees what ended the run."""
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else (None, None, None)
        try:
            await self._stack.__aexit__(*exc_info)
        except BaseException as raised:
            if raised is not exc:
                raise


@database_worker
def count_refusal(caller: Caller, code: str) -> None:
    """Count the refusal for the dashboards; a failure to count refuses nothing else."""
    try:
        refusal_record(
            tenant_id=caller.tenant.pk,
            api_key_id=caller.api_key.pk if caller.api_key is not None else None,
            model=caller.deployment.name,
            source=caller.source,
            code=code,
        )
    except Exception:  # noqa: BLE001 - logged; the caller's refusal goes out regardless
        logger.warning("could not count a refusal (%s)", code, exc_info=True)


async def _counted(
    choice: Choice,
    stream: AsyncIterator[GenerateDelta],
    count: Callable[[Choice, GenerateDelta], None],
) -> AsyncIterator[tuple[Choice, GenerateDelta]]:
    """One choice's stream, each delta counted as it is taken from the engine's."""
    async for delta in stream:
        count(choice, delta)
        yield choice, delta


async def _merge(
    streams: list[tuple[Choice, AsyncIterator[GenerateDelta]]],
    count: Callable[[Choice, GenerateDelta], None],
) -> AsyncIterator[tuple[Choice, GenerateDelta]]:
    """Interleave several choices' streams in arrival order, each delta counted as it is
    taken from its engine stream (not as it is read from here: what a consumer that stops
    leaves queued was received, and is metered)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async for delta in stream:
                count(choice, delta)
                await queue.put((choice, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((choice, exc))
        await queue.put((choice, done))

    tasks = [asyncio.create_task(pump(choice, stream)) for choice, stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
