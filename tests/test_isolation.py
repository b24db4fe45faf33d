"""Tenant isolation, as a matrix: for every object tenant B ("bravo") owns — its
conversations and their messages, usage records and the pages drawn from them, API keys,
members, the model its plan alone may use — and every URL, endpoint and socket frame that
reaches it, tenant A's ("alpha") API key, A's ordinary member and A's admin are refused
(404, 403, 401, 400, or a redirect to sign in) and no response ever carries B's data.

Pages go through Django's test client with CSRF checks off, so what refuses is the view's own
check, not a missing token. The API goes through the ASGI application as Daphne runs it.

To cover a new URL, add a ``Probe`` to ``PAGES`` or ``API`` with what each actor gets (and,
for a POST, a check that B's object is unchanged); a new socket frame goes in ``FRAMES``.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser
from django.test import Client
from django.urls import reverse

from chat import services as chat_services
from chat.models import Conversation, Message
from serving.models import ModelDeployment
from serving.services import deployment_register
from tenants import invitations, rollups, services
from tenants.models import ApiKey, Invitation, Membership, Plan, Tenant, UsageRecord
from tests.asgi_client import asgi_request
from tests.chat.conftest import open_chat, session_cookie
from tests.usage_records import usage_record_add

ACTORS = ("key", "member", "admin")  # alpha's API key, ordinary member and admin
BRAVO_MODEL = "bravo-only-model"  # a deployment only bravo's plan may use
# What no response to alpha may contain: bravo's names, key, conversation, usage and people.
BRAVO_MARKERS = (
    "Bravo Secret Corp",
    "bravo-key-secret",
    "Bravo conversation secret",
    "bravo message secret",
    "bravo-usage-model",
    "bravo-owner-secret",
    "bravo-member-secret",
    BRAVO_MODEL,
)


@dataclass
class World:
    alpha: Tenant
    bravo: Tenant
    users: dict[str, AbstractBaseUser]  # "member" and "admin" of alpha, and bravo's people
    alpha_raw_key: str
    bravo_key: ApiKey
    bravo_membership: Membership
    bravo_conversation: Conversation
    bravo_message: Message
    own_conversations: dict[str, Conversation]  # alpha's member's and admin's own
    bravo_invitation: Invitation


def _usage(tenant: Tenant, api_key: ApiKey, model: str) -> None:
    now = datetime.now(UTC)
    for n in range(3):
        usage_record_add(
            request_id=f"{tenant.slug}-{n}",
            tenant=tenant,
            api_key=api_key,
            model=model,
            source=UsageRecord.Source.API,
            status=UsageRecord.Status.OK,
            started_at=now,
            finished_at=now,
            prompt_tokens=10,
            completion_tokens=20,
        )


@pytest.fixture
def world(db, django_user_model) -> World:
    return _build_world(django_user_model)


@pytest.fixture
def async_world(async_db, django_user_model) -> World:
    """The world for async tests, which read it from other threads: committed."""
    return _build_world(django_user_model)


def _build_world(django_user_model) -> World:
    # no passwords (the hashing is slow): everybody signs in with force_login
    users = {
        name: django_user_model.objects.create_user(username)
        for name, username in [
            ("member", "alpha-member"),
            ("admin", "alpha-admin"),
            ("owner", "alpha-owner"),
            ("bravo_owner", "bravo-owner-secret"),
            ("bravo_member", "bravo-member-secret"),
        ]
    }
    alpha_plan = Plan.objects.create(slug="alpha-plan", name="Alpha plan")
    bravo_plan = Plan.objects.create(slug="bravo-plan", name="Bravo plan")
    deployment_register(name="shared-model", endpoints=["ipc:///tmp/isolation-shared.sock"])
    bravo_only = deployment_register(name=BRAVO_MODEL, endpoints=["ipc:///tmp/isolation-b.sock"])
    bravo_only.plans.add(bravo_plan)

    alpha = services.tenant_create(
        slug="alpha", name="Alpha", plan=alpha_plan, owner=users["owner"]
    )
    for role in ("member", "admin"):
        services.membership_set(tenant=alpha, user=users[role], role=role, actor=None)
    bravo = services.tenant_create(
        slug="bravo", name="Bravo Secret Corp", plan=bravo_plan, owner=users["bravo_owner"]
    )
    bravo_membership = services.membership_set(
        tenant=bravo, user=users["bravo_member"], role="member", actor=None
    )

    alpha_key, alpha_raw_key = services.api_key_create(tenant=alpha, name="alpha-key")
    bravo_key, _ = services.api_key_create(tenant=bravo, name="bravo-key-secret")
    _usage(alpha, alpha_key, "shared-model")
    _usage(bravo, bravo_key, "bravo-usage-model")
    rollups.rollup_pending()

    bravo_conversation = chat_services.conversation_create(
        user=users["bravo_owner"],
        tenant=bravo,
        model=BRAVO_MODEL,
        title="Bravo conversation secret",
    )
    bravo_message = chat_services.message_send(
        conversation=bravo_conversation, content="bravo message secret"
    )
    own = {
        role: chat_services.conversation_create(user=users[role], tenant=alpha)
        for role in ("member", "admin")
    }
    bravo_invitation, _ = invitations.invitation_create(
        tenant=bravo, role="member", actor=users["bravo_owner"]
    )
    return World(
        alpha=alpha,
        bravo=bravo,
        users=users,
        alpha_raw_key=alpha_raw_key,
        bravo_key=bravo_key,
        bravo_membership=bravo_membership,
        bravo_conversation=bravo_conversation,
        bravo_message=bravo_message,
        own_conversations=own,
        bravo_invitation=bravo_invitation,
    )


@dataclass(frozen=True)
class Probe:
    """One request an actor of alpha makes towards bravo's data."""

    name: str
    method: str  # "GET" or "POST"
    url: Callable[[World, str], str]  # (world, actor) -> path
    expect: dict[str, int | frozenset[int]]  # actor -> status (or the statuses it may be)
    data: Callable[[World], dict] = lambda w: {}
    unchanged: Callable[[World], bool] = lambda w: True  # bravo's object after the request
    echoed: tuple[str, ...] = ()  # markers the actor itself sent, which may come back
    markers: tuple[str, ...] = field(default=BRAVO_MARKERS)


