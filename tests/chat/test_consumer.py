"""The chat WebSocket with a real engine: who may connect, streaming, stop (before and after
the first token), disconnect, regenerate, edit, quota refusals and malformed frames."""

import asyncio
import contextlib
import json

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache, caches

from chat import claims, selectors, services
from chat.models import Conversation, Message
from inference_engine.client import AsyncEngineClient
from tenants import quotas
from tenants import services as tenant_services
from tenants.models import Tenant, UsageRecord
from tests.chat.conftest import (
    MODEL_NAME,
    Chat,
    engine_paused,
    open_chat,
    run_paused_engine_until,
    session_cookie,
)
from tests.gateway.conftest import MAX_MODEL_LEN

LONG_REPLY_TOKENS = 200


@sync_to_async
def _messages(conversation) -> list[Message]:
    return list(Message.objects.filter(conversation=conversation).order_by("id"))


@sync_to_async
def _records(tenant) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(tenant=tenant).order_by("started_at"))


@sync_to_async
def _configure(conversation, **settings) -> None:
    services.conversation_configure(conversation=conversation, **settings)


async def _engine_idle(endpoint: str) -> bool:
    client = AsyncEngineClient(endpoint)
    try:
        for _ in range(100):
            stats = await client.stats(timeout=5)
            if stats.num_requests_running == 0 and stats.num_requests_waiting == 0:
                return True
            await asyncio.sleep(0.1)
        return False
    finally:
        client.close()


async def test_anonymous_users_are_refused(chat_world, async_db):
    connected, code, _ = await open_chat(None, chat_world["conversation"].pk)
    assert not connected
    assert code == 4401


async def test_only_the_owner_may_connect(chat_world, async_db, django_user_model):
    conversation, acme = chat_world["conversation"], chat_world["tenant"]

    @sync_to_async
    def make_users():
        bob = django_user_model.objects.create_user("bob", password="x-password-1")
        tenant_services.membership_set(tenant=acme, user=bob, role="admin", actor=None)
        carol = django_user_model.objects.create_user("carol", password="x-password-2")
        globex = tenant_services.tenant_create(slug="globex", plan=chat_world["plan"], owner=carol)
        return bob, carol, globex

    bob, carol, _ = await make_users()
    for intruder in (bob, carol):
        connected, code, _ = await open_chat(intruder, conversation.pk)
        assert (connected, code) == (False, 4403)
    for missing in (987654321, 10**30):
        connected, code, _ = await open_chat(chat_world["user"], missing)
        assert (connected, code) == (False, 4403)


async def test_a_conversation_of_another_tenant_of_the_same_user_is_refused(chat_world, async_db):
    alice = chat_world["user"]

    @sync_to_async
    def other_conversation():
        globex = tenant_services.tenant_create(slug="globex", plan=chat_world["plan"], owner=alice)
        # Alice now has two tenants and has chosen Acme: Globex's conversations are closed.
        services.preference_set_tenant(user=alice, tenant=chat_world["tenant"])
        return services.conversation_create(user=alice, tenant=globex)

    conversation = await other_conversation()
    connected, code, _ = await open_chat(alice, conversation.pk)
    assert (connected, code) == (False, 4403)


