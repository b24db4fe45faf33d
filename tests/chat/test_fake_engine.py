"""The chat socket on a fake engine (no model): the real routing, middleware, quotas and
metering, with an engine whose every frame the test writes, for the races a real model's
timing cannot pin down."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache

from chat import services as chat_services
from chat.models import Conversation, Message
from inference_engine.protocol import FinishReason, GenerateDelta, ResponseType, Usage
from serving import metering
from serving.pool import get_pool
from tenants.models import UsageRecord
from tests.chat.conftest import open_chat
from tests.inference_engine.test_client import FakeEngine

pytestmark = pytest.mark.timeout(60)


def _world(endpoint: str, django_user_model, limits: dict) -> dict:
    from serving.services import deployment_register
    from tenants import services
    from tenants.models import Plan

    plan = Plan.objects.create(slug="open", name="Open")
    alice = django_user_model.objects.create_user("alice", password="correct horse battery")
    acme = services.tenant_create(slug="acme", name="Acme", plan=plan, owner=alice, **limits)
    deployment_register(name="fake-model", endpoints=[endpoint])
    conversation = chat_services.conversation_create(user=alice, tenant=acme, model="fake-model")
    chat_services.conversation_configure(conversation=conversation, temperature=0.0, max_tokens=8)
    return {"user": alice, "tenant": acme, "conversation": conversation}


@pytest.fixture
async def fake_world(async_db, tmp_path, django_user_model, request):
    marker = request.node.get_closest_marker("tenant_limits")
    cache.clear()
    endpoint = f"ipc://{tmp_path}/fake.sock"
    fake = FakeEngine(endpoint)
    limits = marker.kwargs if marker else {}
    world = await sync_to_async(_world)(endpoint, django_user_model, limits)
    world["fake"] = fake
    yield world
    get_pool().close()
    fake.close()
    cache.clear()


async def _answer(fake: FakeEngine, identity: bytes, request_id: str, *texts: str) -> None:
    deltas = [GenerateDelta(request_id, text=text, token_ids=[1]) for text in texts]
    deltas.append(
        GenerateDelta(
            request_id,
            finish_reason=FinishReason.STOP,
            usage=Usage(prompt_tokens=5, completion_tokens=len(texts)),
        )
    )
    await fake.send(identity, ResponseType.OUTPUTS, deltas)


async def test_a_stop_as_the_reply_settles_leaves_the_whole_reply_complete(fake_world, monkeypatch):
    """After the last token the run writes its usage record; a stop that landed there marked
    the whole reply stopped (and freed the conversation before the record was written)."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    original, settling = metering.settle, asyncio.Event()

    async def slow_settle(settlement):  # a loaded database: the settlement takes a while
        settling.set()
        await asyncio.sleep(0.5)
        return await original(settlement)

    monkeypatch.setattr(metering, "settle", slow_settle)
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, "whole", " reply")
    await asyncio.wait_for(settling.wait(), 10)
    await chat.send(type="stop")
    done, _ = await chat.receive_until("done", "error")
    await chat.close()

    reply = await sync_to_async(Message.objects.get)(pk=done["message_id"])
    record = await sync_to_async(UsageRecord.objects.get)(request_id=reply.request_id)
    assert record.status == "ok" and reply.finish_reason == "stop"
    assert (done["status"], reply.status) == ("complete", "complete")
    assert reply.content == "whole reply"


