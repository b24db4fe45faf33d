"""The chat WebSocket, ``/ws/chat/<conversation_id>/``: one socket per open conversation.

Only the conversation's owner, chatting as the conversation's tenant, may connect: an
anonymous user is refused with close code 4401, anybody else with 4403 (also when the
conversation does not exist, so ids cannot be probed). A refused socket is accepted and closed
at once: a close before the handshake completes reaches a browser as 1006, without its code,
and the page could not tell "sign in again" from "the server is restarting".

Client → server frames (JSON objects, at most ``MAX_FRAME_CHARS`` characters):

- ``{"type": "send", "content": str}``: add a user message and generate a reply.
- ``{"type": "stop", "message_id"?: int}``: stop the reply being generated (in this window,
  or in another: then only the reply named, if named); its text so far is kept, marked
  stopped. Ignored when nothing is being generated.
- ``{"type": "regenerate"}``: replace the last reply with a new one.
- ``{"type": "edit", "message_id": int, "content": str}``: change one of the user's messages,
  drop everything after it, and generate a reply to it.
- ``{"type": "settings", "model"?: str, "system_prompt"?: str, "temperature"?: number,
  "max_tokens"?: int | null}``: change the conversation's settings (they apply to the next
  reply; a null ``max_tokens`` lets replies run up to the model's context length).
- ``{"type": "sync"}``: send the conversation as saved (the page sends it each time its socket
  opens, so that a page that was rendered, or disconnected, a moment ago catches up).

Server → client frames:

- ``{"type": "message", "message": {...}}``: a user message as saved (after send or edit).
- ``{"type": "settings", "settings": {...}}``: the conversation's title and settings as saved
  (after a settings frame, and after the first message titles the conversation).
- ``{"type": "sync", "messages": [...], "settings": {...}, "generating": int | null}``: the
  conversation as saved, after a sync frame, and again when a reply that another window was
  generating ended unheard of; ``generating`` names the reply being generated, whose text so
  far follows as ``token`` frames.
- ``{"type": "start", "message_id": int, "after_id": int}``: a reply begins; every message
  after ``after_id`` other than this one is gone (regenerate, edit).
- ``{"type": "token", "text": str}``: the next piece of the reply.
- ``{"type": "done", "message_id": int, "status": "complete" | "stopped",
  "finish_reason": "stop" | "length" | "abort" | "", "usage": {"prompt_tokens",
  "completion_tokens", "cached_tokens"}}``: the reply ended and is saved.
- ``{"type": "error", "code": str, "message": str, "retry_after"?: int, "message_id"?: int}``:
  a frame was refused (``invalid_frame``, ``unknown_type``, ``invalid_request`` (also for
  text with a lone surrogate, ``"\\ud800"``, in any field), ``busy``, ``unavailable`` with
  ``retry_after`` when the database or the cache failed it, ``too_many_frames`` with
  ``retry_after`` when the socket sent more than its budget (``chat.frame_budget``: 20 at once,
  5 a second after, and stops 10 and 2 of their own; the frames past it are dropped unhandled,
  and only the first is answered);
  ``unauthenticated`` when the user was signed out since connecting (logged out, deactivated,
  password changed), and the socket closes with 4401; ``forbidden`` when access to the
  conversation was lost, and it closes with 4403; ``deleted`` when another window deleted
  it, and it closes with 4404; a reply being generated then stops), or
  a reply failed (``rate_limited`` with ``retry_after`` seconds, ``model_not_found``,
  ``engine_unavailable``, ``context_length_exceeded``, ...; then ``message_id`` names the
  reply, saved with the error). Otherwise the socket stays open.

Every window of a conversation sees what the others do (``chat.relay``): the ``message``,
``settings``, ``start``, ``token`` and ``done`` frames of another window's actions reach it
too, marked ``"relayed": true``; a relayed ``done`` carries the reply as saved (``message``,
whose status may also be ``error``), and ``token`` frames of a relayed reply may hold several
tokens. A stop frame from a window that is not generating stops the reply another window
generates (with ``"message_id"``, only that reply). A conversation deleted from the page
closes its idle sockets at once (``deleted``, 4404), and a rename reaches them as a
``settings`` frame naming only the title. A socket whose user was signed out, or lost access,
since its last check (at most ``ACCESS_RECHECK_SECONDS`` before) is closed, as for a frame of
its own, instead of shown what other windows relay; while its own reply runs, it is checked
every ``ACCESS_RECHECK_SECONDS`` whatever it sends, and one who lost access is closed, the
reply stopped and saved.

Only one reply per conversation is generated at a time, across sockets and processes: a
frame that would start another gets a ``busy`` error. The claim is a lease that the reply
renews (``chat.claims``), so a process that dies mid-reply frees the conversation within
half a minute, and its reply, left as streaming, is then marked interrupted (a regenerate's
or an edit's goes instead, leaving the conversation as it was). The reply runs
as its own task, so a stop frame is read at once, even before the first token; stop and
disconnect cancel the task, which aborts the engine request. A conversation deleted while its
reply runs (another window, another process) stops the reply within
``claims.DELETED_CHECK_SECONDS``, saves nothing, and closes the socket with 4404.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.core.exceptions import ValidationError
from django.db import InterfaceError, OperationalError

from chat import claims, selectors, services
from chat.frame_budget import FrameBudget, retry_after_seconds
from chat.models import Conversation, Message
from chat.payloads import message_payload, settings_payload
from chat.relay import Relay, ReplyMirror, TextRelay, group_name
from chat.replies import ChatError, ReplyOutcome, generate_reply
from chat.selectors import SESSION_TENANT_KEY
from config.json_text import describe_lone_surrogate, lone_surrogate_path
from config.stopping import as_disconnect_when_cancelled
from serving import runs

logger = logging.getLogger(__name__)

MAX_FRAME_CHARS = 64 * 1024
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_DELETED = 4404
CLOSE_SERVER_STOPPING = 1012  # RFC 6455's "service restart"
# how long a reply being generated when the server stops gets to be stopped and saved
STOPPING_GRACE_SECONDS = 10.0
# how often a window following another window's reply looks whether it ended unheard of
MIRROR_CHECK_SECONDS = 2.0
# how long a check that the socket's user may still see the conversation holds for what other
# windows relay to it (each frame of its own is checked)
ACCESS_RECHECK_SECONDS = 5.0
SETTINGS_FIELDS = ("model", "system_prompt", "temperature", "max_tokens")


def _read_frame(text_data: str | None) -> tuple[dict | None, tuple[str, str] | None]:
    """The client's frame, a JSON object with a string ``type``, or why it is refused: an
    error's code and message."""
    if text_data is None:
        return None, ("invalid_frame", "Send JSON text frames.")
    if len(text_data) > MAX_FRAME_CHARS:
        return None, ("invalid_frame", f"A frame may be at most {MAX_FRAME_CHARS} chars.")
    if (path := lone_surrogate_path(text_data)) is not None:
        # valid JSON, but no text any database or tokenizer takes: refused, whatever field
        return None, ("invalid_request", describe_lone_surrogate(path))
    try:
        # msgspec, not json: it refuses nesting past its depth limit (and lone surrogates)
        frame = msgspec.json.decode(text_data)
    except (msgspec.DecodeError, RecursionError):
        return None, ("invalid_frame", "A frame must be a JSON object.")
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        return None, ("invalid_frame", 'A frame must be a JSON object with a "type".')
    return frame, None