async def test_send_streams_a_reply_that_is_saved_and_metered(chat_world, async_db, monkeypatch):
    conversation, tenant = chat_world["conversation"], chat_world["tenant"]
    await _configure(conversation, system_prompt="You are terse.")
    await sync_to_async(
        lambda: (
            type(tenant.plan)
            .objects.filter(pk=tenant.plan_id)
            .update(service_tier="interactive", share=2.0)
        )
    )()
    sent = []
    original = AsyncEngineClient.generate

    def spy(self, request):
        sent.append(request)
        return original(self, request)

    monkeypatch.setattr(AsyncEngineClient, "generate", spy)

    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    assert connected
    await chat.send(type="send", content="Hello there")
    done, frames = await chat.receive_until("done", "error")
    await chat.close()

    assert done["type"] == "done", done
    kinds = [f["type"] for f in frames]
    assert kinds[:3] == ["message", "settings", "start"]
    assert kinds[-1] == "done" and set(kinds[3:-1]) <= {"token"}
    assert frames[0]["message"]["content"] == "Hello there"
    assert frames[1]["settings"]["title"] == "Hello there"
    assert done["status"] == "complete"
    assert done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 8
    assert done["usage"]["prompt_tokens"] > 0

    user_message, reply = await _messages(conversation)
    assert (user_message.role, user_message.content) == ("user", "Hello there")
    assert reply.pk == done["message_id"] == frames[2]["message_id"]
    assert reply.status == "complete"
    assert reply.content == "".join(f["text"] for f in frames if f["type"] == "token")
    assert reply.completion_tokens == 8

    [request] = sent
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "You are terse."),
        ("user", "Hello there"),
    ]
    # each user's own prefix cache: another member's cached tokens would tell what they sent
    assert request.cache_salt == f"tenant-{tenant.pk}-user-{chat_world['user'].pk}"
    assert request.tenant_id == str(tenant.pk)
    assert (request.priority, request.tenant_weight) == (0, 2.0)  # the tenant's tier and share
    assert request.params.temperature == 0.0

    [record] = await _records(tenant)
    assert record.source == UsageRecord.Source.CHAT
    assert record.user_id == chat_world["user"].pk and record.api_key_id is None
    assert record.status == UsageRecord.Status.OK
    assert record.request_id == reply.request_id
    assert record.completion_tokens == 8 and record.prompt_tokens == done["usage"]["prompt_tokens"]


async def test_stop_before_the_first_token(chat_world, async_db):
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Tell me a long story")
    await chat.send(type="stop")
    done, frames = await chat.receive_until("done", "error")

    assert [f["type"] for f in frames] == ["message", "settings", "start", "done"]
    assert done["status"] == "stopped"
    _, reply = await _messages(conversation)
    assert (reply.status, reply.content) == ("stopped", "")
    assert all(r.status == "cancelled" for r in await _records(chat_world["tenant"]))

    # The socket stays usable, and the conversation is free again.
    await _configure(conversation, max_tokens=4)
    await chat.send(type="send", content="And now a short one")
    done, _ = await chat.receive_until("done", "error")
    assert done["type"] == "done" and done["status"] == "complete"
    await chat.close()


async def test_a_stop_whose_cancel_was_swallowed_still_ends_the_reply(
    chat_world, async_db, monkeypatch
):
    """Python 3.11's ``asyncio.wait_for`` swallows a cancel that lands as what it waits for
    finishes: the stop was lost and the reply streamed to its end (a stop asked twice was
    not sent again, to keep the task's cancel count at one)."""
    from chat import consumers

    async def reply_that_swallows_a_cancel(*, on_text, **kwargs):
        with contextlib.suppress(asyncio.CancelledError):  # as wait_for may
            await asyncio.sleep(0.5)
        for n in range(50):
            await on_text(f"t{n} ")
            await asyncio.sleep(0.01)

    monkeypatch.setattr(consumers, "generate_reply", reply_that_swallows_a_cancel)
    conversation = chat_world["conversation"]
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Tell me a long story")
    await chat.receive_until("start")
    await chat.send(type="stop")
    done, frames = await chat.receive_until("done", "error")
    await chat.close()

    assert done["type"] == "done" and done["status"] == "stopped"
    assert [f["type"] for f in frames] == ["done"]  # no token after the stop


