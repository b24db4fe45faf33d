"""One API generation request over HTTP: read and parse the body, authorize the key, run it
(``serving.runs``), and answer with OpenAI's objects or events. Views stay thin and call
``serve_generation``."""

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from gateway import authorization, metrics
from gateway.auth import aapi_key_for, bearer_key
from gateway.bodies import json_body
from gateway.errors import ApiError, from_run_error
from gateway.ratelimits import ratelimit_headers
from gateway.responses import Responder
from gateway.tool_calls import check_auto_tool_choice
from gateway.validation import GenerationPlan
from serving.runs import Caller, Run, RunError
from tenants.models import UsageRecord

logger = logging.getLogger(__name__)

RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}


def new_response_id(kind: str) -> str:
    """A new response's id, which its usage record and ``x-request-id`` share."""
    return RESPONSE_ID_PREFIX[kind] + uuid.uuid4().hex


async def serve_generation(
    request: HttpRequest, kind: str, plan_of: Callable[[bytes], GenerationPlan]
) -> HttpResponse:
    model, tenant = "unknown", "unknown"
    runs: list[Run] = []  # the run, once made: one that was admitted is counted as it settles
    try:
        raw_key = bearer_key(request)
        try:
            plan = plan_of(json_body(request))
        except ApiError:
            # a wrong key is a 401 whatever the body; a right one's tenant is counted
            tenant = (await aapi_key_for(raw_key)).tenant.slug
            raise
        auth = await authorization.authorize(raw_key, plan.model)
        tenant, model = auth.api_key.tenant.slug, auth.deployment.name
        try:
            return await _serve(kind, plan, auth, runs)
        except authorization.StaleAuthorization:
            # What the key was read from has changed: read it again, and trust that read.
            auth = await authorization.authorize(raw_key, plan.model)
            tenant, model = auth.api_key.tenant.slug, auth.deployment.name
            return await _serve(kind, plan, auth, runs, is_checked=False)
    except RunError as exc:
        error = from_run_error(exc)
        if not _was_admitted(runs):
            status = (
                "rate_limited"
                if exc.code in ("rate_limit_exceeded", "insufficient_quota")
                else str(error.status)
            )
            metrics.observe_refusal(model, status, tenant)
        return error.response()
    except ApiError as exc:
        if not _was_admitted(runs):
            metrics.observe_refusal(model, str(exc.status), tenant)
        return exc.response()


def _was_admitted(runs: list[Run]) -> bool:
    """Whether the request's run was admitted: its settlement counted it in the metrics
    (``metrics.observe_finished``), and a refusal's count would count it twice."""
    return bool(runs) and runs[-1].meter is not None


async def _serve(
    kind: str,
    plan: GenerationPlan,
    auth: authorization.Authorization,
    runs: list[Run],
    is_checked: bool = True,
) -> HttpResponse:
    """Run the request and answer it. Admission first checks that ``auth`` is current
    (unless not ``is_checked``) and raises ``StaleAuthorization`` if not. The run made is
    added to ``runs``."""
    api_key, deployment = auth.api_key, auth.deployment
    response_id = new_response_id(kind)
    spec = plan.run_spec(response_id)
    caller = Caller(
        tenant=api_key.tenant,
        deployment=deployment,
        source=UsageRecord.Source.API,
        api_key=api_key,
        cache_salt=auth.cache_salt,
        priority=auth.priority,
        tenant_weight=auth.tenant_weight,
        precondition=auth.ensure_current if is_checked else None,
    )
    on_finish = functools.partial(metrics.observe_finished, deployment.name, api_key.tenant)
    await check_auto_tool_choice(plan.tool_plan, deployment.endpoints)
    run = Run(spec, caller, on_finish=on_finish)
    runs.append(run)
    await run.start()
    # From here the run is settled on every way out, and only once its answer is whole: a
    # failure on the way (a 500) or a client that leaves (cancelled) is metered as such.
    try:
        responder = Responder(kind=kind, plan=plan, run=run, model=deployment.name)
        headers = {"x-request-id": response_id, **ratelimit_headers(run.meter.windows)}
        if plan.stream:
            response = GenerationStreamResponse(responder)  # settles as the stream ends
        else:
            body = msgspec.json.encode(await responder.complete())
            response = HttpResponse(body, content_type="application/json")
        for name, value in headers.items():
            response[name] = value
    except BaseException as exc:
        await run.aclose(exc)
        raise
    if not plan.stream:
        try:
            await run.aclose()
        except Exception:
            # the answer is whole: a 500 for it would lose it, and the client would send it
            # again (the record's failure is the log's to tell, as at a stream's end)
            logger.exception("settling %s failed", response_id)
    return response


class GenerationStreamResponse(StreamingHttpResponse):
    """Server-sent events of a started run; the run settles when the stream ends, is
    cancelled by a disconnect, or is never started at all."""

    def __init__(self, responder: Responder) -> None:
        self._responder = responder
        self._is_started = False
        self._loop = asyncio.get_running_loop()
        super().__init__(self._events(), content_type="text/event-stream")
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"

    async def _events(self) -> AsyncIterator[bytes]:
        self._is_started = True
        ended_by: BaseException | None = None
        try:
            async for event in self._responder.sse():
                yield event
        except BaseException as exc:  # a disconnect cancels the stream: metered as such
            ended_by = exc
            raise
        finally:
            try:
                await self._responder.run.aclose(ended_by)
            except Exception:
                # the answer is out whole: raised from here, the response would never end
                # and the client would wait on it (the record's failure is the log's to tell)
                logger.exception(
                    "settling the stream of %s failed", self._responder.run.spec.request_id
                )

    def close(self) -> None:
        super().close()
        if not self._is_started:
            # Django never iterated the stream (the client left first): end the run here.
            abandon = self._responder.run.aclose(asyncio.CancelledError())
            self._loop.call_soon_threadsafe(asyncio.ensure_future, abandon)
