"""Two windows on one conversation (``chat.relay``): what one does reaches the other as it
happens, through the real channel layer (Redis under CI, in memory in the embedded mode) and
the real engine; a window that opens mid-reply catches up; a stop or a deletion anywhere
reaches the window it concerns; a window alone costs the layer nothing; and the chat works
with the layer out of reach."""

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer

from chat import claims, consumers, relay, services
from chat.models import Message
from tests.chat.conftest import (
    FRAME_TIMEOUT,
    engine_paused,
    open_chat,
    run_paused_engine_until,
    session_cookie,
)
from tests.chat.test_consumer import LONG_REPLY_TOKENS, _configure


@sync_to_async
def _saved_reply(message_id: int) -> Message:
    return Message.objects.get(pk=message_id)


def _text(frames: list[dict]) -> str:
    return "".join(frame["text"] for frame in frames if frame["type"] == "token")


async def _two_windows(world, cookie: bytes | None = None):
    """Two windows on the conversation, the first one knowing of the second (it relays
    nothing before it heard the second's hello): it sends an empty settings frame until
    the second hears of it."""
    conversation = world["conversation"]
    _, _, first = await open_chat(world["user"], conversation.pk)
    _, _, second = await open_chat(world["user"], conversation.pk, cookie)
    deadline = time.monotonic() + FRAME_TIMEOUT
    while True:
        await first.send(type="settings")
        assert (await first.receive())["type"] == "settings"
        if not await second.is_quiet():
            assert (await second.receive())["relayed"]
            return first, second
        assert time.monotonic() < deadline, "the first window never heard of the second"


async def test_a_reply_streams_to_the_conversations_other_window(
    chat_world, async_db, ready_engine
):
    await _configure(chat_world["conversation"], max_tokens=LONG_REPLY_TOKENS)
    first, second = await _two_windows(chat_world)
    with engine_paused(ready_engine):
        await first.send(type="send", content="Tell me a long story")
        _, own = await run_paused_engine_until(ready_engine, first, "token")
        # the engine held: the other window has the text while the reply is still running
        token, relayed = await second.receive_until("token")
        assert token["relayed"] and token["text"]
    done, rest = await first.receive_until("done")
    relayed_done, relayed_rest = await second.receive_until("done")
    own, relayed = own + rest, relayed + relayed_rest

    assert all(frame.get("relayed") for frame in relayed)
    assert [f["type"] for f in relayed if f["type"] != "token"] == [
        "message",
        "settings",  # the first message titled the conversation
        "start",
        "done",
    ]
    assert relayed[0]["message"]["content"] == "Tell me a long story"
    saved = await _saved_reply(done["message_id"])
    assert relayed_done["message"]["id"] == saved.pk and saved.status == "complete"
    assert relayed_done["message"]["content"] == saved.content == _text(own)
    # what was still waiting to go out when the reply ended came with its done
    assert saved.content.startswith(_text(relayed))
    assert await second.is_quiet()
    await first.close()
    await second.close()


async def test_a_window_opened_mid_reply_gets_its_text_so_far_and_the_rest(
    chat_world, async_db, ready_engine
):
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=LONG_REPLY_TOKENS)
    _, _, first = await open_chat(chat_world["user"], conversation.pk)
    with engine_paused(ready_engine):
        await first.send(type="send", content="Tell me a long story")
        _, own = await run_paused_engine_until(ready_engine, first, "token")
        _, _, late = await open_chat(chat_world["user"], conversation.pk)
        await late.send(type="sync")
        sync = await late.receive()
        start = next(frame for frame in own if frame["type"] == "start")
        assert sync["type"] == "sync" and sync["generating"] == start["message_id"]
        assert [m["status"] for m in sync["messages"]] == ["complete", "streaming"]
        so_far = await late.receive()  # the reply's window answered with its text so far
        assert so_far["type"] == "token" and so_far["relayed"] and so_far["text"]
    done, rest = await first.receive_until("done")
    relayed_done, relayed = await late.receive_until("done")
    saved = await _saved_reply(done["message_id"])
    assert saved.content == _text(own + rest)
    assert saved.content.startswith(so_far["text"] + _text(relayed))
    assert relayed_done["message"]["content"] == saved.content
    await first.close()
    await late.close()