async def test_stop_after_the_first_token_keeps_the_partial_reply(
    chat_world, async_db, ready_engine
):
    conversation, tenant = chat_world["conversation"], chat_world["tenant"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        first_token, frames = await run_paused_engine_until(ready_engine, chat, "token")
        assert [f["type"] for f in frames].count("token") == 1
        await chat.send(type="stop")
        done, frames = await chat.receive_until("done", "error")
    await chat.close()

    assert done["type"] == "done" and done["status"] == "stopped"
    streamed = first_token["text"] + "".join(f["text"] for f in frames if f["type"] == "token")
    _, reply = await _messages(conversation)
    assert reply.status == "stopped"
    assert reply.content == streamed and reply.content
    assert 1 <= reply.completion_tokens < LONG_REPLY_TOKENS
    [record] = await _records(tenant)
    assert record.status == UsageRecord.Status.CANCELLED
    assert record.source == UsageRecord.Source.CHAT
    assert record.completion_tokens == reply.completion_tokens
    assert await _engine_idle(await sync_to_async(_endpoint)(chat_world))


def _endpoint(world) -> str:
    from serving.models import ModelDeployment

    return ModelDeployment.objects.get(name=MODEL_NAME).endpoints[0]


async def test_a_disconnect_aborts_the_engine_request_and_saves_the_partial_reply(
    chat_world, async_db, ready_engine
):
    conversation, tenant = chat_world["conversation"], chat_world["tenant"]
    endpoint = await sync_to_async(_endpoint)(chat_world)
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, chat, "token")
        await chat.close()

    _, reply = await _messages(conversation)
    assert reply.status == "stopped" and reply.content
    assert reply.completion_tokens < LONG_REPLY_TOKENS
    [record] = await _records(tenant)
    assert record.status == UsageRecord.Status.CANCELLED
    assert await _engine_idle(endpoint)


async def test_a_second_send_while_generating_is_refused(chat_world, async_db, ready_engine):
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, chat, "token")
        await chat.send(type="send", content="Interrupting")
        busy, _ = await chat.receive_until("error")
        assert busy["code"] == "busy" and "message_id" not in busy
        await chat.send(type="stop")
    done, _ = await chat.receive_until("done")
    await chat.close()
    assert done["status"] == "stopped"
    assert [m.content for m in await _messages(conversation)][0] == "Tell me a long story"
    assert len(await _messages(conversation)) == 2


async def test_regenerate_replaces_the_last_reply(chat_world, async_db):
    conversation, tenant = chat_world["conversation"], chat_world["tenant"]
    await _configure(conversation, temperature=1.0)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Hi")
    first, frames = await chat.receive_until("done")
    user_id = frames[0]["message"]["id"]
    await chat.send(type="regenerate")
    start, _ = await chat.receive_until("start")
    second, _ = await chat.receive_until("done")
    await chat.close()

    assert start["after_id"] == user_id
    assert second["message_id"] != first["message_id"]
    messages = await _messages(conversation)
    assert [(m.role, m.pk) for m in messages] == [
        ("user", user_id),
        ("assistant", second["message_id"]),
    ]
    assert messages[1].status == "complete"
    assert len(await _records(tenant)) == 2


async def test_edit_changes_a_message_drops_what_followed_and_resends(chat_world, async_db):
    conversation = chat_world["conversation"]
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="First question")
    _, frames = await chat.receive_until("done")
    first_id = frames[0]["message"]["id"]
    await chat.send(type="send", content="Second question")
    await chat.receive_until("done")

    await chat.send(type="edit", message_id=first_id, content="First question, reworded")
    done, frames = await chat.receive_until("done", "error")
    sync, _ = await chat.receive_until("sync")  # saved once the reply held an answer
    await chat.close()

    assert frames[0] == {
        "type": "message",
        "message": {**frames[0]["message"], "id": first_id, "content": "First question, reworded"},
    }
    assert frames[1]["type"] == "start" and frames[1]["after_id"] == first_id
    # the title was made from the first question: it follows the edit
    assert sync["settings"]["title"] == "First question, reworded"
    messages = await _messages(conversation)
    assert [(m.role, m.content) for m in messages][0] == ("user", "First question, reworded")
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].pk == done["message_id"] and messages[1].status == "complete"