def _is(key: int | frozenset[int], users: int | frozenset[int]) -> dict:
    return {"key": key, "member": users, "admin": users}


SIGN_IN = 302  # to a login page: the probe is not signed in as anybody who may see it
REFUSED = _is(SIGN_IN, 404)  # a console or chat page: 404 hides whether it exists
ADMIN_ONLY = {"key": SIGN_IN, "member": 404, "admin": 200}  # alpha's own console pages
STAFF_ONLY = _is(SIGN_IN, SIGN_IN)


def _console(name: str, tenant: str = "bravo") -> Callable[[World, str], str]:
    return lambda w, actor: reverse(f"console:{name}", args=[getattr(w, tenant).slug])


def _bravo_chat(name: str) -> Callable[[World, str], str]:
    return lambda w, actor: reverse(f"chat:{name}", args=[w.bravo_conversation.pk])


def _bravo_key_live(w: World) -> bool:
    return not ApiKey.objects.get(pk=w.bravo_key.pk).is_revoked


def _bravo_members_unchanged(w: World) -> bool:
    return dict(Membership.objects.filter(tenant=w.bravo).values_list("user_id", "role")) == {
        w.users["bravo_owner"].pk: "owner",
        w.users["bravo_member"].pk: "member",
    }


def _bravo_invitations_unchanged(w: World) -> bool:
    return [i.pk for i in invitations.tenant_invitations_open(tenant=w.bravo)] == [
        w.bravo_invitation.pk
    ]


def _bravo_conversation_unchanged(w: World) -> bool:
    conversation = Conversation.objects.filter(pk=w.bravo_conversation.pk).first()
    return conversation is not None and conversation.title == "Bravo conversation secret"