@pytest.mark.tenant_limits(monthly_token_budget=400)
async def test_a_new_conversation_chats_under_a_monthly_budget_below_the_context(fake_world):
    """A conversation's max tokens are unset at first (up to the context): the month held
    the prompt's most and the whole context, and a tenant with a budget below that was
    refused every message, "try again in" days, having used nothing."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    await sync_to_async(chat_services.conversation_configure)(
        conversation=conversation, max_tokens=None
    )
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, "hi")
    done, _ = await chat.receive_until("done", "error")
    await chat.close()

    assert done["type"] == "done" and done["status"] == "complete", done


async def test_a_stopping_server_saves_and_meters_the_reply_being_generated(fake_world):
    """Daphne on SIGTERM cancels each socket's instance once and exits: the reply's task ran
    on unattended, and the process exited with no usage record and the reply left streaming."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    start, _ = await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await fake.send(
        identity,
        ResponseType.OUTPUTS,
        [GenerateDelta(request.request_id, text="half", token_ids=[1])],
    )
    assert (await chat.receive())["type"] == "token"

    instance = chat.communicator.future  # what Daphne cancels
    instance.cancel()
    await asyncio.gather(instance, return_exceptions=True)

    reply = await sync_to_async(Message.objects.get)(pk=start["message_id"])
    records = await sync_to_async(list)(UsageRecord.objects.filter(request_id=reply.request_id))
    assert (reply.status, reply.content) == ("stopped", "half")
    assert [record.status for record in records] == ["cancelled"]
    assert request.request_id in fake.aborted()


async def test_a_reply_holding_a_nul_streams_what_is_saved(fake_world):
    """A model may emit NUL, which PostgreSQL's text refuses: the saved reply dropped it while
    the socket had streamed it, so the reply read back differed from the one watched (a
    crash-recovery test failed on the demo model's output)."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, "a\x00b", "\x00", " c")
    done, frames = await chat.receive_until("done", "error")
    await chat.close()

    streamed = "".join(frame["text"] for frame in frames if frame["type"] == "token")
    reply = await sync_to_async(Message.objects.get)(pk=done["message_id"])
    assert streamed == reply.content == "ab c"


async def _replied(fake, chat, *texts: str) -> dict:
    """The ``done`` of the reply the fake engine answers with ``texts``, and its request."""
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, *texts)
    done, _ = await chat.receive_until("done")
    return {"done": done, "request": request}


async def _saved(conversation) -> list[tuple[str, str, str]]:
    return await sync_to_async(list)(
        Message.objects.filter(conversation=conversation)
        .order_by("id")
        .values_list("role", "status", "content")
    )


async def test_a_regenerated_reply_is_asked_without_the_one_it_replaces(fake_world):
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await _replied(fake, chat, "a first", " answer")
    await chat.send(type="regenerate")
    second = await _replied(fake, chat, "a better", " one")
    await chat.close()
    assert [(m.role, m.content) for m in second["request"].messages] == [("user", "hello")]
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "a better one"),
    ]


@pytest.mark.tenant_limits(requests_per_minute=1)
async def test_a_refused_regenerate_keeps_the_reply_it_would_replace(fake_world):
    """The last reply was deleted before the new one was admitted: a refusal (the minute's
    requests, the month's tokens, no engine) left an empty error where the answer was."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    first = (await _replied(fake, chat, "a good", " answer"))["done"]
    await chat.send(type="regenerate")  # over the tenant's one request a minute
    error, _ = await chat.receive_until("error", "done")
    assert error["code"] == "rate_limited"
    sync, _ = await chat.receive_until("sync")  # the page shows the answer again
    await chat.close()
    assert [m["id"] for m in sync["messages"]][1:] == [first["message_id"]]
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "a good answer"),
    ]


async def test_a_regenerate_stopped_before_its_first_token_keeps_the_reply_it_would_replace(
    fake_world,
):
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await _replied(fake, chat, "a good", " answer")
    await chat.send(type="regenerate")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await chat.send(type="stop")
    for _ in range(100):
        if request.request_id in fake.aborted():
            break
        await asyncio.sleep(0.05)
    await fake.send(
        identity,
        ResponseType.OUTPUTS,
        [GenerateDelta(request.request_id, finish_reason=FinishReason.ABORT, usage=Usage())],
    )
    done, _ = await chat.receive_until("done")
    assert done["status"] == "stopped"
    await chat.receive_until("sync")
    await chat.close()
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "a good answer"),
    ]