@dataclass
class _Run:
    """One reply being generated."""

    reply: Message
    claim: str  # the token of the conversation's claim, held until the reply is saved
    outcome: ReplyOutcome = field(default_factory=ReplyOutcome)
    task: asyncio.Task | None = None
    keeper: asyncio.Task | None = None  # renews the claim while the reply runs
    guard: asyncio.Task | None = None  # checks the user's access while the reply runs
    is_generating: bool = True
    is_stopped: bool = False
    is_stop_asked: bool = False  # a stop (or deletion) was asked for: no token goes out after
    is_finished: bool = False
    is_deleted: bool = False  # its conversation was deleted meanwhile: nothing to save
    error: ChatError | None = None
    text_relay: TextRelay | None = None  # its text for the conversation's other windows
    # a regenerate or an edit: the messages it replaces once it holds an answer (shown by no
    # sync meanwhile), and the edit (message id, new text) then saved
    replaces: list[int] = field(default_factory=list)
    edit: tuple[int, str] | None = None

    def cancel(self) -> None:
        """Cancel the generation, once: a stop frame and ``_stop`` may both ask (an extra
        request would stay counted on the task, which ends its own work after the first).
        A reply whose last token is in is not cancelled: what is left is its settlement, and
        a stop that landed there marked a whole reply stopped."""
        self.is_stop_asked = True
        if (
            self.is_generating
            and not self.outcome.finish_reason
            and self.task is not None
            and not self.task.cancelling()
        ):
            self.task.cancel()