PAGES = [
    # bravo's console, each page and action
    Probe("dashboard", "GET", _console("dashboard"), REFUSED),
    Probe("dashboard by key", "GET", lambda w, a: _console("dashboard")(w, a) + "?group=key",
          REFUSED),
    Probe("usage csv", "GET", _console("usage-csv"), REFUSED),
    Probe("keys", "GET", _console("keys"), REFUSED),
    Probe("create a key", "POST", _console("keys"), REFUSED,
          data=lambda w: {"action": "create", "name": "intruder"},
          unchanged=lambda w: ApiKey.objects.filter(tenant=w.bravo).count() == 1),
    Probe("revoke a key", "POST", _console("keys"), REFUSED,
          data=lambda w: {"action": "revoke", "key_id": w.bravo_key.pk},
          unchanged=_bravo_key_live),
    Probe("members", "GET", _console("members"), REFUSED),
    Probe("invite to bravo", "POST", _console("members"), REFUSED,
          data=lambda w: {"action": "invite", "role": "owner", "expires_in_days": 7,
                          "form_token": "t"},
          unchanged=_bravo_invitations_unchanged),
    Probe("revoke bravo's invitation", "POST", _console("members"), REFUSED,
          data=lambda w: {"action": "revoke_invitation", "invitation_id": w.bravo_invitation.pk},
          unchanged=_bravo_invitations_unchanged),
    Probe("change a role", "POST", _console("members"), REFUSED,
          data=lambda w: {"action": "role", "membership_id": w.bravo_membership.pk,
                          "role": "owner"},
          unchanged=_bravo_members_unchanged),
    Probe("remove a member", "POST", _console("members"), REFUSED,
          data=lambda w: {"action": "remove", "membership_id": w.bravo_membership.pk},
          unchanged=_bravo_members_unchanged),
    # bravo's objects through alpha's own console
    Probe("revoke bravo's key from alpha", "POST", _console("keys", "alpha"), REFUSED,
          data=lambda w: {"action": "revoke", "key_id": w.bravo_key.pk},
          unchanged=_bravo_key_live),
    Probe("change bravo's member from alpha", "POST", _console("members", "alpha"), REFUSED,
          data=lambda w: {"action": "role", "membership_id": w.bravo_membership.pk,
                          "role": "admin"},
          unchanged=_bravo_members_unchanged),
    Probe("remove bravo's member from alpha", "POST", _console("members", "alpha"), REFUSED,
          data=lambda w: {"action": "remove", "membership_id": w.bravo_membership.pk},
          unchanged=_bravo_members_unchanged),
    Probe("revoke bravo's invitation from alpha", "POST", _console("members", "alpha"),
          REFUSED,
          data=lambda w: {"action": "revoke_invitation", "invitation_id": w.bravo_invitation.pk},
          unchanged=_bravo_invitations_unchanged),
    # alpha's own pages show alpha's data only
    Probe("alpha's dashboard", "GET", _console("dashboard", "alpha"), ADMIN_ONLY),
    Probe("alpha's dashboard by key", "GET",
          lambda w, a: _console("dashboard", "alpha")(w, a) + "?group=key", ADMIN_ONLY),
    Probe("alpha's usage csv", "GET", _console("usage-csv", "alpha"), ADMIN_ONLY),
    Probe("alpha's keys", "GET", _console("keys", "alpha"), ADMIN_ONLY),
    Probe("alpha's members", "GET", _console("members", "alpha"), ADMIN_ONLY),
    Probe("console home", "GET", lambda w, a: reverse("console:home"),
          {"key": SIGN_IN, "member": 403, "admin": 302}),
    # every tenant's data: staff only
    Probe("platform console", "GET", lambda w, a: reverse("console:platform"), STAFF_ONLY),
    Probe("disable bravo's model", "POST", lambda w, a: reverse("console:deployment-action"),
          STAFF_ONLY,
          data=lambda w: {"action": "disable",
                          "deployment_id": ModelDeployment.objects.get(name=BRAVO_MODEL).pk},
          unchanged=lambda w: ModelDeployment.objects.get(name=BRAVO_MODEL).is_enabled),
    Probe("admin: bravo", "GET",
          lambda w, a: reverse("admin:tenants_tenant_change", args=[w.bravo.pk]), STAFF_ONLY),
    Probe("admin: conversations", "GET",
          lambda w, a: reverse("admin:chat_conversation_changelist"), STAFF_ONLY),
    # bravo's conversation through the chat's pages
    Probe("conversation", "GET", _bravo_chat("conversation"), REFUSED),
    Probe("rename", "POST", _bravo_chat("rename"), REFUSED,
          data=lambda w: {"title": "renamed by alpha"}, unchanged=_bravo_conversation_unchanged),
    Probe("delete", "POST", _bravo_chat("delete"), REFUSED,
          unchanged=_bravo_conversation_unchanged),
    Probe("chat as bravo", "POST", lambda w, a: reverse("chat:tenant"), REFUSED,
          data=lambda w: {"tenant": w.bravo.pk}),
    Probe("new conversation on bravo's model", "POST", lambda w, a: reverse("chat:new"),
          _is(SIGN_IN, 400), data=lambda w: {"model": BRAVO_MODEL}, echoed=(BRAVO_MODEL,),
          unchanged=lambda w: not Conversation.objects.filter(
              tenant=w.alpha, model=BRAVO_MODEL).exists()),
    # alpha's own chat pages: neither bravo's conversations nor bravo's model
    Probe("chat home", "GET", lambda w, a: reverse("chat:home"), _is(SIGN_IN, 200)),
    Probe("own conversation", "GET",
          lambda w, a: reverse("chat:conversation",
                               args=[w.own_conversations.get(a, w.bravo_conversation).pk]),
          _is(SIGN_IN, 200)),
]  # fmt: skip


def _page_client(world: World, actor: str) -> Client:
    client = Client()
    if actor == "key":  # a key is no way into the pages
        client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {world.alpha_raw_key}"
    else:
        client.force_login(world.users[actor])
    return client


def _check(probe: Probe, actor: str, status: int, location: str, body: str) -> None:
    expected = probe.expect[actor]
    assert status in (expected if isinstance(expected, frozenset) else {expected}), body[:2000]
    if status == 302:  # to sign in, or to a page of alpha's
        assert "/login/" in location or "bravo" not in location, location
    leaked = [m for m in probe.markers if m in body and m not in probe.echoed]
    assert not leaked, f"{probe.name}: bravo's {leaked} shown to alpha's {actor}"


