"""Pages of the chat. Thin: they resolve the user's tenant, read through ``chat.selectors``
and write through ``chat.services``; the conversation itself talks over the WebSocket."""

import logging
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from chat import selectors, services
from chat.examples import example_prompts
from chat.payloads import message_payload, settings_payload
from chat.selectors import SESSION_TENANT_KEY
from config.numerals import parse_count
from console.permissions import console_tenants
from serving.runs import UNREACHABLE_STORE_ERRORS
from tenants.models import Tenant
from tenants.selectors import user_tenants

logger = logging.getLogger(__name__)


def with_tenant(view):
    """Resolve the tenant the user chats as, or show why there is none to chat as."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        tenant = selectors.active_tenant(
            user=request.user, session_tenant_id=request.session.get(SESSION_TENANT_KEY)
        )
        if tenant is None:
            tenants = list(user_tenants(user=request.user))
            template = "chat/choose_tenant.html" if tenants else "chat/no_tenant.html"
            return render(request, template, {"tenants": tenants}, status=200)
        if request.session.get(SESSION_TENANT_KEY) != tenant.pk:
            request.session[SESSION_TENANT_KEY] = tenant.pk
        return view(request, tenant, *args, **kwargs)

    return wrapper


def _conversation_or_404(request: HttpRequest, tenant: Tenant, conversation_id: int):
    conversation = selectors.conversation_get(
        user=request.user, tenant=tenant, conversation_id=conversation_id
    )
    if conversation is None:
        raise Http404("No such conversation.")
    return conversation


def _not_found(request: HttpRequest) -> HttpResponse:
    """The chat's own 404 page (also under DEBUG, where Django would show its debug page)."""
    return render(request, "chat/not_found.html", status=404)


def _page(request: HttpRequest, tenant: Tenant, conversation=None) -> HttpResponse:
    query = request.GET.get("q", "")
    models = selectors.chat_models(tenant=tenant)
    context = {
        "tenant": tenant,
        "tenants": list(user_tenants(user=request.user)),
        "conversations": selectors.conversation_list(
            user=request.user,
            tenant=tenant,
            query=query,
            keep_id=conversation.pk if conversation is not None else None,
        ),
        "query": query,
        "conversation": conversation,
        "models": models,
        "examples": example_prompts(models=models),
        "has_console": console_tenants(user=request.user).exists(),
        # the fields hold no more than the socket takes: past it, a refusal would say why
        "max_content_chars": services.MAX_CONTENT_CHARS,
        "max_system_prompt_chars": services.MAX_SYSTEM_PROMPT_CHARS,
    }
    if conversation is not None:
        try:
            services.replies_interrupt_unless_claimed(conversation=conversation)
        except UNREACHABLE_STORE_ERRORS:  # Redis down: a reply left streaming waits for a sync
            logger.warning("conversation %s: could not look for its claim", conversation.pk)
        context["chat_state"] = {
            "conversation_id": conversation.pk,
            "settings": settings_payload(conversation),
            "messages": [
                message_payload(m)
                for m in selectors.conversation_messages(conversation=conversation)
            ],
            "models": context["models"],
        }
    return render(request, "chat/chat.html", context)


@with_tenant
def chat_home(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    return _page(request, tenant)


@with_tenant
def conversation_detail(request: HttpRequest, tenant: Tenant, conversation_id: int):
    try:
        conversation = _conversation_or_404(request, tenant, conversation_id)
    except Http404:
        return _not_found(request)
    return _page(request, tenant, conversation)


@require_POST
@with_tenant
def conversation_new(request: HttpRequest, tenant: Tenant) -> HttpResponse:
    try:
        conversation = services.conversation_create(
            user=request.user, tenant=tenant, model=request.POST.get("model", "")
        )
    except ValidationError as exc:
        return JsonResponse({"error": " ".join(exc.messages)}, status=400)
    url = reverse("chat:conversation", args=[conversation.pk])
    if request.headers.get("Accept") == "application/json":
        return JsonResponse({"id": conversation.pk, "url": url}, status=201)
    return redirect(url)


@require_POST
@with_tenant
def conversation_rename(request: HttpRequest, tenant: Tenant, conversation_id: int):
    conversation = _conversation_or_404(request, tenant, conversation_id)
    try:
        services.conversation_rename(conversation=conversation, title=request.POST.get("title", ""))
    except ValidationError as exc:
        return JsonResponse({"error": " ".join(exc.messages)}, status=400)
    if request.headers.get("Accept") == "application/json":
        return JsonResponse({"id": conversation.pk, "title": conversation.title})
    return redirect("chat:conversation", conversation.pk)


@require_POST
@with_tenant
def conversation_delete(request: HttpRequest, tenant: Tenant, conversation_id: int):
    conversation = _conversation_or_404(request, tenant, conversation_id)
    services.conversation_delete(conversation=conversation)
    return redirect("chat:home")


@require_POST
@login_required
def tenant_choose(request: HttpRequest) -> HttpResponse:
    tenant_id = parse_count(request.POST.get("tenant"))
    tenant = (
        None if tenant_id is None else user_tenants(user=request.user).filter(pk=tenant_id).first()
    )
    if tenant is None:
        raise Http404("You are not a member of that organization.")
    services.preference_set_tenant(user=request.user, tenant=tenant)
    request.session[SESSION_TENANT_KEY] = tenant.pk
    return redirect("chat:home")