async def test_stop_in_a_window_that_is_not_generating_stops_the_reply(
    chat_world, async_db, ready_engine
):
    await _configure(chat_world["conversation"], max_tokens=LONG_REPLY_TOKENS)
    first, second = await _two_windows(chat_world)
    with engine_paused(ready_engine):
        await first.send(type="send", content="Tell me a long story")
        await run_paused_engine_until(ready_engine, first, "token")
        await second.send(type="stop")
        done, _ = await first.receive_until("done")
    assert done["status"] == "stopped"
    relayed_done, _ = await second.receive_until("done")
    assert relayed_done["relayed"] and relayed_done["message"]["status"] == "stopped"
    assert (await _saved_reply(done["message_id"])).status == "stopped"
    await first.close()
    await second.close()


async def test_a_deletion_closes_an_idle_window_at_once(chat_world, async_db):
    """Before, the window learned of it only when it next sent a frame."""
    conversation = chat_world["conversation"]
    _, _, idle = await open_chat(chat_world["user"], conversation.pk)
    await sync_to_async(services.conversation_delete)(conversation=conversation)
    error = await idle.receive()
    assert (error["type"], error["code"]) == ("error", "deleted")
    closed = await idle.communicator.receive_output(timeout=30)
    assert (closed["type"], closed["code"]) == ("websocket.close", consumers.CLOSE_DELETED)
    await idle.close()


async def test_a_rename_and_a_settings_change_reach_the_other_window(chat_world, async_db):
    conversation = chat_world["conversation"]
    first, second = await _two_windows(chat_world)
    await sync_to_async(services.conversation_rename)(conversation=conversation, title="Plans")
    renamed = await second.receive()
    # the title alone: the rest, as the page's view loaded it, may be older than a window's
    assert (renamed["type"], renamed["settings"]) == ("settings", {"title": "Plans"})
    assert (await first.receive())["settings"]["title"] == "Plans"  # its own page's rename
    await first.send(type="settings", temperature=1.25, system_prompt="Be brief.")
    own = await first.receive()
    relayed = await second.receive()
    assert relayed == {**own, "relayed": True}
    assert relayed["settings"]["temperature"] == 1.25
    assert relayed["settings"]["system_prompt"] == "Be brief."
    await first.close()
    await second.close()


async def test_another_conversations_window_hears_nothing(chat_world, async_db):
    other = await sync_to_async(services.conversation_create)(
        user=chat_world["user"], tenant=chat_world["tenant"], model=chat_world["conversation"].model
    )
    await _configure(chat_world["conversation"], max_tokens=4)
    first, second = await _two_windows(chat_world)
    _, _, elsewhere = await open_chat(chat_world["user"], other.pk)
    await first.send(type="send", content="Hello")
    await first.receive_until("done")
    await second.receive_until("done")
    assert await elsewhere.is_quiet()
    for window in (first, second, elsewhere):
        await window.close()


async def test_a_window_alone_sends_the_channel_layer_nothing_but_its_hello(
    chat_world, async_db, monkeypatch
):
    layer = get_channel_layer()
    published = []
    group_send = layer.group_send

    async def counting_group_send(group, message):
        published.append(message["type"])
        await group_send(group, message)

    monkeypatch.setattr(layer, "group_send", counting_group_send)
    await _configure(chat_world["conversation"], max_tokens=16)
    _, _, alone = await open_chat(chat_world["user"], chat_world["conversation"].pk)
    await alone.send(type="send", content="Hello")
    await alone.receive_until("done")
    await alone.close()
    assert published == ["chat.hello"]