async def test_every_window_shows_the_regenerated_reply_alone_once_it_is_kept(fake_world):
    """A window that synced while the reply was regenerated showed the old reply beside the
    new one (still saved then), and kept showing it once it was deleted."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, first = await open_chat(fake_world["user"], conversation.pk)
    _, _, second = await open_chat(fake_world["user"], conversation.pk)
    await first.send(type="send", content="hello")
    await _replied(fake, first, "old", " answer")
    await second.receive_until("done")
    await first.send(type="regenerate")
    await first.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await second.receive_until("start")
    await second.send(type="sync")  # as a reconnect does
    await second.receive_until("sync")
    await _answer(fake, identity, request.request_id, "new")
    await first.receive_until("done")
    shown, _ = await second.receive_until("sync")  # the windows are told to look again
    await first.close()
    await second.close()
    assert [m["content"] for m in shown["messages"]] == ["hello", "new"]


async def test_a_regenerate_after_an_interrupted_one_replaces_every_reply_after_the_question(
    fake_world,
):
    """A process that died mid-regenerate left the old reply and the interrupted new one: the
    next regenerate answered after the old reply (the model read it as the last turn) and
    replaced only the interrupted one."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]

    @sync_to_async
    def left_by_a_dead_process():
        chat_services.message_send(conversation=conversation, content="hello")
        old = chat_services.reply_start(conversation=conversation, request_id="chat-old")
        chat_services.reply_finish(message=old, content="old answer", status="complete")
        chat_services.reply_start(conversation=conversation, request_id="chat-dead")
        chat_services.replies_interrupt(conversation=conversation)

    await left_by_a_dead_process()
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="regenerate")
    regenerated = await _replied(fake, chat, "newer")
    await chat.close()
    assert [(m.role, m.content) for m in regenerated["request"].messages] == [("user", "hello")]
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "newer"),
    ]


@pytest.mark.parametrize("action", ["send", "regenerate", "edit"])
async def test_a_regenerate_or_edit_saves_its_reply_as_a_replacement(fake_world, action):
    """What a process that dies mid-reply leaves is read by the row's mark: a regenerate's or
    an edit's reply replaces others only once it holds an answer, a new question's does not."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await _replied(fake, chat, "old")
    question = await sync_to_async(
        Message.objects.filter(conversation=conversation, role="user").first
    )()
    frames = {
        "send": {"type": "send", "content": "again"},
        "regenerate": {"type": "regenerate"},
        "edit": {"type": "edit", "message_id": question.pk, "content": "hi"},
    }
    await chat.send(**frames[action])
    started, _ = await chat.receive_until("start")
    reply = await sync_to_async(Message.objects.get)(pk=started["message_id"])
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, "new")
    await chat.receive_until("done")
    await chat.close()
    assert reply.is_replacement is (action != "send")


async def test_a_reply_that_cannot_replace_what_it_replaces_is_not_saved_either(
    fake_world, monkeypatch
):
    """The new reply was saved complete and then, apart, the old one dropped: a failure (or a
    process dying) between the two left both answers. Both are saved at once or neither."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await _replied(fake, chat, "old")

    def failing(**_):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(chat_services, "reply_replace", failing)
    await chat.send(type="regenerate")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    await _answer(fake, identity, request.request_id, "new")
    error, _ = await chat.receive_until("error")
    monkeypatch.undo()
    await chat.send(type="sync")
    shown, _ = await chat.receive_until("sync")
    await chat.close()
    assert error["code"] == "internal_error"
    assert [m["content"] for m in shown["messages"]] == ["hello", "old"]
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "old"),
    ]


async def test_a_window_running_a_reply_ignores_another_windows_resync(fake_world):
    """A full sync frame relayed by the window whose regenerate settled, read before another
    window started its reply, removed that reply from the other's page and ended its stream."""
    from channels.layers import get_channel_layer

    from chat.relay import group_name

    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    await chat.receive_until("start")
    identity, request = await asyncio.wait_for(fake.generates.get(), 10)
    group = group_name(tenant_id=conversation.tenant_id, conversation_id=conversation.pk)
    await get_channel_layer().group_send(group, {"type": "chat.resync", "sender": "elsewhere"})
    await _answer(fake, identity, request.request_id, "an answer")
    _, frames = await chat.receive_until("done")
    await chat.close()
    assert "sync" not in [frame["type"] for frame in frames]


