"""Keeps a conversation's windows in step: what one socket does (a message sent, a reply
streaming, a setting changed, a stop) reaches the conversation's other sockets, in this process
or another, through the channel layer (Redis in production; in memory in the embedded mode,
which runs a single web process).

Each socket of a conversation joins the conversation's group and says hello; the others answer
it directly, so every socket knows whether it has peers. A socket alone on its conversation,
the usual case, publishes nothing: its reply costs the channel layer no message. With peers, a
reply's text goes out in pieces at most every ``TEXT_RELAY_SECONDS``, each with its offset in
the reply, so a window that missed a piece (or opened mid-reply) sees the gap and asks the
reply's socket for the text so far (``ReplyMirror``).

The relay never fails a socket: with the channel layer out of reach the chat works as before,
each window on its own, and the receiving side retries with a growing pause. Messages are
plain dicts; their ``type`` says what they are:

- ``chat.hello`` / ``chat.here`` / ``chat.bye``: a socket joined (answered directly), is
  there, left;
- ``chat.frame``: a frame for the other windows' pages (``message``, ``settings``, ``start``,
  ``done``, a reply's ``error``);
- ``chat.text``: a piece of a reply's text, ``reply_id``, ``offset``, ``text``;
- ``chat.snapshot_request`` / ``chat.snapshot``: a window asks for a reply's text so far, and
  the reply's socket answers it directly;
- ``chat.stop``: a window that is not generating asks for the reply to stop;
- ``chat.deleted``: the conversation was deleted (from the page's delete form).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

TEXT_RELAY_SECONDS = 0.05
SNAPSHOT_RETRY_SECONDS = 1.0  # a snapshot asked for and not come is asked for again after this
RECEIVE_RETRY_SECONDS = (0.5, 10.0)  # the first pause after a failed receive, and the longest
REJOIN_SECONDS = 3600.0  # channels_redis forgets a group's member after a day


def group_name(*, tenant_id: int, conversation_id: int) -> str:
    return f"chat.conversation.{tenant_id}.{conversation_id}"


def publish_from_sync(*, tenant_id: int, conversation_id: int, message: dict) -> None:
    """Send ``message`` to every socket of the conversation, from synchronous code (the page's
    rename and delete). Never raises: the change stands whatever the channel layer does."""
    group = group_name(tenant_id=tenant_id, conversation_id=conversation_id)
    try:
        async_to_sync(get_channel_layer().group_send)(group, message)
    except Exception:  # noqa: BLE001 - the other windows learn of it on their next frame
        logger.warning("could not tell the windows of %s: %s", group, message["type"])


class Relay:
    """One socket's membership of its conversation's group."""

    def __init__(self, group: str, on_message: Callable[[dict], Awaitable[None]]) -> None:
        self.group = group
        self.channel: str | None = None
        self.peers: set[str] = set()
        self._layer = get_channel_layer()
        self._on_message = on_message
        self._receiver: asyncio.Task | None = None
        self._is_joined = False
        self._joined_at = 0.0

    async def join(self) -> None:
        """Join the group and say hello. Messages wait in the layer until ``listen``."""
        self.channel = await self._layer.new_channel()  # a name made up here: no I/O
        try:
            await self._add()
        except Exception:  # noqa: BLE001 - the socket works alone; listen() joins again
            logger.warning("%s: could not join its windows' group", self.group)

    def listen(self) -> None:
        if self.channel is not None and self._receiver is None:
            self._receiver = asyncio.create_task(self._receive_loop())

    def abandon(self) -> None:
        """Stop receiving, without a word to the group (its membership runs out)."""
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None

    async def leave(self) -> None:
        self.abandon()
        if self.channel is None:
            return
        channel, self.channel, self._is_joined = self.channel, None, False
        try:
            await self._layer.group_discard(self.group, channel)
            if self.peers:
                await self._layer.group_send(self.group, {"type": "chat.bye", "sender": channel})
        except Exception:  # noqa: BLE001 - the membership runs out on its own
            logger.warning("%s: could not leave its windows' group", self.group)

    async def publish(self, message: dict, *, to_all: bool = False) -> None:
        """Send ``message`` to the conversation's other sockets: only when it has some that
        this socket knows of, unless ``to_all`` (a request that someone else must act on)."""
        if self.channel is None or not (self.peers or to_all):
            return
        try:
            await self._layer.group_send(self.group, {**message, "sender": self.channel})
        except Exception:  # noqa: BLE001 - the other windows catch up on their next sync
            logger.warning("%s: could not relay %s", self.group, message["type"])

    async def send_to(self, channel: str, message: dict) -> None:
        if self.channel is None:
            return
        try:
            await self._layer.send(channel, {**message, "sender": self.channel})
        except Exception:  # noqa: BLE001 - as publish
            logger.warning("%s: could not answer %s with %s", self.group, channel, message["type"])

    async def refresh(self) -> None:
        """Join again when the layer may have forgotten this socket (a socket open for a day;
        one that could not join is joined again by its receiving, with a growing pause)."""
        if self._is_joined and time.monotonic() - self._joined_at > REJOIN_SECONDS:
            try:
                await self._add()
            except Exception:  # noqa: BLE001 - tried again on the next refresh
                logger.warning("%s: could not join its windows' group again", self.group)

    async def _add(self) -> None:
        """Join the group and say hello (again: a socket that could not join at first, or that
        the layer forgot, is not known to its peers)."""
        await self._layer.group_add(self.group, self.channel)
        await self._layer.group_send(self.group, {"type": "chat.hello", "sender": self.channel})
        self._is_joined = True
        self._joined_at = time.monotonic()

    async def _receive_loop(self) -> None:
        pause = RECEIVE_RETRY_SECONDS[0]
        while True:
            try:
                if not self._is_joined:
                    await self._add()
                message = await self._layer.receive(self.channel)
            except Exception:  # noqa: BLE001 - the layer is down: wait, and join again
                logger.warning("%s: could not receive from its windows' group", self.group)
                self._is_joined = False
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECEIVE_RETRY_SECONDS[1])
                continue
            pause = RECEIVE_RETRY_SECONDS[0]
            sender = message.get("sender")
            if sender == self.channel:
                continue
            kind = message.get("type")
            if kind == "chat.bye":
                self.peers.discard(sender)
                continue
            if isinstance(sender, str):
                self.peers.add(sender)
            if kind == "chat.hello":
                await self.send_to(sender, {"type": "chat.here"})
                continue
            if kind == "chat.here":
                continue
            try:
                await self._on_message(message)
            except Exception:  # noqa: BLE001 - one message's failure never ends the relay
                logger.exception("%s: could not handle %s", self.group, kind)


class TextRelay:
    """A reply's text for the other windows, in pieces at most every ``TEXT_RELAY_SECONDS``.
    Text that arrives while the socket has no peers is counted (offsets stay true) but not
    sent; a window that opens later asks for a snapshot."""

    def __init__(self, relay: Relay, reply_id: int) -> None:
        self.relay = relay
        self.reply_id = reply_id
        self._sent = 0  # characters of the reply that went out, or were skipped
        self._pending: list[str] = []
        self._flusher: asyncio.Task | None = None

    def add(self, text: str) -> None:
        if not self.relay.peers:
            self._sent += sum(map(len, self._pending)) + len(text)
            self._pending.clear()
            return
        self._pending.append(text)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_later())

    def close(self) -> None:
        """The reply ended: what is pending is dropped, its ``done`` carries the whole text."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None

    async def _flush_later(self) -> None:
        await asyncio.sleep(TEXT_RELAY_SECONDS)
        self._flusher = None
        text, offset = "".join(self._pending), self._sent
        self._pending.clear()
        self._sent += len(text)
        if not text:  # the peers left meanwhile
            return
        await self.relay.publish(
            {"type": "chat.text", "reply_id": self.reply_id, "offset": offset, "text": text}
        )


