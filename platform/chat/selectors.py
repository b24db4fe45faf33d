"""Reads. Every selector of conversations takes the user and the tenant and filters by both,
so nobody ever reads another user's or another tenant's conversation."""

from importlib import import_module

from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from chat.models import ChatPreference, Conversation, Message
from config.json_text import NUL
from inference_engine.protocol import Message as EngineMessage
from serving.selectors import deployments_for_tenant
from tenants.models import Tenant
from tenants.selectors import user_tenants

# where the session keeps the id of the tenant the user chose to chat as
SESSION_TENANT_KEY = "chat_tenant_id"


def conversation_list(
    *, user: AbstractBaseUser, tenant: Tenant, query: str = "", keep_id: int | None = None
) -> QuerySet:
    """The user's conversations with at least one message (an empty one is not worth a place
    in the list), and ``keep_id``'s, the one open, even while it is empty."""
    conversations = Conversation.objects.filter(user=user, tenant=tenant).filter(
        Q(Exists(Message.objects.filter(conversation=OuterRef("pk")))) | Q(pk=keep_id)
    )
    query = query.replace(NUL, "").strip()  # as titles are kept (and the database refuses it)
    if query:
        conversations = conversations.filter(title__icontains=query)
    return conversations.order_by("-updated_at", "-id")


def conversation_get(
    *, user: AbstractBaseUser, tenant: Tenant, conversation_id: int
) -> Conversation | None:
    return (
        Conversation.objects.select_related("tenant__plan")
        .filter(pk=conversation_id, user=user, tenant=tenant)
        .first()
    )


def conversation_exists(*, conversation_id: int) -> bool:
    """Whether a conversation of that id exists, whoever's: for a socket already opened on
    it by its owner, to tell a deletion from a loss of access."""
    return Conversation.objects.filter(pk=conversation_id).exists()


def conversation_messages(*, conversation: Conversation) -> QuerySet[Message]:
    return Message.objects.filter(
        conversation=conversation, tenant_id=conversation.tenant_id
    ).order_by("id")


def engine_messages(
    *,
    conversation: Conversation,
    before_id: int | None = None,
    edited: tuple[int, str] | None = None,
) -> list:
    """The conversation as the engine sees it: the system prompt first, then every turn with
    content, up to but excluding ``before_id``. A failed reply is left out, also the text it
    had streamed before it failed (a stopped one stays: the user chose where it ends).

    Turns of one role in a row (the user's messages on either side of a reply left out) are
    one turn, their texts a paragraph apart: many models' chat templates (Llama 2's,
    Mistral's, Gemma's) refuse roles that do not alternate, and every later message of the
    conversation failed there."""
    messages = []
    if conversation.system_prompt.strip():
        messages.append(EngineMessage("system", conversation.system_prompt))
    turns = conversation_messages(conversation=conversation)
    if before_id is not None:
        turns = turns.filter(id__lt=before_id)
    for turn in turns:
        content = edited[1] if edited is not None and turn.pk == edited[0] else turn.content
        if not content or turn.status == Message.Status.ERROR:
            continue
        if messages and messages[-1].role == turn.role:
            messages[-1] = EngineMessage(turn.role, f"{messages[-1].content}\n\n{content}")
        else:
            messages.append(EngineMessage(turn.role, content))
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


def session_user(*, session_key: str | None, user_id: int) -> AbstractBaseUser | None:
    """The user ``user_id``, reloaded, if ``session_key`` still signs them in: the session is
    live (logging out deletes it), still theirs, still carries their password's hash (a
    password change signs other sessions out), and the user is active. None otherwise.

    One query with a database-backed session store (the user's row with the session's data
    beside it): cheap enough for an open socket to ask on every frame."""
    if not session_key:
        return None
    store = import_module(settings.SESSION_ENGINE).SessionStore
    users = get_user_model().objects.filter(pk=user_id, is_active=True)
    if hasattr(store, "get_model_class"):  # the db and cached_db engines
        live = store.get_model_class().objects.filter(
            session_key=session_key, expire_date__gt=timezone.now()
        )
        user = users.annotate(session_data=Subquery(live.values("session_data")[:1])).first()
        data = store().decode(user.session_data) if user and user.session_data else {}
    else:
        data, user = store(session_key=session_key).load(), users.first()
    if user is None or data.get(SESSION_KEY) != str(user.pk):
        return None
    session_hash = data.get(HASH_SESSION_KEY) or ""
    hashes = [user.get_session_auth_hash(), *user.get_session_auth_fallback_hash()]
    if not any(constant_time_compare(session_hash, known) for known in hashes):
        return None
    return user