class ChatConsumer(AsyncWebsocketConsumer):
    # Not Channels' own subscription: its receive failing would end the socket. The relay
    # (``chat.relay``) joins the conversation's group itself and survives a layer outage.
    channel_layer_alias = None
    conversation: Conversation
    run: _Run | None = None
    relay: Relay | None = None
    mirror: ReplyMirror
    mirror_checker: asyncio.Task | None = None
    holder: asyncio.Task | None = None  # marks the conversation open while the socket is open
    resync: asyncio.Task | None = None  # this window's look after a regenerate or edit settled
    allowed_at = 0.0  # when the user was last found allowed to see the conversation (monotonic)
    frame_budgets: dict[bool, FrameBudget] | None = None  # stops (True) and the other frames
    num_replies_started = 0
    is_closed = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Serve the socket; a server that stops (Daphne on SIGTERM) closes it as the client
        leaving would (``config.stopping``): the reply being generated stops, and is saved
        and metered, before the process exits."""
        try:
            await as_disconnect_when_cancelled(
                lambda receive: super(ChatConsumer, self).__call__(scope, receive, send),
                receive,
                {"type": "websocket.disconnect", "code": CLOSE_SERVER_STOPPING},
                STOPPING_GRACE_SECONDS,
            )
        finally:  # an instance that ended without its disconnect leaves no task behind
            self._stop_socket_tasks()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self._refuse(CLOSE_UNAUTHENTICATED)
            return
        conversation_id = int(self.scope["url_route"]["kwargs"]["conversation_id"])
        conversation = await self._conversation(user, conversation_id)
        if conversation is None:
            await self._refuse(CLOSE_FORBIDDEN)
            return
        self.user, self.conversation = user, conversation
        self.allowed_at = time.monotonic()
        self.mirror = ReplyMirror()
        self.relay_lock = asyncio.Lock()  # relayed messages and syncs, one at a time
        self.relay = Relay(
            group_name(tenant_id=conversation.tenant_id, conversation_id=conversation.pk),
            self._on_relayed,
        )
        await self.relay.join()  # before the accept: what happens once the page sees the
        await self.accept()  # socket open reaches it
        self.relay.listen()
        self.mirror_checker = asyncio.create_task(self._check_mirror())
        self.holder = asyncio.create_task(self._hold_open())

    async def _refuse(self, code: int) -> None:
        """Accept, then close with ``code``: the browser sees the code (a refused handshake
        would only give it 1006). Frames that arrive before the close completes are dropped."""
        self.is_closed = True
        await self.accept()
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        self.is_closed = True
        if self.run is not None:
            await self._stop(self.run)
        await self._leave()

    async def _leave(self) -> None:
        self._stop_socket_tasks()
        if self.relay is not None:
            relay, self.relay = self.relay, None
            await relay.leave()

    def _stop_socket_tasks(self) -> None:
        if self.mirror_checker is not None:
            self.mirror_checker.cancel()
            self.mirror_checker = None
        if self.holder is not None:
            self.holder.cancel()
            self.holder = None
        if self.relay is not None:
            self.relay.abandon()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.is_closed:
            return
        frame, problem = _read_frame(text_data)
        # stops have a budget of their own: a user's stop is never refused for the frames
        # before it (a settings flood, say), and stops alone cannot flood either
        is_stop = frame is not None and frame["type"] == "stop"
        if not await self._within_budget(is_stop):
            return
        if problem is not None:
            await self._error(*problem)
            return
        assert frame is not None
        handler = getattr(self, f"on_{frame['type']}", None) if frame["type"].isalpha() else None
        if handler is None:
            await self._error("unknown_type", f"Unknown frame type {frame['type'][:40]!r}.")
            return
        if frame["type"] == "stop" and self.run is not None:
            # at once: the checks below wait their turn on the database thread, and a reply
            # streaming meanwhile could end before the stop that the user sent
            self.run.cancel()
        try:
            await self._handle(frame, handler)
        except ValidationError as exc:
            await self._error("invalid_request", " ".join(exc.messages))
        except Exception as exc:  # the database or the cache failed: the socket is not lost
            if not isinstance(exc, OperationalError | InterfaceError) and (
                await self._was_deleted_or_none()
            ):
                # another window deleted it between this frame's checks and its writes (a
                # database out of reach is not asked again: its wait would double)
                await self._lose_deleted()
                return
            logger.exception(
                "conversation %s: a %s frame failed", self.conversation.pk, frame["type"]
            )
            await self._error(
                "unavailable", runs.UNAVAILABLE, retry_after=runs.UNAVAILABLE_RETRY_AFTER_SECONDS
            )

    async def _handle(self, frame: dict, handler: Callable[[dict], Awaitable[None]]) -> None:
        # Every frame, a stop too: the session may have ended since the socket opened.
        if not await self._is_signed_in():
            await self._lose_session()
            return
        if frame["type"] != "stop" and not await self._refresh():
            if await self._was_deleted():
                await self._lose_deleted()
                return
            await self._lose_forbidden()
            return
        if frame["type"] != "stop":
            self.allowed_at = time.monotonic()
        await handler(frame)

    async def _lose_session(self) -> None:
        await self._lose_access(
            CLOSE_UNAUTHENTICATED, "unauthenticated", "Your session has ended. Sign in again."
        )

    async def _lose_deleted(self) -> None:
        await self._lose_access(CLOSE_DELETED, "deleted", "This conversation was deleted.")

    async def _lose_forbidden(self) -> None:
        await self._lose_access(
            CLOSE_FORBIDDEN, "forbidden", "You no longer have access to this conversation."
        )

    async def _lose_deleted_or_access(self) -> None:
        """Another window deleted the conversation: close, telling one who lost the tenant
        meanwhile only that. With the database out of reach, the next frame finds out."""
        try:
            is_deleted = await self._was_deleted()
        except Exception:  # noqa: BLE001
            logger.warning("conversation %s: deleted, but who may know?", self.conversation.pk)
            return
        await (self._lose_deleted() if is_deleted else self._lose_forbidden())

    async def _lose_access(self, close_code: int, error_code: str, message: str) -> None:
        """Tell the client why, stop the reply being generated, and close (once: a frame and
        the reply's access guard may both find it)."""
        if self.is_closed:
            return
        await self._error(error_code, message)
        self.is_closed = True  # the stopped reply is saved, but no more frames go out
        if self.run is not None:
            await self._stop(self.run)
        await self.close(code=close_code)

    # --- frames -----------------------------------------------------------------------------

    async def on_send(self, frame: dict) -> None:
        async with self._claim() as claim:
            if claim is None:
                return
            is_untitled = not self.conversation.title
            message = await database_sync_to_async(services.message_send)(
                conversation=self.conversation, content=frame.get("content")
            )
            await self._send_all({"type": "message", "message": message_payload(message)})
            if is_untitled:  # the first message titled the conversation
                settings = settings_payload(self.conversation)
                await self._send_all({"type": "settings", "settings": settings})
            await self._start_reply(claim, after_id=message.pk)

    async def on_stop(self, frame: dict) -> None:
        if self.run is not None:
            await self._stop(self.run)
        elif self.relay is not None:  # the reply, if any, is another window's
            reply_id = frame.get("message_id")
            if isinstance(reply_id, bool) or not isinstance(reply_id, int):
                reply_id = None  # whichever reply runs
            await self.relay.publish({"type": "chat.stop", "reply_id": reply_id}, to_all=True)

    async def on_sync(self, frame: dict) -> None:
        async with self.relay_lock:
            await self._send_saved()

    async def on_regenerate(self, frame: dict) -> None:
        async with self._claim() as claim:
            if claim is None:
                return
            after_id, replaces = await database_sync_to_async(services.reply_prepare_regenerate)(
                conversation=self.conversation
            )
            await self._start_reply(claim, after_id=after_id, replaces=replaces)

    async def on_edit(self, frame: dict) -> None:
        message_id = frame.get("message_id")
        if isinstance(message_id, bool) or not isinstance(message_id, int):
            raise ValidationError("message_id must be a message's id.")
        async with self._claim() as claim:
            if claim is None:
                return
            # saved, with what follows dropped, once its reply holds an answer (a refused
            # one changes nothing): the pages show it edited meanwhile
            message, content, later = await database_sync_to_async(services.message_edit_check)(
                conversation=self.conversation, message_id=message_id, content=frame.get("content")
            )
            edited = {**message_payload(message), "content": content}
            await self._start_reply(
                claim,
                after_id=message.pk,
                replaces=later,
                edit=(message.pk, content),
                announce={"type": "message", "message": edited},
            )

    async def on_settings(self, frame: dict) -> None:
        changes = {name: frame[name] for name in SETTINGS_FIELDS if name in frame}
        self.conversation = await database_sync_to_async(services.conversation_configure)(
            conversation=self.conversation, **changes
        )
        await self._send_all({"type": "settings", "settings": settings_payload(self.conversation)})

    # --- one reply --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _claim(self) -> AsyncIterator[str | None]:
        """Claim the conversation before changing it for a new reply (no other socket or
        process may be generating one); yields the claim's token, or None, having told the
        client, when busy. The reply started inside keeps the claim until it ends; an error
        gives it back."""
        if self.run is not None:
            await self._error("busy", "A reply is still being generated; stop it first.")
            yield None
            return
        token = await claims.aclaim(self.conversation)
        if token is None:
            await self._error("busy", "A reply is being generated in another window.")
            yield None
            return
        num_started = self.num_replies_started
        try:
            # Nobody held the claim: a reply still saved as streaming was left by a process
            # that died while writing it.
            await database_sync_to_async(services.replies_interrupt)(conversation=self.conversation)
            yield token
        finally:
            if self.num_replies_started == num_started:  # nothing was started after all
                await claims.arelease(self.conversation, token)

    async def _start_reply(
        self,
        claim: str,
        after_id: int,
        replaces: list[int] | None = None,
        edit: tuple[int, str] | None = None,
        announce: dict | None = None,
    ) -> None:
        """Start a reply after ``after_id``; ``announce``: a frame for every window once the
        reply exists (an edit shown only once its reply can run)."""
        reply = await database_sync_to_async(services.reply_start)(
            conversation=self.conversation,
            request_id=f"chat-{uuid.uuid4().hex}",
            is_replacement=bool(replaces) or edit is not None,
        )
        self.num_replies_started += 1
        self.run = run = _Run(reply=reply, claim=claim, replaces=replaces or [], edit=edit)
        if self.relay is not None:
            run.text_relay = TextRelay(self.relay, reply.pk)
        run.keeper = asyncio.create_task(
            claims.akeep(self.conversation, run.claim, on_deleted=partial(self._deleted, run))
        )
        run.guard = asyncio.create_task(self._guard_access(run))
        if announce is not None:
            await self._send_all(announce)
        await self._send_all({"type": "start", "message_id": reply.pk, "after_id": after_id})
        if run.is_stop_asked:  # another window's stop, or a deletion, came meanwhile
            await self._stop(run)
            return
        run.task = asyncio.create_task(self._generate(run))

    async def _generate(self, run: _Run) -> None:
        try:
            await generate_reply(
                conversation=self.conversation,
                reply=run.reply,
                user=self.user,
                outcome=run.outcome,
                on_text=partial(self._send_text, run),
                replaces=run.replaces,
                edited=run.edit,
            )
        except asyncio.CancelledError:
            # A stop: the task ends normally, saving the partial reply below.
            run.is_stopped = True
        except ChatError as exc:
            run.error = exc
        except Exception:
            logger.exception("chat reply %s failed", run.reply.request_id)
            run.error = ChatError("internal_error", "Something went wrong. Please try again.")
        run.is_generating = False
        await self._finish(run)

    async def _guard_access(self, run: _Run) -> None:
        """While ``run`` generates, check the user's access every ``ACCESS_RECHECK_SECONDS``:
        one signed out, deactivated or removed from the tenant meanwhile is closed as for a
        frame of their own, the reply stopped and saved. Without it a reply went on streaming
        to them (and billing their tenant) until they sent a frame."""
        while not run.is_finished:
            await asyncio.sleep(ACCESS_RECHECK_SECONDS)
            async with self.relay_lock:  # one check at a time with the relayed messages'
                if run.is_finished or self.is_closed:
                    return
                await self._still_allowed()

    def _deleted(self, run: _Run) -> None:
        """The conversation was deleted while ``run`` generated its reply: stop it; its end
        closes the socket."""
        run.is_deleted = True
        run.cancel()

    async def _send_text(self, run: _Run, text: str) -> None:
        if run.is_stop_asked:
            # the cancel was lost: an await that ended as it came may swallow it (Python
            # 3.11's wait_for does); the next token ends the reply instead
            raise asyncio.CancelledError
        await self._send({"type": "token", "text": text})
        if run.text_relay is not None:
            run.text_relay.add(text)

    async def _stop(self, run: _Run) -> None:
        run.cancel()
        if run.task is not None:
            await asyncio.wait([run.task])
        # A task cancelled before it ever ran never reached _finish.
        run.is_stopped = run.is_stopped or not run.is_finished
        await self._finish(run)

    async def _finish(self, run: _Run) -> None:
        """Save the reply, free the conversation, tell the client; once per reply."""
        if run.is_finished:
            return
        run.is_finished = True
        outcome, error = run.outcome, run.error
        is_saved = False
        is_replacing = False  # a regenerate or an edit settled: the windows look again
        if error is not None:
            status = Message.Status.ERROR
        elif run.is_stopped:
            status = Message.Status.STOPPED
        else:
            status = Message.Status.COMPLETE
        try:
            if not run.is_deleted:
                saved = {
                    "message": run.reply,
                    "content": outcome.text,
                    "status": status,
                    "finish_reason": outcome.finish_reason,
                    "error_code": error.code if error else "",
                    "error_message": error.message if error else "",
                    "prompt_tokens": outcome.prompt_tokens,
                    "completion_tokens": outcome.completion_tokens,
                }
                if run.reply.is_replacement:
                    await database_sync_to_async(services.reply_finish_replacing)(
                        conversation=self.conversation,
                        replaced_ids=run.replaces,
                        edit=run.edit,
                        **saved,
                    )
                    is_replacing = True
                else:
                    await database_sync_to_async(services.reply_finish)(**saved)
                is_saved = True
        except services.ConversationDeleted:
            run.is_deleted = True
        except Exception:
            logger.exception("chat reply %s could not be saved", run.reply.request_id)
            error = ChatError("internal_error", "The reply could not be saved. Please try again.")
        finally:
            if run.keeper is not None:
                run.keeper.cancel()
            if run.guard is not None and not self.is_closed:
                # a closing socket's guard may be the one closing it: it ends by itself
                run.guard.cancel()
            if run.text_relay is not None:
                run.text_relay.close()
            await claims.arelease(self.conversation, run.claim)
            if self.run is run:
                self.run = None
        if is_saved and self.relay is not None:  # reply_finish updated run.reply
            await self.relay.publish(
                {
                    "type": "chat.frame",
                    "frame": {
                        "type": "done",
                        "message_id": run.reply.pk,
                        "status": run.reply.status,
                        "finish_reason": outcome.finish_reason,
                        "usage": outcome.usage(),
                        "message": message_payload(run.reply),
                    },
                }
            )
        if run.is_deleted:
            # the usage is metered all the same (by the run); the socket has nothing to show
            if not self.is_closed:
                self.is_closed = True
                await self.close(code=CLOSE_DELETED)
            return
        if error is not None:
            await self._error(error.code, error.message, error.retry_after, run.reply.pk)
        else:
            await self._send(
                {
                    "type": "done",
                    "message_id": run.reply.pk,
                    "status": status,
                    "finish_reason": outcome.finish_reason,
                    "usage": outcome.usage(),
                }
            )
        if is_replacing:
            # The pages dropped the replaced messages at the start, and a window that synced
            # meanwhile shows them: each window sends its page what is saved now, as it would
            # for a sync (not a frame of this one's: another window may have started a reply
            # since the claim went). This one's, under relay_lock, on a task of its own: a
            # relayed stop holds that lock while it waits for this end.
            self.resync = asyncio.create_task(self._resync())
            if self.relay is not None:
                await self.relay.publish({"type": "chat.resync"}, to_all=True)

    # --- the conversation's other windows (chat.relay) ---------------------------------------

    async def _on_relayed(self, message: dict) -> None:
        async with self.relay_lock:
            if self.is_closed:
                return
            kind = message["type"]
            if kind in ("chat.frame", "chat.text", "chat.snapshot", "chat.resync") and not (
                await self._still_allowed()
            ):
                return
            if kind == "chat.frame":
                await self._on_relayed_frame(message["frame"])
            elif kind == "chat.text":
                reply_id = message["reply_id"]
                if self.run is None and self.mirror.is_new(reply_id):
                    await self._catch_up(reply_id)
                    return
                text, is_gap = self.mirror.piece(reply_id, message["offset"], message["text"])
                await self._send_relayed_text(text)
                if is_gap:
                    await self.relay.send_to(
                        message["sender"], {"type": "chat.snapshot_request", "reply_id": reply_id}
                    )
            elif kind == "chat.snapshot":
                await self._send_relayed_text(
                    self.mirror.snapshot(message["reply_id"], message["text"])
                )
            elif kind == "chat.snapshot_request":
                run = self.run
                if run is not None and run.reply.pk == message["reply_id"]:
                    snapshot = {"type": "chat.snapshot", "reply_id": run.reply.pk}
                    await self.relay.send_to(
                        message["sender"], {**snapshot, "text": run.outcome.text}
                    )
            elif kind == "chat.stop":
                run, reply_id = self.run, message.get("reply_id")
                if run is not None and reply_id in (None, run.reply.pk):
                    await self._stop(run)
            elif kind == "chat.resync":  # a regenerate or an edit settled in another window
                # one that runs a reply shows its own; the others reload (an edit may retitle)
                if self.run is None and await self._still_allowed(is_forced=True):
                    await self._send_saved()
            elif kind == "chat.deleted":
                if self.run is not None:
                    self._deleted(self.run)  # its end closes the socket
                else:
                    await self._lose_deleted_or_access()

    async def _on_relayed_frame(self, frame: dict) -> None:
        if frame["type"] == "start":
            self.mirror.watch(frame["message_id"])
        elif frame["type"] == "done":
            if self.run is None and self.mirror.is_new(frame["message_id"]):
                await self._catch_up(frame["message_id"])  # its page never saw it start
                return
            self.mirror.end(frame["message_id"])
        await self._send({**frame, "relayed": True})

    async def _catch_up(self, reply_id: int) -> None:
        """A reply this window missed the start of: sync (which follows it, if it runs)."""
        await self._send_saved()
        if self.mirror.reply_id != reply_id:
            self.mirror.end(reply_id)  # it ended: its late pieces bring no second sync

    async def _still_allowed(self, *, is_forced: bool = False) -> bool:
        """Whether the socket's user may still be shown the conversation: signed in, with
        access. Checked at most every ``ACCESS_RECHECK_SECONDS`` unless ``is_forced`` (its own
        frames are checked each time); when not, the socket is told why and closed. With the
        database out of reach, nothing is shown meanwhile."""
        if not is_forced and time.monotonic() - self.allowed_at < ACCESS_RECHECK_SECONDS:
            return True
        try:
            if not await self._is_signed_in():
                await self._lose_session()
                return False
            if not await self._refresh():
                await self._lose_deleted_or_access()
                return False
        except Exception:  # noqa: BLE001 - asked again with the next relayed message
            logger.warning("conversation %s: could not check its window", self.conversation.pk)
            return False
        self.allowed_at = time.monotonic()
        return True

    async def _send_relayed_text(self, text: str) -> None:
        if text:
            await self._send({"type": "token", "text": text, "relayed": True})

    async def _send_saved(self) -> None:
        """Send the conversation as saved, and follow the reply that another window generates,
        asking it for its text so far. Under ``relay_lock``."""
        frame = await self._sync_frame()
        await self._send(frame)
        if self.run is not None:
            return
        generating = frame["generating"]
        if generating is None:
            self.mirror.forget()
        elif self.mirror.watch(generating) and self.relay is not None:
            self.mirror.ask_snapshot()
            request = {"type": "chat.snapshot_request", "reply_id": generating}
            await self.relay.publish(request, to_all=True)

    async def _resync(self) -> None:
        async with self.relay_lock:
            # reloaded: settings changed in another window meanwhile, a title an edit made
            if (
                not self.is_closed
                and self.run is None
                and await self._still_allowed(is_forced=True)
            ):
                await self._send_saved()

    async def _sync_frame(self) -> dict:
        messages, generating = await self._saved_messages()
        return {
            "type": "sync",
            "messages": [message_payload(message) for message in messages],
            "settings": settings_payload(self.conversation),
            "generating": generating,
        }

    @database_sync_to_async
    def _saved_messages(self) -> tuple[list[Message], int | None]:
        """The conversation's messages, and the id of the reply being generated (None: none).
        Replies left streaming by a process that died are settled (``replies_interrupt``), as
        the page does."""
        is_claimed = services.replies_interrupt_unless_claimed(conversation=self.conversation)
        messages = list(selectors.conversation_messages(conversation=self.conversation))
        run = self.run
        if run is not None:  # the messages it replaces are gone for the page already
            if run.edit is not None:
                for message in messages:
                    if message.pk == run.edit[0]:
                        message.content = run.edit[1]  # shown edited, not saved yet
            return [m for m in messages if m.pk not in run.replaces], run.reply.pk
        last = messages[-1] if messages else None
        if is_claimed and last is not None and last.status == Message.Status.STREAMING:
            return messages, last.pk
        return messages, None

    async def _hold_open(self) -> None:
        """While the socket is open, mark its conversation open every
        ``services.HOLD_RENEW_SECONDS``: a page left open on a conversation not written in
        yet keeps it from the purge of empty ones. A database out of reach is tried again at
        the next mark (the grace outlasts several)."""
        while True:
            try:
                await database_sync_to_async(services.conversation_hold)(
                    conversation_id=self.conversation.pk
                )
            except Exception:  # noqa: BLE001 - the socket is not lost for it
                logger.warning("conversation %s: could not mark it open", self.conversation.pk)
            await asyncio.sleep(services.HOLD_RENEW_SECONDS)

    async def _check_mirror(self) -> None:
        """While this window follows another's reply and hears nothing of it, look every
        ``MIRROR_CHECK_SECONDS`` whether it ended (its claim freed); then sync, so the page
        never shows a finished reply as still being written (its ``done`` may have been lost,
        or sent before the other window knew of this one)."""
        while True:
            await asyncio.sleep(MIRROR_CHECK_SECONDS)
            try:
                if self.relay is not None:
                    await self.relay.refresh()
                if self.is_closed or not self.mirror.is_stale(MIRROR_CHECK_SECONDS):
                    continue
                if await claims.ais_claimed(self.conversation):
                    self.mirror.heard_of()
                    continue
                async with self.relay_lock:
                    if self.mirror.reply_id is None or self.is_closed:
                        continue
                    # checked now: the sync reloads the conversation
                    if await self._still_allowed(is_forced=True):
                        await self._send_saved()
            except Exception:  # noqa: BLE001 - looked at again next time
                logger.warning("conversation %s: could not check its reply", self.conversation.pk)

    # --- helpers ----------------------------------------------------------------------------

    async def _send(self, frame: dict) -> None:
        if not self.is_closed:
            await self.send(text_data=json.dumps(frame))

    async def _send_all(self, frame: dict) -> None:
        """Send ``frame`` to this window and relay it to the conversation's others."""
        await self._send(frame)
        if self.relay is not None:
            await self.relay.publish({"type": "chat.frame", "frame": frame})

    async def _within_budget(self, is_stop: bool) -> bool:
        """Whether this frame may be handled; past its budget (``chat.frame_budget``), the
        first frame refused is answered ``too_many_frames`` and the rest are dropped unhandled
        until the budget allows one again."""
        if self.frame_budgets is None:
            self.frame_budgets = {False: FrameBudget(), True: FrameBudget.for_stops()}
        budget = self.frame_budgets[is_stop]
        wait = budget.take()
        if not wait:
            return True
        if budget.first_refusal():
            await self._error(
                "too_many_frames",
                f"Too many {'stops' if is_stop else 'frames'}: a socket may send "
                f"{budget.burst} at once and {budget.per_second:g} a second after that.",
                retry_after=retry_after_seconds(wait),
            )
        return False

    async def _error(
        self,
        code: str,
        message: str,
        retry_after: int | None = None,
        message_id: int | None = None,
    ) -> None:
        frame = {"type": "error", "code": code, "message": message}
        if retry_after is not None:
            frame["retry_after"] = retry_after
        if message_id is not None:
            frame["message_id"] = message_id
        await self._send(frame)

    def _active_tenant(self, user):
        """The tenant the user chats as in this socket's session (None: none they belong to)."""
        return selectors.active_tenant(
            user=user, session_tenant_id=self.scope["session"].get(SESSION_TENANT_KEY)
        )

    @database_sync_to_async
    def _conversation(self, user, conversation_id: int) -> Conversation | None:
        tenant = self._active_tenant(user)
        if tenant is None:
            return None
        return selectors.conversation_get(user=user, tenant=tenant, conversation_id=conversation_id)

    async def _is_signed_in(self) -> bool:
        """Whether the socket's session still signs its user in (one query); the user is
        reloaded, so the frame is handled with their current state."""
        user = await self._session_user()
        if user is None:
            return False
        self.user = user
        return True

    @database_sync_to_async
    def _session_user(self):
        return selectors.session_user(
            session_key=self.scope["session"].session_key, user_id=self.user.pk
        )

    async def _refresh(self) -> bool:
        """Reload the conversation with its tenant and plan, so that a changed plan, limit or
        membership counts from the next frame on; False when access is gone."""
        conversation = await self._conversation(self.user, self.conversation.pk)
        if conversation is None:
            return False
        self.conversation = conversation
        return True

    @database_sync_to_async
    def _was_deleted(self) -> bool:
        """Whether the conversation is gone while its owner still chats as its tenant; one
        who lost the tenant is told nothing more of it."""
        tenant = self._active_tenant(self.user)
        if tenant is None or tenant.pk != self.conversation.tenant_id:
            return False
        return not selectors.conversation_exists(conversation_id=self.conversation.pk)

    async def _was_deleted_or_none(self) -> bool:
        """``_was_deleted``, or False when the database cannot say (the frame's own failure)."""
        try:
            return await self._was_deleted()
        except Exception:
            return False