async def test_a_reply_that_ends_unheard_of_is_synced(chat_world, async_db, monkeypatch):
    """The generating window did not know of this one (its hello crossed the reply's end, or
    the layer lost a message): the window looks at the claim, finds it freed, and syncs."""
    monkeypatch.setattr(consumers, "MIRROR_CHECK_SECONDS", 0.1)
    conversation = chat_world["conversation"]
    token = await claims.aclaim(conversation)  # a reply generated by a window unheard of
    reply = await sync_to_async(services.reply_start)(
        conversation=conversation, request_id="chat-elsewhere"
    )
    _, _, window = await open_chat(chat_world["user"], conversation.pk)
    await window.send(type="sync")
    sync = await window.receive()
    assert sync["generating"] == reply.pk

    await sync_to_async(services.reply_finish)(message=reply, content="Done.", status="complete")
    await claims.arelease(conversation, token)
    synced = await window.receive()
    assert synced["type"] == "sync" and synced["generating"] is None
    assert synced["messages"][-1]["content"] == "Done."
    assert synced["messages"][-1]["status"] == "complete"
    await window.close()


async def test_a_sync_marks_a_reply_left_by_a_dead_process_interrupted(chat_world, async_db):
    conversation = chat_world["conversation"]
    reply = await sync_to_async(services.reply_start)(
        conversation=conversation, request_id="chat-dead"
    )
    _, _, window = await open_chat(chat_world["user"], conversation.pk)
    await window.send(type="sync")
    sync = await window.receive()
    assert sync["generating"] is None
    assert sync["messages"][-1]["id"] == reply.pk
    assert sync["messages"][-1]["error_code"] == "interrupted"
    await window.close()


@pytest.fixture
def broken_channel_layer(monkeypatch):
    layer = get_channel_layer()

    async def unreachable(*args, **kwargs):
        raise ConnectionError("the channel layer is out of reach")

    for name in ("group_add", "group_discard", "group_send", "send", "receive"):
        monkeypatch.setattr(layer, name, unreachable)
    monkeypatch.setattr(relay, "RECEIVE_RETRY_SECONDS", (0.05, 0.1))


async def test_the_chat_works_with_the_channel_layer_out_of_reach(
    chat_world, async_db, broken_channel_layer, caplog
):
    conversation = chat_world["conversation"]
    await _configure(conversation, max_tokens=8)
    _, _, first = await open_chat(chat_world["user"], conversation.pk)
    _, _, second = await open_chat(chat_world["user"], conversation.pk)
    await first.send(type="send", content="Hello")
    done, frames = await first.receive_until("done", "error")
    assert done["type"] == "done" and done["status"] == "complete"
    await second.send(type="sync")  # each window on its own, as before the relay
    sync = await second.receive()
    assert sync["messages"][-1]["content"] == _text(frames)
    await sync_to_async(services.conversation_delete)(conversation=conversation)  # no raise
    assert "could not join its windows' group" in caplog.text
    assert "could not tell the windows" in caplog.text
    await first.close()
    await second.close()


async def test_a_window_signed_out_meanwhile_is_closed_not_shown_other_windows_frames(
    chat_world, async_db, monkeypatch
):
    """A tab left open after its user signed out (elsewhere) kept showing what the user's
    other windows wrote."""
    monkeypatch.setattr(consumers, "ACCESS_RECHECK_SECONDS", 0)
    alice = chat_world["user"]
    cookie = await sync_to_async(session_cookie)(alice)
    first, stale = await _two_windows(chat_world, cookie)

    @sync_to_async
    def sign_out_the_stale_tab() -> None:
        from django.contrib.sessions.models import Session

        Session.objects.filter(session_key=cookie.decode().split("=", 1)[1]).delete()

    await sign_out_the_stale_tab()
    await first.send(type="send", content="Something private")
    error = await stale.receive()
    assert (error["type"], error["code"]) == ("error", "unauthenticated")
    closed = await stale.communicator.receive_output(timeout=30)
    assert (closed["type"], closed["code"]) == ("websocket.close", consumers.CLOSE_UNAUTHENTICATED)
    await first.receive_until("done")
    await first.close()
    await stale.close()


