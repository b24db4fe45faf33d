"""Reads. Every selector of conversations takes the user and the tenant and filters by both,
so nobody ever reads another user's or another tenant's conversation."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from chat.models import ChatPreference, Conversation, Message
from inference_engine.protocol import Message as EngineMessage
from serving.selectors import deployments_for_tenant
from tenants.models import Tenant
from tenants.selectors import user_tenants

# where the session keeps the id of the tenant the user chose to chat as
SESSION_TENANT_KEY = "chat_tenant_id"


def conversation_list(*, user: AbstractBaseUser, tenant: Tenant, query: str = "") -> QuerySet:
    conversations = Conversation.objects.filter(user=user, tenant=tenant)
    if query.strip():
        conversations = conversations.filter(title__icontains=query.strip())
    return conversations.order_by("-updated_at", "-id")


def conversation_get(
    *, user: AbstractBaseUser, tenant: Tenant, conversation_id: int
) -> Conversation | None:
    return (
        Conversation.objects.select_related("tenant__plan")
        .filter(pk=conversation_id, user=user, tenant=tenant)
        .first()
    )


def conversation_messages(*, conversation: Conversation) -> QuerySet[Message]:
    return Message.objects.filter(
        conversation=conversation, tenant_id=conversation.tenant_id
    ).order_by("id")


def engine_messages(*, conversation: Conversation, before_id: int | None = None) -> list:
    """The conversation as the engine sees it: the system prompt first, then every turn with
    content (a failed or empty reply is left out), up to but excluding ``before_id``."""
    messages = []
    if conversation.system_prompt.strip():
        messages.append(EngineMessage("system", conversation.system_prompt))
    turns = conversation_messages(conversation=conversation)
    if before_id is not None:
        turns = turns.filter(id__lt=before_id)
    for turn in turns:
        if turn.content:
            messages.append(EngineMessage(turn.role, turn.content))
    return messages


def chat_models(*, tenant: Tenant) -> list[str]:
    """Names of the models the tenant's plan allows."""
    return list(deployments_for_tenant(tenant=tenant).values_list("name", flat=True))


def active_tenant(*, user: AbstractBaseUser, session_tenant_id: int | None) -> Tenant | None:
    """The tenant the user chats as: the session's choice, else the saved preference, else
    the only tenant they belong to. None when they belong to none, or must still choose."""
    tenants = user_tenants(user=user).select_related("plan")
    if session_tenant_id is not None:
        chosen = tenants.filter(pk=session_tenant_id).first()
        if chosen is not None:
            return chosen
    preference = ChatPreference.objects.filter(user=user).only("tenant_id").first()
    if preference is not None:
        chosen = tenants.filter(pk=preference.tenant_id).first()
        if chosen is not None:
            return chosen
    first_two = list(tenants[:2])
    return first_two[0] if len(first_two) == 1 else None