async def test_a_quota_refusal_says_why_and_when_to_retry(chat_world, async_db):
    conversation, tenant = chat_world["conversation"], chat_world["tenant"]

    @sync_to_async
    def use_up_the_minute():
        Tenant.objects.filter(pk=tenant.pk).update(requests_per_minute=1)
        fresh = Tenant.objects.select_related("plan").get(pk=tenant.pk)
        ticket = quotas.admission_acquire(tenant=fresh, estimated_tokens=1)
        quotas.admission_release(ticket=ticket, actual_tokens=1)

    await use_up_the_minute()
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Hello")
    error, frames = await chat.receive_until("error", "done")

    assert [f["type"] for f in frames] == ["message", "settings", "start", "error"]
    assert error["code"] == "rate_limited"
    assert error["retry_after"] >= 1
    assert "requests per minute" in error["message"]
    assert f"try again in {quotas.format_wait(error['retry_after'])}." in error["message"]
    assert error["message_id"] == frames[2]["message_id"]
    _, reply = await _messages(conversation)
    assert (reply.status, reply.error_code) == ("error", "rate_limited")
    assert await _records(tenant) == []

    await chat.send(type="settings", temperature=0.5)
    settings, _ = await chat.receive_until("settings", "error")
    assert settings["type"] == "settings"

    # Once the window has passed, "retry" regenerates in place of the refused reply.
    await sync_to_async(cache.clear)()
    await chat.send(type="regenerate")
    done, _ = await chat.receive_until("done", "error")
    await chat.close()
    assert done["type"] == "done" and done["status"] == "complete"
    assert [(m.role, m.status) for m in await _messages(conversation)] == [
        ("user", "complete"),
        ("assistant", "complete"),
    ]
    assert len(await _records(tenant)) == 1


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("not json", "invalid_frame"),
        ("[1, 2]", "invalid_frame"),
        ("[" * 60_000 + "]" * 60_000, "invalid_frame"),
        ("[" * 30_000 + "]" * 30_000, "invalid_frame"),
        ('{"content": "no type"}', "invalid_frame"),
        ('{"type": 3}', "invalid_frame"),
        ('{"type": "dance"}', "unknown_type"),
        ('{"type": "__init__"}', "unknown_type"),
        ('{"type": "send", "content": 42}', "invalid_request"),
        ('{"type": "send", "content": "   "}', "invalid_request"),
        ('{"type": "edit", "message_id": "1", "content": "x"}', "invalid_request"),
        ('{"type": "edit", "message_id": 999999, "content": "x"}', "invalid_request"),
        ('{"type": "settings", "temperature": "hot"}', "invalid_request"),
        # an int past float's range: math.isfinite raised OverflowError, answered "unavailable"
        ('{"type": "settings", "temperature": 1' + "0" * 400 + "}", "invalid_request"),
        ('{"type": "settings", "max_tokens": 1' + "0" * 400 + "}", "invalid_request"),
        ('{"type": "settings", "max_tokens": 0}', "invalid_request"),
        ('{"type": "settings", "model": "gpt-99"}', "invalid_request"),
        ('{"type": "regenerate"}', "invalid_request"),
        (json.dumps({"type": "send", "content": "x" * 70_000}), "invalid_frame"),
        (json.dumps({"type": "send", "content": "x" * 40_000}), "invalid_request"),
    ],
)
async def test_malformed_frames_get_an_error_and_the_socket_stays_usable(
    chat_world, async_db, frame, code
):
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await chat.send_raw(frame)
    error = await chat.receive()
    assert error["type"] == "error" and error["code"] == code, error
    assert error["message"]
    await chat.send(type="settings", system_prompt="Still here.")
    settings = await chat.receive()
    await chat.close()
    assert settings == {
        "type": "settings",
        "settings": {**settings["settings"], "system_prompt": "Still here."},
    }
    assert await _messages(chat_world["conversation"]) == []


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        ('{"type": "send", "content": "hi \\ud800"}', "content"),
        ('{"type": "settings", "system_prompt": "be \\udfff nice"}', "system_prompt"),
        ('{"type": "settings", "model": "\\ud800"}', "model"),
        ('{"type": "edit", "message_id": 1, "content": "x\\udc00"}', "content"),
        ('{"type": "send", "content": "ok", "\\ud800": 1}', "\\ud800"),
    ],
)
async def test_a_lone_surrogate_in_any_field_is_refused_naming_it(
    chat_world, async_db, frame, field
):
    """Valid JSON that holds no Unicode text: an error frame naming the field (it crashed the
    socket with 1011 once, saving it), and the socket stays open."""
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await chat.send_raw(frame)
    error = await chat.receive()
    assert error["type"] == "error" and error["code"] == "invalid_request", error
    assert f"'{field}'" in error["message"] and "surrogate" in error["message"]
    await chat.send(type="settings", system_prompt="Still here \U0001f600.")
    settings = await chat.receive()
    await chat.close()
    assert settings["settings"]["system_prompt"] == "Still here \U0001f600."
    assert await _messages(chat_world["conversation"]) == []