async def test_a_stop_naming_another_reply_stops_nothing(chat_world, async_db, ready_engine):
    """A stop clicked as one reply ended must not stop the next one, started meanwhile."""
    await _configure(chat_world["conversation"], max_tokens=LONG_REPLY_TOKENS)
    first, second = await _two_windows(chat_world)
    with engine_paused(ready_engine):
        await first.send(type="send", content="Tell me a long story")
        _, own = await run_paused_engine_until(ready_engine, first, "token")
        start = next(frame for frame in own if frame["type"] == "start")
        await second.send(type="stop", message_id=start["message_id"] - 1)
        # relayed after the stop, so handled after it: had the stop acted, its done came first
        await second.send(type="settings")
        _, frames = await first.receive_until("settings")
        assert [frame["type"] for frame in frames if frame["type"] != "token"] == ["settings"]
        await second.send(type="stop", message_id=start["message_id"])
        done, _ = await first.receive_until("done")
    assert done["status"] == "stopped"
    await first.close()
    await second.close()


async def test_a_window_that_missed_a_replys_start_syncs_on_its_next_piece(chat_world, async_db):
    """The generating window had not heard this one's hello when its reply started, so the
    start went nowhere; its first piece of text to this window makes this window sync."""
    conversation = chat_world["conversation"]
    token = await claims.aclaim(conversation)
    reply = await sync_to_async(services.reply_start)(
        conversation=conversation, request_id="chat-unseen"
    )
    _, _, window = await open_chat(chat_world["user"], conversation.pk)
    group = relay.group_name(tenant_id=conversation.tenant_id, conversation_id=conversation.pk)
    piece = {"type": "chat.text", "reply_id": reply.pk, "offset": 40, "text": "...and then"}
    await get_channel_layer().group_send(group, {**piece, "sender": "specific.elsewhere!x"})
    sync = await window.receive()
    assert sync["type"] == "sync" and sync["generating"] == reply.pk
    await claims.arelease(conversation, token)
    await window.close()


# --- the relay's parts, alone --------------------------------------------------------------


def test_a_mirror_passes_on_only_text_that_extends_the_page_without_a_gap():
    mirror = relay.ReplyMirror()
    assert mirror.piece(7, 0, "ignored") == ("", False)  # not followed
    assert mirror.watch(7)
    assert mirror.piece(7, 0, "Hel") == ("Hel", False)
    assert mirror.piece(7, 1, "ello") == ("lo", False)  # overlaps what the page has
    assert mirror.piece(7, 9, "gap") == ("", True)  # a piece was lost: ask, once
    assert mirror.piece(7, 12, "more") == ("", False)  # (asked a moment ago)
    assert mirror.snapshot(7, "Hello, world") == ", world"
    assert mirror.piece(7, 12, "!") == ("!", False)
    assert mirror.snapshot(7, "Hello") == ""  # an older snapshot adds nothing
    mirror.end(7)
    assert mirror.piece(7, 13, "late") == ("", False)
    assert not mirror.watch(7)  # ended: a late start is not followed again
    assert mirror.watch(8) and mirror.length == 0


async def test_text_relayed_after_a_peer_arrives_keeps_its_offsets(monkeypatch):
    monkeypatch.setattr(relay, "TEXT_RELAY_SECONDS", 0)
    sent = []

    class Recording(relay.Relay):
        async def publish(self, message, *, to_all=False):
            sent.append(message)

    group = Recording("chat.conversation.1.2", on_message=None)
    text = relay.TextRelay(group, reply_id=3)
    text.add("Hello")  # alone: nothing goes out
    await asyncio.sleep(0.01)
    group.peers.add("specific.other")
    text.add(", ")
    text.add("world")
    await asyncio.sleep(0.01)
    assert sent == [{"type": "chat.text", "reply_id": 3, "offset": 5, "text": ", world"}]


def test_a_mirror_asks_again_for_a_snapshot_that_did_not_come(monkeypatch):
    mirror = relay.ReplyMirror()
    mirror.watch(7)
    assert mirror.piece(7, 5, "gap") == ("", True)
    monkeypatch.setattr(relay, "SNAPSHOT_RETRY_SECONDS", 0)
    assert mirror.piece(7, 8, "more") == ("", True)  # the first was lost