@pytest.mark.parametrize("actor", ACTORS)
@pytest.mark.parametrize("probe", PAGES, ids=lambda probe: probe.name)
def test_pages_refuse_alpha_bravos_data(world, probe, actor):
    client = _page_client(world, actor)
    if probe.method == "GET":
        response = client.get(probe.url(world, actor))
    else:
        response = client.post(probe.url(world, actor), probe.data(world))
    body = b"".join(response) if response.streaming else response.content
    _check(probe, actor, response.status_code, response.get("Location", ""), body.decode())
    assert probe.unchanged(world), f"{probe.name} changed bravo's data"


def _api_body(model_field: str) -> Callable[[World], dict]:
    if model_field == "messages":
        return lambda w: {"model": BRAVO_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return lambda w: {"model": BRAVO_MODEL, "prompt": "hi"}


READINESS = frozenset({200, 503})
API_REFUSED = _is(404, 401)  # a user's session is no way into the API

API = [
    Probe("models", "GET", lambda w, a: "/v1/models", _is(200, 401)),
    Probe("bravo's model", "GET", lambda w, a: f"/v1/models/{BRAVO_MODEL}", API_REFUSED,
          echoed=(BRAVO_MODEL,)),
    Probe("chat completion on bravo's model", "POST", lambda w, a: "/v1/chat/completions",
          API_REFUSED, data=_api_body("messages"), echoed=(BRAVO_MODEL,)),
    Probe("completion on bravo's model", "POST", lambda w, a: "/v1/completions", API_REFUSED,
          data=_api_body("prompt"), echoed=(BRAVO_MODEL,)),
    # readiness is for anybody: it names no deployment, bravo's plan-only model included;
    # ready or not is the platform's state (503 here, with no engine; 200 on a live platform,
    # where bench/reliability.py sends this matrix), the same whoever asks
    Probe("readiness", "GET", lambda w, a: "/health/ready", _is(READINESS, READINESS)),
]  # fmt: skip


async def _asgi(
    method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, str]:
    """One request through the ASGI application: (status, body)."""
    status, _, content = await asgi_request(method, path, headers=headers, body=body)
    return status, content.decode()


@pytest.mark.parametrize("actor", ACTORS)
@pytest.mark.parametrize("probe", API, ids=lambda probe: probe.name)
async def test_the_api_refuses_alpha_bravos_data(async_world, probe, actor):
    world = async_world
    if actor == "key":
        headers = {"authorization": f"Bearer {world.alpha_raw_key}"}
    else:  # a signed-in browser's cookie, which the API must not take for a key
        cookie = await sync_to_async(session_cookie)(world.users[actor])
        headers = {"cookie": cookie.decode()}
    body = b""
    if probe.method == "POST":
        headers["content-type"] = "application/json"
        body = json.dumps(probe.data(world)).encode()
    status, content = await _asgi(probe.method, probe.url(world, actor), headers, body)
    _check(probe, actor, status, "", content)


# --- the chat socket ----------------------------------------------------------------------


@pytest.mark.parametrize(("actor", "code"), [("key", 4401), ("member", 4403), ("admin", 4403)])
async def test_the_socket_of_bravos_conversation_refuses_alpha(async_world, actor, code):
    world = async_world
    user = None if actor == "key" else world.users[actor]  # a key is no way into the socket
    connected, close_code, _ = await open_chat(user, world.bravo_conversation.pk)
    assert (connected, close_code) == (False, code)


FRAMES = {
    "edit bravo's message": lambda w: {
        "type": "edit",
        "message_id": w.bravo_message.pk,
        "content": "rewritten by alpha",
    },
    "switch to bravo's model": lambda w: {"type": "settings", "model": BRAVO_MODEL},
}


@pytest.mark.parametrize("actor", ["member", "admin"])
@pytest.mark.parametrize("frame", FRAMES)
async def test_alphas_own_socket_cannot_reach_bravos_objects(async_world, actor, frame):
    world = async_world
    connected, _, chat = await open_chat(world.users[actor], world.own_conversations[actor].pk)
    assert connected
    await chat.send(**FRAMES[frame](world))
    error = await chat.receive()
    await chat.close()
    assert (error["type"], error["code"]) == ("error", "invalid_request")
    leaked = [m for m in BRAVO_MARKERS if m in json.dumps(error) and m != BRAVO_MODEL]
    assert not leaked

    @sync_to_async
    def unchanged() -> bool:
        message = Message.objects.get(pk=world.bravo_message.pk)
        own = Conversation.objects.get(pk=world.own_conversations[actor].pk)
        return message.content == "bravo message secret" and own.model != BRAVO_MODEL

    assert await unchanged()
