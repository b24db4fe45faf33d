"""The chat socket on a fake engine (no model): the real routing, middleware, quotas and
metering, with an engine whose every frame the test writes, for the races a real model's
timing cannot pin down."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import cache

from chat import services as chat_services
from chat.models import Message
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
