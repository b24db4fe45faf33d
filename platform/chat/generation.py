"""Runs one chat reply on the engine the way the API runs a request: route to the
least-loaded ready replica, admit and meter (source ``chat``, the user set, no API key),
stream the deltas, and abort the engine request when the caller cancels.

``generate_reply`` fills a ``ReplyOutcome`` as tokens arrive and hands each piece of text to
``on_text``; it raises ``ChatError`` (a code, a message for the user, maybe ``retry_after``)
for refusals and failures, and ``CancelledError`` when its task is cancelled. Either way the
usage record is written and the admission released before it returns.
"""

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from chat.models import Conversation, Message
from chat.selectors import engine_messages
from gateway.generation import ENGINE_ERRORS, FINAL_USAGE_TIMEOUT_SECONDS
from gateway.validation import message_token_estimates
from inference_engine.client import AsyncEngineClient, EngineUnavailable
from inference_engine.protocol import ErrorCode, GenerateRequest, SamplingParams
from serving.models import ModelDeployment
from serving.pool import NoReadyReplica, get_pool
from serving.selectors import deployment_for_tenant, prefix_cache_salt
from tenants.metering import Meter, metered
from tenants.models import UsageRecord
from tenants.quotas import QuotaExceeded
from tenants.selectors import tenant_priority, tenant_share

ENGINE_RETRY_AFTER_SECONDS = 5
UNKNOWN_ENGINE_ERROR = (500, "engine_error", UsageRecord.Status.ERROR)
USER_MESSAGES = {
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: "This conversation is too long for the model. Start a "
    "new conversation, or edit an earlier message to resend from there.",
    ErrorCode.OVERLOADED: "The model is busy right now. Please try again in a moment.",
    ErrorCode.INVALID_REQUEST: "The model could not accept this request.",
    ErrorCode.ENGINE_ERROR: "The model failed while answering. Please try again.",
}


class ChatError(Exception):
    """A reply that could not be generated, with what to tell the user."""

    def __init__(self, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass
class ReplyOutcome:
    """What a reply has become so far; read by the consumer to save and report it."""

    pieces: list[str] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@sync_to_async
def _prepare(conversation: Conversation, reply: Message) -> tuple:
    deployment = deployment_for_tenant(tenant=conversation.tenant, name=conversation.model)
    if deployment is None:
        raise ChatError(
            "model_not_found",
            f"The model '{conversation.model}' is not available to your organization. "
            "Choose another model in the settings.",
        )
    messages = engine_messages(conversation=conversation, before_id=reply.pk)
    tenant = conversation.tenant
    scheduling = (tenant_priority(tenant=tenant), tenant_share(tenant=tenant))
    return deployment, prefix_cache_salt(tenant=tenant, deployment=deployment), messages, scheduling


async def _route(deployment: ModelDeployment) -> tuple[str, int]:
    try:
        return await get_pool().route(deployment.endpoints, deployment.max_context)
    except NoReadyReplica as exc:
        raise ChatError(
            "engine_unavailable",
            f"The model '{deployment.name}' has no ready replica right now.",
            ENGINE_RETRY_AFTER_SECONDS,
        ) from exc


async def generate_reply(
    *,
    conversation: Conversation,
    reply: Message,
    user: AbstractBaseUser,
    outcome: ReplyOutcome,
    on_text: Callable[[str], Awaitable[None]],
) -> None:
    """See the module docstring."""
    deployment, cache_salt, messages, (priority, weight) = await _prepare(conversation, reply)
    if not messages:
        raise ChatError("invalid_request", "There is nothing to answer yet.")
    endpoint, max_context = await _route(deployment)
    estimated, most = message_token_estimates(messages)
    if estimated >= max_context:
        raise ChatError("context_length_exceeded", USER_MESSAGES[ErrorCode.CONTEXT_LENGTH_EXCEEDED])
    max_tokens = min(conversation.max_tokens, max_context - estimated)
    request = GenerateRequest(
        messages=messages,
        params=SamplingParams(temperature=conversation.temperature, max_tokens=max_tokens),
        request_id=reply.request_id,
        tenant_id=str(conversation.tenant_id),
        cache_salt=cache_salt,
        priority=priority,  # the replies ride at the end user's tenant's tier
        tenant_weight=weight,
    )
    pool = get_pool()
    try:
        async with metered(
            request_id=reply.request_id,
            tenant=conversation.tenant,
            model=deployment.name,
            source=UsageRecord.Source.CHAT,
            estimated_tokens=most + max_tokens,
            likely_tokens=estimated + max_tokens,
            user=user,
        ) as meter:
            with pool.track(endpoint):
                await _stream(pool.client(endpoint), request, meter, outcome, on_text)
    except QuotaExceeded as exc:
        if exc.is_hopeless:
            raise ChatError(
                "request_too_large",
                "This reply would need more tokens than your organization's limit allows at "
                "once: shorten the conversation or lower its max tokens.",
            ) from exc
        raise ChatError("rate_limited", str(exc), exc.retry_after) from exc


async def _stream(
    client: AsyncEngineClient,
    request: GenerateRequest,
    meter: Meter,
    outcome: ReplyOutcome,
    on_text: Callable[[str], Awaitable[None]],
) -> None:
    stream = client.generate(request)
    try:
        # aclosing: a cancelled reply aborts its engine request at once
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if delta.token_ids:
                    meter.mark_first_token()
                    outcome.completion_tokens += len(delta.token_ids)
                    meter.completion_tokens = outcome.completion_tokens
                if delta.usage is not None:
                    outcome.prompt_tokens = meter.prompt_tokens = delta.usage.prompt_tokens
                    outcome.cached_tokens = meter.cached_tokens = delta.usage.cached_tokens
                if delta.error is not None:
                    _, code, usage_status = ENGINE_ERRORS.get(delta.error, UNKNOWN_ENGINE_ERROR)
                    meter.fail(str(delta.error), usage_status)
                    message = USER_MESSAGES.get(delta.error) or delta.error_message or code
                    retry = 1 if delta.error == ErrorCode.OVERLOADED else None
                    raise ChatError(code, message, retry)
                if delta.text:
                    outcome.pieces.append(delta.text)
                    await on_text(delta.text)
                if delta.finish_reason is not None:
                    outcome.finish_reason = str(delta.finish_reason)
    except EngineUnavailable as exc:
        meter.fail("engine_unavailable")
        raise ChatError(
            "engine_unavailable",
            "The model's engine is unavailable right now.",
            ENGINE_RETRY_AFTER_SECONDS,
        ) from exc
    finally:
        if outcome.finish_reason is None:
            # stopped: meter what the engine computed, also tokens never streamed
            final = await client.final_delta(request.request_id, FINAL_USAGE_TIMEOUT_SECONDS)
            if final is not None and final.usage is not None:
                meter.completion_tokens = final.usage.completion_tokens
                meter.prompt_tokens = final.usage.prompt_tokens
                meter.cached_tokens = final.usage.cached_tokens
