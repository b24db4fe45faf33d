"""Runs one chat reply on the engine, the way the API runs a request (``serving.runs``):
admitted and metered as source ``chat`` with the user set and no API key, at the end user's
tenant's tier.

``generate_reply`` fills a ``ReplyOutcome`` as tokens arrive and hands each piece of text to
``on_text``; it raises ``ChatError`` (a code, a message for the user, maybe ``retry_after``)
for refusals and failures, and ``CancelledError`` when its task is cancelled (stop,
disconnect). Either way the run has settled (its usage record written, its admission
released) before it returns.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from channels.db import database_sync_to_async
from django.contrib.auth.models import AbstractBaseUser

from chat.models import Conversation, Message
from chat.selectors import engine_messages
from config.json_text import NUL
from inference_engine.protocol import GenerateRequest, SamplingParams
from serving.budget import message_tokens
from serving.runs import Caller, Run, RunError, RunSpec
from serving.selectors import deployment_for_tenant
from tenants.models import UsageRecord

# a run's error codes -> (the chat's code, what to tell the user; None: the run's message)
CHAT_ERRORS: dict[str, tuple[str, str | None]] = {
    "rate_limit_exceeded": ("rate_limited", None),
    "insufficient_quota": (
        "insufficient_quota",
        "Your organization has used its token budget for this month: its owner may raise it.",
    ),
    "request_too_large": (
        "request_too_large",
        "This reply would need more tokens than your organization's limit allows at once: "
        "shorten the conversation or lower its max tokens.",
    ),
    "context_length_exceeded": (
        "context_length_exceeded",
        "This conversation is too long for the model (with room for its max tokens). Start a "
        "new conversation, lower its max tokens, or edit an earlier message to resend from "
        "there.",
    ),
    "engine_unavailable": ("engine_unavailable", "The model's engine is unavailable right now."),
    "engine_overloaded": (
        "engine_overloaded",
        "The model is busy right now. Please try again in a moment.",
    ),
    "invalid_request": ("invalid_request", "The model could not accept this request."),
    "engine_error": ("engine_error", "The model failed while answering. Please try again."),
}


class ChatError(Exception):
    """A reply that could not be generated, with what to tell the user."""

    def __init__(self, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def from_run_error(cls, exc: RunError) -> "ChatError":
        code, message = CHAT_ERRORS.get(exc.code, (exc.code, None))
        if exc.code == "context_length_exceeded" and exc.param is not None:
            message = None  # the conversation's max tokens, not its length: say so
        return cls(code, message or exc.message, exc.retry_after)


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


@database_sync_to_async
def _caller_and_messages(
    conversation: Conversation,
    before_id: int,
    user: AbstractBaseUser,
    edited: tuple[int, str] | None,
) -> tuple[Caller, list]:
    tenant = conversation.tenant
    deployment = deployment_for_tenant(tenant=tenant, name=conversation.model)
    if deployment is None:
        raise ChatError(
            "model_not_found",
            f"The model '{conversation.model}' is not available to your organization. "
            "Choose another model in the settings.",
        )
    caller = Caller.of_tenant(
        tenant=tenant, deployment=deployment, source=UsageRecord.Source.CHAT, user=user
    )
    return caller, engine_messages(conversation=conversation, before_id=before_id, edited=edited)


async def generate_reply(
    *,
    conversation: Conversation,
    reply: Message,
    user: AbstractBaseUser,
    outcome: ReplyOutcome,
    on_text: Callable[[str], Awaitable[None]],
    replaces: list[int] | None = None,
    edited: tuple[int, str] | None = None,
) -> None:
    """See the module docstring. ``replaces``: the ids of the messages this reply is to
    replace (a regenerate, an edit), which the model does not see, nor anything after them;
    ``edited``: (a user message's id, the new text the model reads there)."""
    before_id = min(replaces) if replaces else reply.pk
    caller, messages = await _caller_and_messages(conversation, before_id, user, edited)
    if not messages:
        raise ChatError("invalid_request", "There is nothing to answer yet.")
    request = GenerateRequest(
        messages=messages,
        params=SamplingParams(
            temperature=conversation.temperature, max_tokens=conversation.max_tokens
        ),
        request_id=reply.request_id,
    )
    spec = RunSpec(
        request_id=reply.request_id,
        requests=[request],
        prompt_tokens=message_tokens(messages),
        max_tokens_name="max tokens",
    )
    run = Run(spec, caller)
    ended_by: BaseException | None = None
    try:
        await run.start()
        async for _choice, delta in run.deltas():
            # without NUL, which the saved reply cannot hold: the text streamed is the text kept
            text = delta.text.replace(NUL, "")
            if text:
                outcome.pieces.append(text)
                await on_text(text)
            if delta.finish_reason is not None:
                outcome.finish_reason = str(delta.finish_reason)
            _count(outcome, run)
    except RunError as exc:
        ended_by = exc
        raise ChatError.from_run_error(exc) from exc
    except BaseException as exc:
        ended_by = exc
        raise
    finally:
        await run.aclose(ended_by)
        if run.meter is not None:
            _count(outcome, run)


def _count(outcome: ReplyOutcome, run: Run) -> None:
    """The reply's tokens as metered: also those of a stopped reply that were never
    streamed."""
    outcome.prompt_tokens = run.meter.prompt_tokens
    outcome.completion_tokens = run.meter.completion_tokens
    outcome.cached_tokens = run.meter.cached_tokens
