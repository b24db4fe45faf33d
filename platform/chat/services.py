"""Writes: conversations, their messages and a user's chosen tenant.

Every function takes keyword-only arguments, validates before writing and runs in one
transaction. The consumer calls them through ``database_sync_to_async``.
"""

from datetime import timedelta
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from chat import claims, relay
from chat.models import DEFAULT_TEMPERATURE, ChatPreference, Conversation, Message
from chat.selectors import chat_models
from config.json_text import NUL
from tenants.models import Membership, Tenant
from tenants.selectors import user_tenants

MAX_TITLE_CHARS = 200
MAX_CONTENT_CHARS = 32_000
MAX_SYSTEM_PROMPT_CHARS = 16_000
MAX_TOKENS_LIMIT = 32_768
# empty conversations a user keeps in a tenant (new chats opened and not written in yet):
# past this, a new chat reopens the newest of them (the hourly purge takes the rest)
MAX_EMPTY_CONVERSATIONS = 10
# how long an empty conversation open in no window is kept (``tasks.purge_empty_conversations``)
EMPTY_CONVERSATION_GRACE = timedelta(hours=1)
# how often a window with a conversation open marks it so (``conversation_hold``): well
# within the grace, so that a page left open for hours keeps its empty conversation
HOLD_RENEW_SECONDS = EMPTY_CONVERSATION_GRACE.total_seconds() / 4
# what a new conversation starts with (a reopened empty one too)
NEW_CONVERSATION_SETTINGS = {
    "system_prompt": "",
    "temperature": DEFAULT_TEMPERATURE,
    "max_tokens": None,
}
TITLE_FROM_MESSAGE_CHARS = 60
INTERRUPTED_MESSAGE = "The reply was interrupted: the server stopped while writing it."


def _title_from(content: str) -> str:
    line = " ".join(content.split())
    if len(line) <= TITLE_FROM_MESSAGE_CHARS:
        return line
    return line[: TITLE_FROM_MESSAGE_CHARS - 1].rstrip() + "…"


def _clean(text: str) -> str:
    """Without NUL characters, which PostgreSQL's text fields refuse (a model may emit one)."""
    return text.replace(NUL, "")


def _check_content(content: object) -> str:
    if isinstance(content, str):
        content = _clean(content)
    if not isinstance(content, str) or not content.strip():
        raise ValidationError("Write a message first.")
    if len(content) > MAX_CONTENT_CHARS:
        raise ValidationError(f"A message may be at most {MAX_CONTENT_CHARS} characters long.")
    return content


def _touch(conversation: Conversation) -> None:
    conversation.updated_at = timezone.now()
    conversation.save(update_fields=["updated_at"])


@transaction.atomic
def conversation_create(
    *, user: AbstractBaseUser, tenant: Tenant, model: str = "", title: str = ""
) -> Conversation:
    """A new, empty conversation on ``model`` (the tenant's first allowed model if omitted)."""
    # the membership row, locked: one new chat at a time per user and tenant, so that the
    # count of empty ones below holds until this one is created
    membership = (
        Membership.objects.select_for_update(of=("self",))
        .filter(user=user, tenant=tenant, tenant__is_active=True)
        .first()
    )
    if membership is None:
        raise ValidationError("You are not a member of this organization.")
    models = chat_models(tenant=tenant)
    if model and model not in models:
        raise ValidationError(f"The model '{model}' is not available to your organization.")
    fields = {
        "model": model or (models[0] if models else ""),
        "title": title.strip()[:MAX_TITLE_CHARS],
    }
    empty = Conversation.objects.filter(tenant=tenant, user=user, messages__isnull=True)
    if empty.count() >= MAX_EMPTY_CONVERSATIONS:
        # as many as anyone opens at once: the newest is new again, on the model asked for
        newest = empty.order_by("-created_at", "-pk").values("pk")[:1]
        conversation = Conversation.objects.select_for_update().filter(pk__in=newest).first()
        if conversation is not None:
            now = timezone.now()
            fresh = {**NEW_CONVERSATION_SETTINGS, **fields, "created_at": now, "updated_at": now}
            for name, value in fresh.items():
                setattr(conversation, name, value)
            conversation.save(update_fields=list(fresh))
            return conversation
    return Conversation.objects.create(tenant=tenant, user=user, **fields)


