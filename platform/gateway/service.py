"""One API generation request from HTTP to engine and back: authenticate, validate, route,
admit, run, meter. Views stay thin and call ``serve_generation``."""

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from gateway import authorization, metrics
from gateway.auth import aapi_key_for, bearer_key
from gateway.errors import ApiError
from gateway.generation import Generation, fan_out
from gateway.validation import GenerationPlan, finalize_max_tokens
from serving.models import ModelDeployment
from serving.pool import NoReadyReplica, get_pool
from tenants.metering import metered
from tenants.models import UsageRecord
from tenants.quotas import QuotaExceeded

RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}


def read_body(request: HttpRequest) -> bytes:
    limit = settings.GATEWAY_MAX_BODY_BYTES
    length = request.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    content_type = request.content_type or ""
    if content_type and content_type != "application/json":
        raise ApiError(
            415, "Send the request body as application/json.", code="unsupported_media_type"
        )
    try:
        body = request.body
    except RequestDataTooBig as exc:
        raise ApiError(
            413, f"The request body exceeds {limit} bytes.", code="request_too_large"
        ) from exc
    if len(body) > limit:
        raise ApiError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    return body


async def _route(deployment: ModelDeployment) -> tuple[str, int]:
    try:
        return await get_pool().route(deployment.endpoints, deployment.max_context)
    except NoReadyReplica as exc:
        raise ApiError(
            503,
            f"The model '{deployment.name}' has no ready replica right now.",
            code="engine_unavailable",
            headers={"Retry-After": "5"},
        ) from exc


async def serve_generation(
    request: HttpRequest, kind: str, plan_of: Callable[[bytes], GenerationPlan]
) -> HttpResponse:
    model, tenant = "unknown", "unknown"
    try:
        raw_key = bearer_key(request)
        try:
            plan = plan_of(read_body(request))
        except ApiError:
            await aapi_key_for(raw_key)  # a wrong key is a 401 whatever the body
            raise
        auth = await authorization.authorize(raw_key, plan.model)
        tenant, model = auth.api_key.tenant.slug, auth.deployment.name
        try:
            return await _serve(kind, plan, auth)
        except authorization.StaleAuthorization:
            # What the key was read from has changed: read it again, and trust that read.
            auth = await authorization.authorize(raw_key, plan.model)
            tenant, model = auth.api_key.tenant.slug, auth.deployment.name
            return await _serve(kind, plan, auth, is_checked=False)
    except QuotaExceeded as exc:
        metrics.observe_refusal(model, "rate_limited", tenant)
        return ApiError(429, str(exc), code="rate_limit_exceeded", headers=exc.headers).response()
    except ApiError as exc:
        metrics.observe_refusal(model, str(exc.status), tenant)
        return exc.response()


async def _serve(
    kind: str, plan: GenerationPlan, auth: authorization.Authorization, is_checked: bool = True
) -> HttpResponse:
    """Route, admit, run and meter one request. Admission first checks that ``auth`` is
    current (unless not ``is_checked``) and raises ``StaleAuthorization`` if not."""
    api_key, deployment = auth.api_key, auth.deployment
    endpoint, max_context = await _route(deployment)
    reservation = finalize_max_tokens(plan, max_context)
    response_id = RESPONSE_ID_PREFIX[kind] + uuid.uuid4().hex
    requests = fan_out(
        plan,
        response_id,
        auth.cache_salt,
        str(api_key.tenant_id),
        tier_priority=auth.priority,
        tenant_weight=auth.tenant_weight,
    )
    stack = contextlib.AsyncExitStack()
    admission = stack.enter_async_context(
        metered(
            request_id=response_id,
            tenant=api_key.tenant,
            api_key=api_key,
            model=deployment.name,
            source=UsageRecord.Source.API,
            estimated_tokens=reservation.tokens,
            likely_tokens=reservation.likely_tokens,
            on_finish=functools.partial(metrics.observe_finished, deployment.name, api_key.tenant),
            precondition=auth.ensure_current if is_checked else None,
        )
    )
    try:
        meter = await admission
    except QuotaExceeded as exc:
        if exc.is_hopeless:
            raise _too_large(exc, deployment.name, reservation.likely_tokens) from exc
        raise
    pool = get_pool()
    stack.enter_context(pool.track(endpoint))
    generation = Generation(
        kind=kind,
        plan=plan,
        requests=requests,
        client=pool.client(endpoint),
        meter=meter,
        response_id=response_id,
        model=deployment.name,
    )
    headers = {"x-request-id": response_id, **meter.headers}
    try:
        await generation.start()
        if not plan.stream:
            body = await generation.complete()
    except BaseException as exc:
        # the exception goes in, so that metering sees a cancellation as one
        await stack.__aexit__(type(exc), exc, exc.__traceback__)
        raise
    if not plan.stream:
        await stack.aclose()
        response = HttpResponse(msgspec.json.encode(body), content_type="application/json")
    else:
        response = GenerationStreamResponse(generation, stack)
    for name, value in headers.items():
        response[name] = value
    return response


def _too_large(exc: QuotaExceeded, model: str, requested: int) -> ApiError:
    """A request that no wait would admit: a 400 in OpenAI's words, never a 429."""
    limit = "tokens per min (TPM)" if exc.kind == "request_too_large" else "monthly tokens"
    return ApiError(
        400,
        f"Request too large for {model} on {limit}: Limit {exc.limit}, Requested {requested}. "
        "The input or output tokens must be reduced in order to run successfully.",
        code="request_too_large",
    )


class GenerationStreamResponse(StreamingHttpResponse):
    """Server-sent events of a started ``Generation``; the usage record is written when the
    stream ends, is cancelled by a disconnect, or is never started at all."""

    def __init__(self, generation: Generation, stack: contextlib.AsyncExitStack) -> None:
        self._generation = generation
        self._stack = stack
        self._is_started = False
        self._loop = asyncio.get_running_loop()
        super().__init__(self._events(), content_type="text/event-stream")
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"

    async def _events(self) -> AsyncIterator[bytes]:
        self._is_started = True
        try:
            async for event in self._generation.sse():
                yield event
        finally:
            await self._stack.aclose()

    def close(self) -> None:
        super().close()
        if not self._is_started:
            # Django never iterated the stream (the client left first): finish it here.
            self._loop.call_soon_threadsafe(asyncio.ensure_future, self._abandon())

    async def _abandon(self) -> None:
        self._generation.meter.fail("cancelled", UsageRecord.Status.CANCELLED)
        await self._generation.close()
        await self._stack.aclose()