@dataclass
class ReplyMirror:
    """What one window shows of a reply that another window generates: which reply, and how
    much of its text the page has. Pieces may overlap, come late or leave a gap; only text
    that extends the page's without a gap goes out."""

    reply_id: int | None = None
    length: int = 0
    ended_upto: int = 0  # the highest reply id seen ending: later pieces of it are dropped
    snapshot_asked_at: float | None = None  # (monotonic) None: no snapshot is awaited
    heard_at: float = 0.0  # when this reply was last heard of (monotonic)

    def watch(self, reply_id: int) -> bool:
        """Follow ``reply_id`` from its start (no text yet); False when it already ended."""
        if reply_id <= self.ended_upto:
            return False
        if self.reply_id != reply_id:
            self.reply_id, self.length, self.snapshot_asked_at = reply_id, 0, None
        self.heard_at = time.monotonic()
        return True

    def is_new(self, reply_id: int) -> bool:
        """Whether ``reply_id`` is a reply this window neither follows nor saw end: it missed
        the reply's start (it opened, or its hello crossed the start, just then)."""
        return reply_id != self.reply_id and reply_id > self.ended_upto

    def ask_snapshot(self) -> None:
        self.snapshot_asked_at = time.monotonic()

    def forget(self) -> None:
        """No reply is being generated (as saved)."""
        self.reply_id = None

    def is_stale(self, seconds: float) -> bool:
        """Whether a reply is followed, and nothing was heard of it for ``seconds``."""
        return self.reply_id is not None and time.monotonic() - self.heard_at >= seconds

    def heard_of(self) -> None:
        self.heard_at = time.monotonic()

    def end(self, reply_id: int) -> None:
        self.ended_upto = max(self.ended_upto, reply_id)
        if self.reply_id is not None and self.reply_id <= reply_id:
            self.reply_id = None

    def piece(self, reply_id: int, offset: int, text: str) -> tuple[str, bool]:
        """(the text the page lacks from this piece, whether to ask for a snapshot)."""
        if reply_id != self.reply_id:
            return "", False
        self.heard_at = time.monotonic()
        if offset > self.length:
            asked_at = self.snapshot_asked_at
            if asked_at is not None and time.monotonic() - asked_at < SNAPSHOT_RETRY_SECONDS:
                return "", False
            self.ask_snapshot()  # again, too, when the last one was lost
            return "", True
        return self._extend(offset, text), False

    def snapshot(self, reply_id: int, text: str) -> str:
        """The text the page lacks from the reply's text so far."""
        if reply_id != self.reply_id:
            return ""
        self.heard_at = time.monotonic()
        self.snapshot_asked_at = None
        return self._extend(0, text)

    def _extend(self, offset: int, text: str) -> str:
        new = text[self.length - offset :]
        self.length += len(new)
        return new