def conversation_hold(*, conversation_id: int) -> None:
    """Mark the conversation as open in a window now: the purge of empty conversations
    spares it for its grace from now (``chat.tasks``)."""
    Conversation.objects.filter(pk=conversation_id).update(opened_at=timezone.now())


@transaction.atomic
def conversation_rename(*, conversation: Conversation, title: str) -> Conversation:
    title = " ".join(_clean(str(title)).split())
    if len(title) > MAX_TITLE_CHARS:
        raise ValidationError(f"A title may be at most {MAX_TITLE_CHARS} characters long.")
    conversation.title = title
    conversation.save(update_fields=["title"])
    # the title alone: the other settings as loaded here may be older than another window's
    frame = {"type": "settings", "settings": {"title": conversation.title}}
    _tell_windows(conversation, {"type": "chat.frame", "frame": frame})
    return conversation


@transaction.atomic
def conversation_delete(*, conversation: Conversation) -> None:
    """Delete the conversation; a reply it is generating stops (``chat.claims``)."""
    deleted = claims.deleted_key(conversation)  # the pk is gone once deleted
    _tell_windows(conversation, {"type": "chat.deleted"})
    conversation.delete()
    transaction.on_commit(lambda: claims.mark_deleted(deleted))


def _tell_windows(conversation: Conversation, message: dict) -> None:
    """Tell the conversation's open sockets (``chat.relay``) once the change is committed."""
    tell = partial(
        relay.publish_from_sync,
        tenant_id=conversation.tenant_id,
        conversation_id=conversation.pk,
        message=message,
    )
    transaction.on_commit(tell)


class ConversationDeleted(Exception):
    """The reply's conversation was deleted while the reply ran: there is nothing to save."""


class Unchanged:
    """A setting left as it is, where None means something."""


UNCHANGED = Unchanged()


@transaction.atomic
def conversation_configure(
    *,
    conversation: Conversation,
    model: str | None = None,
    system_prompt: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None | Unchanged = UNCHANGED,
) -> Conversation:
    """Change the conversation's generation settings; None leaves a setting as it is, except
    ``max_tokens``, where None means up to the model's context length. Every setting is
    checked before any is changed: a refusal leaves the conversation as it was, in memory too
    (the socket's copy is the one its next reply reads)."""
    changes = {}
    if model is not None:
        if not isinstance(model, str) or model not in chat_models(tenant=conversation.tenant):
            raise ValidationError(f"The model '{model}' is not available to your organization.")
        changes["model"] = model
    if system_prompt is not None:
        if not isinstance(system_prompt, str) or len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise ValidationError(
                f"The system prompt must be text of at most {MAX_SYSTEM_PROMPT_CHARS} characters."
            )
        changes["system_prompt"] = _clean(system_prompt)
    if temperature is not None:
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            # NaN and the infinities fail the range too; math.isfinite, asked first, raised
            # OverflowError for an int past float's range
            or not 0 <= temperature <= 2
        ):
            raise ValidationError("The temperature must be a number from 0 to 2.")
        changes["temperature"] = float(temperature)
    if max_tokens is None:
        changes["max_tokens"] = None
    elif not isinstance(max_tokens, Unchanged):
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= MAX_TOKENS_LIMIT
        ):
            raise ValidationError(f"Max tokens must be a whole number, 1 to {MAX_TOKENS_LIMIT}.")
        changes["max_tokens"] = max_tokens
    for name, value in changes.items():
        setattr(conversation, name, value)
    changed = list(changes)
    if changed:
        conversation.save(update_fields=changed)
    return conversation


@transaction.atomic
def message_send(*, conversation: Conversation, content: str) -> Message:
    """Add the user's message; the first one also titles an untitled conversation."""
    content = _check_content(content)
    message = Message.objects.create(
        tenant_id=conversation.tenant_id,
        conversation=conversation,
        role=Message.Role.USER,
        content=content,
    )
    if not conversation.title:
        conversation.title = _title_from(content)
        conversation.save(update_fields=["title"])
    _touch(conversation)
    return message