async def test_a_binary_frame_gets_an_error(chat_world, async_db):
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await chat.communicator.send_to(bytes_data=b"\x00\x01")
    error = await chat.receive()
    await chat.close()
    assert error["code"] == "invalid_frame"


async def test_stop_when_nothing_is_generating_is_ignored(chat_world, async_db):
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await chat.send(type="stop")
    assert await chat.is_quiet()
    await chat.close()


async def test_losing_access_closes_an_open_socket(chat_world, async_db):
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    assert connected
    await sync_to_async(
        lambda: chat_world["tenant"].memberships.filter(user=chat_world["user"]).delete()
    )()
    await chat.send(type="send", content="Still there?")
    error = await chat.receive()
    assert (error["type"], error["code"]) == ("error", "forbidden")
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4403}
    assert await _messages(chat_world["conversation"]) == []


async def test_a_frame_on_a_conversation_deleted_in_another_window_closes_with_4404(
    chat_world, async_db
):
    """Deleted in another window with no reply running: the next frame here said "You no
    longer have access" (4403) where the page has a message for a deleted conversation."""
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    assert connected
    await sync_to_async(services.conversation_delete)(conversation=chat_world["conversation"])
    await chat.send(type="send", content="Still there?")
    error = await chat.receive()
    assert (error["type"], error["code"]) == ("error", "deleted")
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4404}


async def test_a_conversation_deleted_as_a_message_is_saved_closes_with_4404(
    chat_world, async_db, monkeypatch, caplog
):
    """Deleted between the frame's checks and the message's insert: the insert failed, and
    the socket answered "unavailable, try again" and logged a server error."""
    conversation = chat_world["conversation"]
    message_send = services.message_send

    def deleted_meanwhile(*, conversation, content):
        services.conversation_delete(conversation=Conversation.objects.get(pk=conversation.pk))
        return message_send(conversation=conversation, content=content)

    monkeypatch.setattr(services, "message_send", deleted_meanwhile)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Hello")
    error = await chat.receive()
    assert (error["type"], error["code"]) == ("error", "deleted")
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4404}
    assert "frame failed" not in caplog.text


async def test_a_member_removed_from_the_tenant_is_not_told_of_a_deletion(chat_world, async_db):
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)

    def removed_then_deleted():
        chat_world["tenant"].memberships.filter(user=chat_world["user"]).delete()
        services.conversation_delete(conversation=chat_world["conversation"])

    await sync_to_async(removed_then_deleted)()
    await chat.send(type="send", content="Still there?")
    error = await chat.receive()
    assert (error["type"], error["code"]) == ("error", "forbidden")
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4403}


def _session_key(cookie: bytes) -> str:
    return cookie.decode().split("=", 1)[1]


@sync_to_async
def _deactivate(user) -> None:
    type(user).objects.filter(pk=user.pk).update(is_active=False)


@sync_to_async
def _log_out(cookie: bytes) -> None:
    """What the logout view does to the session: it is gone from the store."""
    from django.contrib.sessions.models import Session

    Session.objects.filter(session_key=_session_key(cookie)).delete()


@sync_to_async
def _change_password(user) -> None:
    user.set_password("a-new-password-42")
    user.save()