async def test_an_edit_is_asked_with_its_new_text_and_saved_once_answered(fake_world):
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    first = await _replied(fake, chat, "first answer")
    await chat.send(type="send", content="and more")
    await _replied(fake, chat, "second answer")
    question_id = first["done"]["message_id"] - 1
    await chat.send(type="edit", message_id=question_id, content="hello again")
    edited = await _replied(fake, chat, "new answer")
    sync, _ = await chat.receive_until("sync")
    await chat.close()
    assert [(m.role, m.content) for m in edited["request"].messages] == [("user", "hello again")]
    assert await _saved(conversation) == [
        ("user", "complete", "hello again"),
        ("assistant", "complete", "new answer"),
    ]
    assert sync["settings"]["title"] == "hello again"  # made from the first message: follows


@pytest.mark.tenant_limits(requests_per_minute=1)
async def test_a_refused_edit_changes_nothing(fake_world):
    """An edit saved the new text and dropped every later message before its reply was
    admitted: a refusal left the edited question without an answer, the old answers gone."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    first = await _replied(fake, chat, "an answer")
    await chat.send(type="edit", message_id=first["done"]["message_id"] - 1, content="changed")
    error, _ = await chat.receive_until("error", "done")
    assert error["code"] == "rate_limited"
    sync, _ = await chat.receive_until("sync")
    await chat.close()
    assert [m["content"] for m in sync["messages"]] == ["hello", "an answer"]
    assert await _saved(conversation) == [
        ("user", "complete", "hello"),
        ("assistant", "complete", "an answer"),
    ]


async def _editing(fake, chat, content: str = "changed"):
    """A conversation of one answered question whose question is being edited to ``content``:
    (the engine's identity, the edit's engine request), its reply not answered yet."""
    await chat.send(type="send", content="hello")
    first = await _replied(fake, chat, "first answer")
    await chat.send(type="edit", message_id=first["done"]["message_id"] - 1, content=content)
    await chat.receive_until("start")
    return await asyncio.wait_for(fake.generates.get(), 10)


async def test_a_rename_made_while_an_edit_is_answered_stands(fake_world):
    """The edit's title, made when its reply settled, was written over a rename made from the
    sidebar meanwhile (the socket's copy still had the old title)."""
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    identity, request = await _editing(fake, chat)
    fresh = await sync_to_async(Conversation.objects.get)(pk=conversation.pk)
    await sync_to_async(chat_services.conversation_rename)(conversation=fresh, title="My name")
    await _answer(fake, identity, request.request_id, "new answer")
    sync, _ = await chat.receive_until("sync")
    await chat.close()
    assert sync["settings"]["title"] == "My name"
    assert (await sync_to_async(Conversation.objects.get)(pk=conversation.pk)).title == "My name"


async def test_the_editing_windows_sync_shows_settings_changed_elsewhere_meanwhile(fake_world):
    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    _, _, other = await open_chat(fake_world["user"], conversation.pk)
    identity, request = await _editing(fake, chat)
    await other.send(type="settings", temperature=1.5)
    await chat.receive_until("settings")
    await _answer(fake, identity, request.request_id, "new answer")
    sync, _ = await chat.receive_until("sync")
    await chat.close()
    await other.close()
    assert sync["settings"]["temperature"] == 1.5


async def test_an_edit_whose_reply_cannot_start_is_not_shown_as_saved(fake_world, monkeypatch):
    """The edited text went to every window before its reply was created: a database error
    there left them showing an edit that was never saved."""
    from django.db import OperationalError

    fake, conversation = fake_world["fake"], fake_world["conversation"]
    _, _, chat = await open_chat(fake_world["user"], conversation.pk)
    await chat.send(type="send", content="hello")
    first = await _replied(fake, chat, "first answer")

    def failing(**kwargs):
        raise OperationalError("the database is gone")

    monkeypatch.setattr(chat_services, "reply_start", failing)
    await chat.send(type="edit", message_id=first["done"]["message_id"] - 1, content="changed")
    _, frames = await chat.receive_until("error")
    await chat.close()
    assert not [f for f in frames if f["type"] == "message"]