@transaction.atomic
def message_edit(*, conversation: Conversation, message_id: int, content: str) -> Message:
    """Change one of the user's messages and drop everything after it, to resend from there
    (at once: the chat defers both until the new reply holds an answer, ``reply_replace``)."""
    message, content, later = message_edit_check(
        conversation=conversation, message_id=message_id, content=content
    )
    _edit_apply(conversation, message, content)
    Message.objects.filter(conversation=conversation, pk__in=later).delete()
    _touch(conversation)
    return message


def message_edit_check(
    *, conversation: Conversation, message_id: int, content: str
) -> tuple[Message, str, list[int]]:
    """An edit of one of the user's messages, checked and not applied: (the message as saved,
    its new text, the ids of the messages after it, which a reply to the new text replaces)."""
    content = _check_content(content)
    message = Message.objects.filter(
        pk=message_id,
        conversation=conversation,
        tenant_id=conversation.tenant_id,
        role=Message.Role.USER,
    ).first()
    if message is None:
        raise ValidationError("That message does not exist in this conversation.")
    later = Message.objects.filter(conversation=conversation, id__gt=message.pk).order_by("id")
    return message, content, list(later.values_list("id", flat=True))


def _edit_apply(conversation: Conversation, message: Message, content: str) -> None:
    """Save the message's new text; an edited first message retitles a conversation whose
    title was made from it."""
    is_first = not Message.objects.filter(conversation=conversation, id__lt=message.pk).exists()
    if is_first:
        # a title made from this message, not chosen, follows the edit: as saved now (a rename
        # made while the edit's reply ran stands)
        title = _title_from(content)
        made = Conversation.objects.filter(pk=conversation.pk, title=_title_from(message.content))
        if made.update(title=title):
            conversation.title = title
    message.content = content
    message.save(update_fields=["content"])


def reply_prepare_regenerate(*, conversation: Conversation) -> tuple[int, list[int]]:
    """Where a new reply to the last user message goes: (that message's id, the ids of the
    replies after it, which the new one replaces: one, or more where a process died
    mid-regenerate). They stay until the new reply is kept (``reply_replace``): a refused or
    empty new reply leaves the user the answer they had."""
    question = (
        Message.objects.filter(conversation=conversation, role=Message.Role.USER)
        .order_by("-id")
        .values_list("id", flat=True)
        .first()
    )
    if question is None:
        raise ValidationError("There is nothing to regenerate yet.")
    replies = Message.objects.filter(conversation=conversation, id__gt=question).order_by("id")
    return question, list(replies.values_list("id", flat=True))


@transaction.atomic
def reply_replace(
    *,
    conversation: Conversation,
    reply: Message,
    replaced_ids: list[int],
    edit: tuple[int, str] | None = None,
) -> bool:
    """Settle a regenerated or re-asked ``reply`` (saved by ``reply_finish``): where it holds
    an answer (complete, or stopped with text) the messages it replaces go and the ``edit``
    (message id, new text) is saved; else (refused, failed, stopped before its first token) it
    goes, and nothing else changes. True where the new reply was kept."""
    is_kept = reply.status == Message.Status.COMPLETE or (
        reply.status == Message.Status.STOPPED and bool(reply.content)
    )
    if not is_kept:
        Message.objects.filter(pk=reply.pk, conversation=conversation).delete()
        return False
    if edit is not None:
        message_id, content = edit
        message = Message.objects.filter(
            pk=message_id, conversation=conversation, role=Message.Role.USER
        ).first()
        if message is not None:
            _edit_apply(conversation, message, content)
    gone = [pk for pk in replaced_ids if pk != reply.pk]
    Message.objects.filter(pk__in=gone, conversation=conversation).delete()
    return True