async def _signed_out(chat: Chat) -> list[dict]:
    """The frames up to the error that signs the socket out, then its close (4401)."""
    error, frames = await chat.receive_until("error")
    assert (error["code"], frames[-1]) == ("unauthenticated", error)
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4401}
    return frames


@pytest.mark.parametrize("change", [_deactivate, _log_out, _change_password])
@pytest.mark.parametrize("frame", [{"type": "send", "content": "Still there?"}, {"type": "stop"}])
async def test_a_user_signed_out_after_connecting_is_closed_on_the_next_frame(
    chat_world, async_db, change, frame
):
    alice = chat_world["user"]
    cookie = await sync_to_async(session_cookie)(alice)
    connected, _, chat = await open_chat(alice, chat_world["conversation"].pk, cookie=cookie)
    assert connected
    await change(cookie if change is _log_out else alice)

    await chat.send(**frame)
    await _signed_out(chat)
    assert await _messages(chat_world["conversation"]) == []


async def test_signing_out_mid_reply_stops_it(chat_world, async_db, ready_engine):
    conversation, alice = chat_world["conversation"], chat_world["user"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(alice, conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, chat, "token")
        await _deactivate(alice)
        await chat.send(type="settings", temperature=1.0)
        frames = await _signed_out(chat)
    assert "done" not in [f["type"] for f in frames]  # the reply ended after the error
    _, reply = await _messages(conversation)
    assert reply.status == "stopped" and reply.completion_tokens < LONG_REPLY_TOKENS
    assert await _engine_idle(await sync_to_async(_endpoint)(chat_world))


async def test_a_valid_session_costs_one_query_per_frame(chat_world, async_db):
    """The sign-in check of every frame is one query (a stop frame makes no other)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from chat import selectors

    alice = chat_world["user"]
    cookie = await sync_to_async(session_cookie)(alice)

    @sync_to_async
    def check() -> tuple[object, int]:
        with CaptureQueriesContext(connection) as queries:
            user = selectors.session_user(session_key=_session_key(cookie), user_id=alice.pk)
        return user, len(queries)

    user, num_queries = await check()
    assert user == alice and num_queries == 1


async def _two_windows_one_reply_streaming(chat_world, engine):
    """Two sockets on the conversation; the first has a long reply under way, its first token
    read. Call it with the engine paused (``engine_paused``): it stays paused, the reply
    mid-stream."""
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    _, _, first = await open_chat(chat_world["user"], conversation.pk)
    _, _, second = await open_chat(chat_world["user"], conversation.pk)
    await first.send(type="send", content="Tell me a long story")
    await run_paused_engine_until(engine, first, "token")
    return first, second


async def test_another_window_cannot_change_the_conversation_while_a_reply_streams(
    chat_world, async_db, ready_engine
):
    conversation = chat_world["conversation"]
    with engine_paused(ready_engine):
        first, second = await _two_windows_one_reply_streaming(chat_world, ready_engine)
        for frame in ({"type": "send", "content": "Me too"}, {"type": "regenerate"}):
            await second.send(**frame)
            busy, _ = await second.receive_until("error")  # after the first window's, relayed
            assert (busy["type"], busy["code"]) == ("error", "busy")
            assert "another window" in busy["message"]
        await first.send(type="stop")
        done, _ = await first.receive_until("done")
    assert done["status"] == "stopped"
    messages = await _messages(conversation)
    assert [(m.role, m.content) for m in messages][0] == ("user", "Tell me a long story")
    assert [m.pk for m in messages][1] == done["message_id"] and len(messages) == 2

    # Free again: the other window may go on.
    await _configure(conversation, max_tokens=4)
    await second.send(type="regenerate")
    done, _ = await second.receive_until("done", "error", relayed=False)
    assert done["type"] == "done" and done["status"] == "complete"
    await first.close()
    await second.close()


async def test_deleting_the_conversation_stops_its_reply_and_closes_its_sockets(
    chat_world, async_db, ready_engine, caplog, monkeypatch
):
    """Deleted from another window (or the page's own Delete) while its reply streamed: the
    reply ran on to max_tokens, metered, and ended with "The reply could not be saved". It
    stops within a claim check, is metered as cancelled, and the socket closes with 4404."""
    monkeypatch.setattr(claims, "DELETED_CHECK_SECONDS", 0.05)
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, chat, "token")
        await sync_to_async(services.conversation_delete)(conversation=conversation)
        await asyncio.sleep(0.5)  # the holder looks, and stops the reply, the engine held
    while (output := await chat.communicator.receive_output(timeout=30))["type"] != (
        "websocket.close"
    ):
        assert json.loads(output["text"])["type"] == "token"
    assert output["code"] == 4404
    [record] = await sync_to_async(list)(UsageRecord.objects.filter(tenant=chat_world["tenant"]))
    assert record.status == "cancelled" and record.completion_tokens < LONG_REPLY_TOKENS
    assert "could not be saved" not in caplog.text
    assert not await sync_to_async(claims.is_claimed)(conversation)


async def test_a_reply_renews_its_claim_while_it_runs(
    chat_world, async_db, ready_engine, monkeypatch
):
    """The claim is a lease: with a one-second lease, a reply held mid-stream for three
    seconds still keeps other windows out, because it renews the lease."""
    monkeypatch.setattr(claims, "LEASE_SECONDS", 1)
    monkeypatch.setattr(claims, "RENEW_SECONDS", 0.2)
    conversation = chat_world["conversation"]
    with engine_paused(ready_engine):
        first, second = await _two_windows_one_reply_streaming(chat_world, ready_engine)
        await asyncio.sleep(3)
        await second.send(type="regenerate")
        busy, _ = await second.receive_until("error")
        assert (busy["type"], busy["code"]) == ("error", "busy")
        await first.send(type="stop")
        done, _ = await first.receive_until("done")
    assert done["status"] == "stopped"
    assert not await sync_to_async(claims.is_claimed)(conversation)
    await first.close()
    await second.close()


@pytest.fixture
def orphaned_reply(chat_world):
    """What a process that died mid-reply leaves: a reply saved as streaming, no live claim."""
    conversation = chat_world["conversation"]
    services.message_send(conversation=conversation, content="Hello?")
    return services.reply_start(conversation=conversation, request_id="chat-dead")


async def test_a_reply_left_streaming_by_a_dead_process_is_marked_interrupted(
    chat_world, orphaned_reply, async_db
):
    conversation = chat_world["conversation"]
    _, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Anyone there?")
    done, _ = await chat.receive_until("done")
    assert done["status"] == "complete"
    await chat.close()
    messages = await _messages(conversation)
    assert [(m.pk, m.status, m.error_code) for m in messages if m.status != "complete"] == [
        (orphaned_reply.pk, "error", "interrupted")
    ]
    assert len(messages) == 4


async def test_max_tokens_unset_lets_a_reply_run_to_the_context(chat_world, async_db):
    """The API's rule: no max tokens means up to the model's context length, where the engine
    stops the reply with finish reason "length"."""
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=None)
    await sync_to_async(conversation.refresh_from_db)()
    assert conversation.max_tokens is None
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="Tell me a long story")
    done, _ = await chat.receive_until("done", "error")
    await chat.close()

    assert done["type"] == "done" and done["finish_reason"] == "length"
    usage = done["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


async def test_max_tokens_above_the_context_is_a_clear_error(chat_world, async_db):
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=MAX_MODEL_LEN + 1)
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="send", content="hi")
    error, _ = await chat.receive_until("done", "error")
    await chat.close()

    assert error["type"] == "error" and error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "max tokens" in error["message"]
    assert await _records(chat_world["tenant"]) == []  # refused before admission


async def test_a_settings_frame_clears_max_tokens_with_null(chat_world, async_db):
    conversation = chat_world["conversation"]
    connected, _, chat = await open_chat(chat_world["user"], conversation.pk)
    await chat.send(type="settings", max_tokens=None)
    frame, _ = await chat.receive_until("settings", "error")
    await chat.close()

    assert frame["type"] == "settings" and frame["settings"]["max_tokens"] is None


@pytest.mark.parametrize("failing", ["cache", "database"])
async def test_a_frame_that_meets_a_failing_cache_or_database_gets_an_error_frame(
    chat_world, async_db, monkeypatch, failing
):
    """Redis unreachable as a send claims the conversation, or the database connection lost
    as a frame is handled: the exception escaped the consumer, and the socket was dropped
    (1011) with no word to the user. An error frame says to try again; the socket stays."""
    connected, _, chat = await open_chat(chat_world["user"], chat_world["conversation"].pk)

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    def lost(*args, **kwargs):
        from django.db import OperationalError

        raise OperationalError("terminating connection due to administrator command")

    asked_whether_deleted = []

    def conversation_exists(**kwargs):
        asked_whether_deleted.append(kwargs)
        return True

    with monkeypatch.context() as patched:
        if failing == "cache":
            patched.setattr(type(caches["default"]), "aadd", unreachable)
        else:
            patched.setattr(services, "message_send", lost)
        patched.setattr(selectors, "conversation_exists", conversation_exists)
        await chat.send(type="send", content="hello")
        error = await chat.receive()
    assert error["type"] == "error" and error["code"] == "unavailable", error
    # a database out of reach is not asked again whether it was a deletion (twice the wait)
    assert len(asked_whether_deleted) == (1 if failing == "cache" else 0)
    assert error["retry_after"] > 0 and "6379" not in error["message"]
    assert "administrator" not in error["message"]

    await chat.send(type="settings", system_prompt="Still here.")
    settings = await chat.receive()
    await chat.close()
    assert settings["settings"]["system_prompt"] == "Still here."
    assert not await sync_to_async(claims.is_claimed)(chat_world["conversation"])


async def test_a_member_removed_mid_reply_is_closed_without_a_frame_of_their_own(
    chat_world, async_db, ready_engine, monkeypatch
):
    """Access was checked only when the socket sent a frame (or another window relayed one):
    removed from the tenant, a member kept receiving the reply under way, and the tenant
    paying for it, to its length."""
    from chat import consumers
    from tenants.models import Membership

    monkeypatch.setattr(consumers, "ACCESS_RECHECK_SECONDS", 0.2)
    conversation, alice = chat_world["conversation"], chat_world["user"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    connected, _, chat = await open_chat(alice, conversation.pk)
    with engine_paused(ready_engine):
        await chat.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, chat, "token")
        await sync_to_async(Membership.objects.filter(user=alice).delete)()
        error, frames = await chat.receive_until("error")
    assert error["code"] == "forbidden"
    assert "done" not in [f["type"] for f in frames]
    closed = await chat.communicator.receive_output(timeout=30)
    assert closed == {"type": "websocket.close", "code": 4403}
    _, reply = await _messages(conversation)
    assert reply.status == "stopped" and reply.completion_tokens < LONG_REPLY_TOKENS
    assert await _engine_idle(await sync_to_async(_endpoint)(chat_world))


async def test_an_open_socket_keeps_marking_its_conversation_open(
    chat_world, async_db, monkeypatch
):
    """The hourly purge of empty conversations spares one a page shows: the socket marks it
    open as it connects, and again every ``HOLD_RENEW_SECONDS`` while it stays open."""
    monkeypatch.setattr(services, "HOLD_RENEW_SECONDS", 0.05)
    conversation = chat_world["conversation"]
    _, _, chat = await open_chat(chat_world["user"], conversation.pk)

    async def opened_at():
        return (await Conversation.objects.aget(pk=conversation.pk)).opened_at

    first = None
    for _ in range(200):
        if (first := await opened_at()) is not None:
            break
        await asyncio.sleep(0.05)
    assert first is not None
    for _ in range(200):
        if (await opened_at()) > first:
            break
        await asyncio.sleep(0.05)
    assert await opened_at() > first
    await chat.close()
    await asyncio.sleep(0.2)
    closed_at = await opened_at()
    await asyncio.sleep(0.3)
    assert await opened_at() == closed_at  # a closed socket marks nothing
