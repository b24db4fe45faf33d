"""``AsyncEngineClient``: the web tier's connection to one engine process. No torch, no Django.

    client = AsyncEngineClient("ipc:///tmp/engine.sock")
    await client.wait_ready(timeout=60)
    async for delta in client.generate(GenerateRequest(prompt="Hello")):
        print(delta.text, end="")
    stats = await client.stats()
    client.close()

One DEALER socket carries every stream of one event loop; a reader task routes the engine's
frames to the streams by ``request_id``. Leaving a stream early (``break``, ``aclose()``,
cancelling its task) sends ABORT; ``contextlib.aclosing`` makes that happen at once rather than
when the generator is collected. The engine answers an abort with the request's last delta,
whose ``usage`` is what it computed for the request; ``final_delta`` waits for it, so a caller
that left a stream early can still meter it exactly. Errors the engine reports arrive as the
stream's last delta (``finish_reason`` "error", ``error`` a code). When the engine stays silent
past ``heartbeat_timeout`` (the client sends STATS every ``heartbeat_interval`` and any frame
counts as an answer), every open stream raises ``EngineUnavailable``; ZeroMQ reconnects on its
own when the engine comes back, and new requests work again. A STATS answer from a new engine
process (another ``engine_id``) fails the open streams too: their requests died with the old
one. A request that cannot be sent to an engine that is connected (the send queue is full,
``SEND_HWM`` messages: a burst faster than the engine reads) waits up to ``send_wait``
seconds for room, then raises ``EngineOverloaded``: the engine is up, so it is worth a retry,
and it is no sign of a dead engine. (A send refused because the engine just went away, before
the socket's monitor says so, ends the wait at the disconnect: ``EngineUnavailable``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from inference_engine.protocol import (
    ENGINE_TOKEN_ENV,
    HANDSHAKE_FAILED,
    HANDSHAKE_FAILURE_LOG_SECONDS,
    AbortRequest,
    ControlRequest,
    ControlResponse,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    RequestType,
    ResponseType,
    StatsResponse,
    handshake_failed_events,
    link_keys,
)

logger = logging.getLogger(__name__)

# how long the last delta of a stream left early is kept for ``final_delta``
ABANDONED_TTL_SECONDS = 60.0
# messages queued for the engine before a send is refused (ZeroMQ's default is 1,000: one burst
# of a web process's requests, each one message, could fill it)
SEND_HWM = 100_000
# Waits are bounded with asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a
# cancel that lands as what it waits for finishes, and a stopped chat reply ran on.
SEND_WAIT_SECONDS = 0.5
HANDSHAKE_FAILED_EVENTS = handshake_failed_events()
# aborts kept for the engine's reconnect at most (the rest are ended by its silent-client check)
MAX_UNSENT_ABORTS = 10_000


class EngineUnavailable(ConnectionError):
    """The engine cannot be reached, stopped answering, or the client was closed."""


class EngineOverloaded(Exception):
    """The engine is connected, but the queue of messages to it is full: retry shortly."""


class AsyncEngineClient:
    def __init__(
        self,
        endpoint: str,
        *,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        send_hwm: int = SEND_HWM,
        send_wait: float = SEND_WAIT_SECONDS,
        token: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        # the link's token (``protocol.link_keys``): the environment's ENGINE_TOKEN if not given
        self.token = token or os.environ.get(ENGINE_TOKEN_ENV) or None
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.send_hwm = send_hwm
        self.send_wait = send_wait
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        # request_id -> (queue of deltas or an exception, when the stream started)
        self._streams: dict[str, tuple[asyncio.Queue, float]] = {}
        # request_id -> (its last delta, or None once it cannot come; when it was left), for
        # streams left before they finished
        self._abandoned: dict[str, tuple[asyncio.Future, float]] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._latest_stats: StatsResponse | None = None
        self._latest_stats_at = 0.0
        self._control_waiters: list[asyncio.Future] = []
        self._last_heard = 0.0
        self._started_at = 0.0
        self._has_heard = False
        self._is_connected = False  # a connection to the engine is up (its handshake done)
        self._disconnected: asyncio.Event | None = None  # set when that connection drops
        self._engine_id: str | None = None
        self._handshake_failure: str | None = None  # why the last handshake failed
        self._handshake_logged_at = -math.inf
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        self._deltas_decoder = msgspec.msgpack.Decoder(list[GenerateDelta])
        self._raw_deltas_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._delta_decoder = msgspec.msgpack.Decoder(GenerateDelta)
        # aborts that found no engine connected: sent once one is again (the engine they
        # were for, reconnected, would otherwise generate them to the end for nobody)
        self._unsent_aborts: set[str] = set()
        self._stats_decoder = msgspec.msgpack.Decoder(StatsResponse)
        self._control_decoder = msgspec.msgpack.Decoder(ControlResponse)

    # -- public API --------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream the request's deltas; the last one has ``finish_reason`` set. Fills
        ``request.request_id`` with a uuid when it is None. Raises ``EngineUnavailable``, or
        ``EngineOverloaded`` when the request cannot be sent to a connected engine."""
        self._start()
        if request.request_id is None:
            request.request_id = uuid.uuid4().hex
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already streaming")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (stream, time.monotonic())
        finished = False
        failure: BaseException | None = None
        try:
            await self._send_generate(request)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    # still sends ABORT: a stalled engine that resumes drops the request
                    failure = item
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abandon(request_id, stream, is_lost=failure is not None)
                if not self._send(RequestType.ABORT, AbortRequest([request_id])):
                    self._keep_abort(request_id)

    async def _send_generate(self, request: GenerateRequest) -> None:
        """Send, or wait up to ``send_wait`` while the queue to a connected engine is full;
        raises ``EngineOverloaded`` or ``EngineUnavailable`` (see the module docstring)."""
        if await self._send_soon(RequestType.GENERATE, request):
            return
        if self._is_connected:
            frames = [RequestType.GENERATE.value, self._encoder.encode(request)]
            sending = asyncio.ensure_future(self._socket.send_multipart(frames))
            dropped = asyncio.ensure_future(self._disconnected.wait())
            try:
                await asyncio.wait(
                    [sending, dropped], timeout=self.send_wait, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                dropped.cancel()
                sending.cancel()  # not sent by now: never (a cancelled caller's request too)
            if not sending.cancelled() and sending.exception() is None:
                return
            if self._is_connected:
                raise EngineOverloaded(
                    f"the queue to the engine at {self.endpoint} stayed full for "
                    f"{self.send_wait}s ({self.send_hwm} messages)"
                )
        raise self._not_connected()

    async def final_delta(self, request_id: str, timeout: float) -> GenerateDelta | None:
        """The last delta of a stream left before it finished (the engine's answer to its
        abort: ``usage`` holds the prompt tokens it computed and every token it generated).
        None when the request is unknown here or the engine does not answer in ``timeout``
        seconds (it died: the stream's own reads are then all there is to go by)."""
        entry = self._abandoned.get(request_id)
        if entry is None:
            return None
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(entry[0])
        except TimeoutError:
            return None
        finally:
            self._abandoned.pop(request_id, None)

    def _abandon(self, request_id: str, stream: asyncio.Queue, *, is_lost: bool) -> None:
        """Remember a stream left early; its last delta may already be in its queue, or
        never come (``is_lost``: the stream failed, the engine is gone or restarted)."""
        last = asyncio.get_running_loop().create_future()
        if is_lost:
            last.set_result(None)
        while not last.done() and not stream.empty():
            item = stream.get_nowait()
            if isinstance(item, BaseException):
                last.set_result(None)
                break
            if item.finish_reason is not None:
                last.set_result(item)
                break
        self._abandoned[request_id] = (last, time.monotonic())

    def latest_stats(self) -> tuple[StatsResponse | None, float]:
        """The newest STATS the engine sent (every heartbeat refreshes it) and its age in
        seconds; (None, inf) before the first."""
        if self._latest_stats is None:
            return None, math.inf
        return self._latest_stats, time.monotonic() - self._latest_stats_at

    async def abort(self, request_id: str) -> None:
        """Ask the engine to abort a request; its stream ends with finish reason "abort"."""
        self._start()
        self._send(RequestType.ABORT, AbortRequest([request_id]))

    async def stats(self, timeout: float | None = None) -> StatsResponse:
        """The engine's health and load. Raises ``EngineUnavailable`` when it does not answer
        within ``timeout`` (default: the heartbeat timeout)."""
        self._start()
        timeout = timeout or self.heartbeat_timeout
        deadline = time.monotonic() + timeout
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        try:
            if not await self._send_soon(RequestType.STATS, None, deadline):
                raise self._not_connected()
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                return await waiter
        except TimeoutError:
            raise EngineUnavailable(f"no answer from the engine at {self.endpoint}") from None
        finally:
            with contextlib.suppress(ValueError):
                self._stats_waiters.remove(waiter)

    async def wait_ready(self, timeout: float = 60) -> StatsResponse:
        """Wait until the engine answers STATS with ``ready``; raises ``EngineUnavailable``
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = f": {self._handshake_failure}" if self._handshake_failure else ""
                raise EngineUnavailable(f"the engine at {self.endpoint} is not ready{reason}")
            with contextlib.suppress(EngineUnavailable):
                stats = await self.stats(timeout=min(left, 1.0))
                if stats.ready:
                    return stats
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))

    async def control(self, request: ControlRequest) -> ControlResponse:
        """Ask the engine to load a model or unload its own; its answer says whether it did.
        Raises ``EngineUnavailable`` when no engine answers in time."""
        self._start()
        waiter = asyncio.get_running_loop().create_future()
        self._control_waiters.append(waiter)
        try:
            if not await self._send_soon(RequestType.CONTROL, request):
                raise self._not_connected()
            async with asyncio.timeout(self.heartbeat_timeout):
                return await waiter
        except TimeoutError:
            raise EngineUnavailable(f"no answer from the engine at {self.endpoint}") from None
        finally:
            with contextlib.suppress(ValueError):
                self._control_waiters.remove(waiter)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def num_buffered(self, request_id: str) -> int:
        """Deltas of ``request_id`` received and not yet taken by its ``generate``: a consumer
        that falls behind can see that more are ready and write them out together."""
        stream = self._streams.get(request_id)
        return stream[0].qsize() if stream is not None else 0

    def close(self) -> None:
        """Fail open streams with ``EngineUnavailable`` and close the socket."""
        self._closed = True
        self._close_link(EngineUnavailable("the client was closed"))

    def _close_link(self, exc: EngineUnavailable) -> None:
        """Stop the link's tasks, fail its open streams with ``exc`` and close its sockets;
        the next send (``_start``) opens a new link, unless the client is closed."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._fail_all(exc)
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- internals ---------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise EngineUnavailable("the client was closed")
        if self._socket is not None:
            return
        self._ctx = zmq.asyncio.Context()
        socket = self._ctx.socket(zmq.DEALER)
        # queue nothing while no engine is connected: a send then fails at once
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.SNDHWM, self.send_hwm)
        # a fixed routing id survives reconnects, so the engine's replies still find us
        socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        if self.token:
            keys = link_keys(self.token)
            socket.curve_secretkey = keys.client_secret
            socket.curve_publickey = keys.client_public
            socket.curve_serverkey = keys.server_public
        self._monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS
        )
        socket.connect(self.endpoint)
        self._socket = socket
        self._last_heard = self._started_at = time.monotonic()
        self._has_heard = self._is_connected = False  # a new link: connecting
        self._disconnected = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="engine-client-reader"),
            asyncio.create_task(self._heartbeat_loop(), name="engine-client-heartbeat"),
            asyncio.create_task(self._disconnect_loop(), name="engine-client-monitor"),
        ]

    def _send(self, kind: RequestType, message: msgspec.Struct | None) -> bool:
        """Send without waiting; False when no engine is connected (or the send failed)."""
        if self._socket is None:
            return False
        payload = b"" if message is None else self._encoder.encode(message)
        future = self._socket.send_multipart([kind.value, payload], flags=zmq.NOBLOCK)
        if future.done():
            return future.exception() is None
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True

    def _keep_abort(self, request_id: str) -> None:
        if len(self._unsent_aborts) < MAX_UNSENT_ABORTS:
            self._unsent_aborts.add(request_id)

    def _send_kept_aborts(self) -> None:
        """On a reconnect: the aborts no engine was connected to take."""
        if self._unsent_aborts and self._send(
            RequestType.ABORT, AbortRequest(sorted(self._unsent_aborts))
        ):
            self._unsent_aborts.clear()

    async def _send_soon(
        self, kind: RequestType, message: msgspec.Struct | None, deadline: float = math.inf
    ) -> bool:
        """Like ``_send``, but a client that has not heard from the engine yet (its socket may
        still be connecting) keeps trying for up to ``heartbeat_timeout`` from its start, and
        no later than ``deadline`` (the caller's own timeout)."""
        deadline = min(deadline, self._started_at + self.heartbeat_timeout)
        while not self._send(kind, message):
            if self._has_heard or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _read_loop(self) -> None:
        """Read the engine's frames for as long as the link lives. A frame that cannot be
        handled is dropped alone; a socket that fails (it never should) ends the link: its
        streams fail at once and the next request opens a new one, where a reader that just
        stopped left every later request of this process waiting on replies nobody read."""
        socket = self._socket
        while True:
            try:
                frames = await socket.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                logger.exception("engine client socket failed: opening a new link")
                asyncio.get_running_loop().call_soon(
                    self._close_link,
                    EngineUnavailable(f"the link to the engine at {self.endpoint} failed: {exc}"),
                )
                return
            self._last_heard = time.monotonic()
            self._has_heard = True
            try:
                self._dispatch(frames)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                logger.warning("dropped a bad frame from the engine: %s", exc)
            except Exception:  # noqa: BLE001 - one frame's failure must not end the reader
                logger.exception("handling a frame from the engine failed; it was dropped")

    def _dispatch(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[-1]
        if kind == ResponseType.OUTPUTS.value:
            try:
                deltas = self._deltas_decoder.decode(payload)
            except msgspec.ValidationError:
                deltas = self._deltas_one_by_one(payload)
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream[0].put_nowait(delta)
                elif delta.finish_reason is not None:
                    abandoned = self._abandoned.get(delta.request_id)
                    if abandoned is not None and not abandoned[0].done():
                        abandoned[0].set_result(delta)
        elif kind == ResponseType.STATS.value:
            stats = self._stats_decoder.decode(payload)
            if stats.engine_id != self._engine_id:
                if self._engine_id is not None:
                    self._fail_all(EngineUnavailable(f"the engine at {self.endpoint} restarted"))
                    self._unsent_aborts.clear()  # their requests died with the old engine
                self._engine_id = stats.engine_id
            self._latest_stats, self._latest_stats_at = stats, time.monotonic()
            _resolve(self._stats_waiters, stats)
        elif kind == ResponseType.CONTROL.value:
            _resolve(self._control_waiters, self._control_decoder.decode(payload))

    def _deltas_one_by_one(self, payload: bytes) -> list[GenerateDelta]:
        """The deltas of a frame one of which this client cannot read (a value a newer engine
        knows, as a new error code): the others as they are, and that one as an engine error
        of its stream, which then ends instead of waiting for a delta that came unread."""
        deltas = []
        for raw in self._raw_deltas_decoder.decode(payload):
            try:
                deltas.append(self._delta_decoder.decode(raw))
            except msgspec.ValidationError as exc:
                request_id = _delta_request_id(raw)
                logger.warning("unreadable delta of %r from the engine: %s", request_id, exc)
                if request_id is not None:
                    deltas.append(
                        GenerateDelta(
                            request_id,
                            finish_reason=FinishReason.ERROR,
                            error=ErrorCode.ENGINE_ERROR,
                            error_message=f"the engine sent what this client cannot read: {exc}",
                        )
                    )
        return deltas

    async def _disconnect_loop(self) -> None:
        """A dropped connection (the engine process died or was restarted) fails the open
        streams at once, instead of after ``heartbeat_timeout`` of silence: their requests
        died with it. Also keeps ``_is_connected``."""
        monitor = self._monitor
        with contextlib.suppress(zmq.ZMQError):
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                self._is_connected = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                if self._is_connected:
                    self._disconnected = asyncio.Event()
                    self._handshake_failure = None
                    self._send_kept_aborts()
                else:
                    self._disconnected.set()
                if event["event"] & HANDSHAKE_FAILED_EVENTS:
                    self._on_handshake_failed()
                if event["event"] == zmq.EVENT_DISCONNECTED and self._streams:
                    self._fail_all(EngineUnavailable(f"the engine at {self.endpoint} went away"))

    def _on_handshake_failed(self) -> None:
        """An engine answered but the link's security did not match (a token on one side
        only, or two tokens): say so, at most once a minute, rather than only "not
        connected"."""
        self._handshake_failure = HANDSHAKE_FAILED
        now = time.monotonic()
        if now - self._handshake_logged_at >= HANDSHAKE_FAILURE_LOG_SECONDS:
            self._handshake_logged_at = now
            logger.warning("engine at %s: %s", self.endpoint, HANDSHAKE_FAILED)

    def _not_connected(self) -> EngineUnavailable:
        reason = f": {self._handshake_failure}" if self._handshake_failure else ""
        return EngineUnavailable(f"no engine connected at {self.endpoint}{reason}")

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._send(RequestType.STATS, None)
            now = time.monotonic()
            for request_id, (_, left_at) in list(self._abandoned.items()):
                if now - left_at > ABANDONED_TTL_SECONDS:
                    del self._abandoned[request_id]
            if now - self._last_heard <= self.heartbeat_timeout:
                continue
            self._forget_abandoned()
            # a stream gets a full timeout from its own start, so a request made while the
            # engine restarts can still be served
            for request_id, (stream, started) in list(self._streams.items()):
                if now - started > self.heartbeat_timeout:
                    self._streams.pop(request_id)
                    stream.put_nowait(self._unavailable())

    def _unavailable(self) -> EngineUnavailable:
        silent = time.monotonic() - self._last_heard
        return EngineUnavailable(f"the engine at {self.endpoint} has been silent for {silent:.1f}s")

    def _fail_all(self, exc: EngineUnavailable) -> None:
        for stream, _ in self._streams.values():
            stream.put_nowait(exc)
        self._streams.clear()
        self._forget_abandoned()

    def _forget_abandoned(self) -> None:
        """The engine is gone or silent: no last delta is coming for a stream left early."""
        for last, _ in self._abandoned.values():
            if not last.done():
                last.set_result(None)


def _resolve(waiters: list[asyncio.Future], result: object) -> None:
    """Every caller waiting gets the newest answer: a STATS reply is a snapshot."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(result)
    waiters.clear()


def _delta_request_id(raw: bytes) -> str | None:
    """The request id of an encoded delta (its first field), where it can be read."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None