@transaction.atomic
def reply_start(
    *, conversation: Conversation, request_id: str, is_replacement: bool = False
) -> Message:
    """The reply placeholder that tokens stream into; ``is_replacement``: a regenerate's or
    an edit's, settled by ``reply_finish_replacing``."""
    return Message.objects.create(
        tenant_id=conversation.tenant_id,
        conversation=conversation,
        role=Message.Role.ASSISTANT,
        status=Message.Status.STREAMING,
        model=conversation.model,
        request_id=request_id,
        is_replacement=is_replacement,
    )


@transaction.atomic
def replies_interrupt(*, conversation: Conversation, up_to_id: int | None = None) -> int:
    """Settle the conversation's replies still saved as streaming (those up to ``up_to_id``,
    if given): called when nobody holds its claim, they were left by a process that died
    mid-reply. A new question's is marked failed; a regenerate's or an edit's goes, as a failed
    one does (``reply_replace``), and the conversation is as it was. Returns how many."""
    streaming = Message.objects.filter(
        conversation=conversation, role=Message.Role.ASSISTANT, status=Message.Status.STREAMING
    )
    if up_to_id is not None:
        streaming = streaming.filter(id__lte=up_to_id)
    num_dropped, _ = streaming.filter(is_replacement=True).delete()
    return num_dropped + streaming.update(
        status=Message.Status.ERROR,
        error_code="interrupted",
        error_message=INTERRUPTED_MESSAGE,
    )


def replies_interrupt_unless_claimed(*, conversation: Conversation) -> bool:
    """Whether somebody holds the conversation's claim (is generating its reply); when nobody
    does, mark the replies left streaming interrupted (``replies_interrupt``).

    Only the messages saved before the claim was looked at: a window that claims the
    conversation just after the look starts a newer reply, which is left streaming (messages
    are written only under the claim, so a newer reply has a higher id)."""
    newest = (
        Message.objects.filter(conversation=conversation)
        .order_by("-id")
        .values_list("id", flat=True)
        .first()
    )
    if claims.is_claimed(conversation):
        return True
    if newest is not None:
        replies_interrupt(conversation=conversation, up_to_id=newest)
    return False


@transaction.atomic
def reply_finish_replacing(
    *,
    conversation: Conversation,
    message: Message,
    replaced_ids: list[int],
    edit: tuple[int, str] | None = None,
    **outcome: Any,
) -> bool:
    """``reply_finish`` and ``reply_replace`` in one transaction: a failure (or a process
    dying) between the two would leave the new answer beside the one it replaces."""
    reply_finish(message=message, **outcome)
    return reply_replace(
        conversation=conversation, reply=message, replaced_ids=replaced_ids, edit=edit
    )


@transaction.atomic
def reply_finish(
    *,
    message: Message,
    content: str,
    status: str,
    finish_reason: str = "",
    error_code: str = "",
    error_message: str = "",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
) -> Message:
    """Save what the reply became: complete, stopped (partial text kept) or failed."""
    if status not in Message.Status.values:
        raise ValidationError({"status": f"Unknown status {status!r}."})
    message.content = _clean(content)
    message.status = status
    message.finish_reason = finish_reason
    message.error_code = error_code
    message.error_message = error_message
    message.prompt_tokens = prompt_tokens
    message.completion_tokens = completion_tokens
    fields = ("content", "status", "finish_reason", "error_code", "error_message",
              "prompt_tokens", "completion_tokens")  # fmt: skip
    # an update, not a save: a save of a row deleted meanwhile would insert it again
    if not Message.objects.filter(pk=message.pk).update(**{f: getattr(message, f) for f in fields}):
        raise ConversationDeleted(f"conversation {message.conversation_id} is gone")
    Conversation.objects.filter(pk=message.conversation_id).update(updated_at=timezone.now())
    return message


@transaction.atomic
def preference_set_tenant(*, user: AbstractBaseUser, tenant: Tenant) -> ChatPreference:
    if not user_tenants(user=user).filter(pk=tenant.pk).exists():
        raise ValidationError("You are not a member of this organization.")
    preference, _ = ChatPreference.objects.update_or_create(
        user=user, defaults={"tenant": tenant, "updated_at": timezone.now()}
    )
    return preference
