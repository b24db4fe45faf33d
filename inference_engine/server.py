"""The engine process: a ROUTER socket, an input thread, the busy loop and an output thread.

- The **I/O thread** owns the ROUTER socket (ZeroMQ sockets are not thread-safe). It decodes
  and validates client frames, refuses what it must at once (``invalid_request``,
  ``overloaded``, a prompt whose characters alone are more tokens than the context holds),
  answers STATS and CONTROL itself, hands generates to the intake thread and puts aborts on the
  busy loop's ``InputQueue`` (``queues.py``). It also forwards the frames of the output and
  intake threads, which arrive on an inproc PULL socket, to the ROUTER.
- The **intake thread** tokenizes prompts (applying the chat template), one request at a
  time in arrival order, refuses those that do not fit, and puts the rest on the
  ``InputQueue``. An abort of a request it holds follows the request through it. Off the I/O
  thread, a prompt of megabytes takes seconds of this thread alone (the tokenizer lets go of
  the GIL): heartbeats are answered and streams forwarded meanwhile. A request whose grammar
  is not compiled yet goes to the **compile queue** (``compile_queue.py``: a few threads, one
  compile at a time per tenant, each given ``grammar_compile_timeout``) and comes back to
  this thread when it is done; a model switch waits for the requests accepted before it.
- The **busy loop** (the main thread) applies queued aborts, adds and model switches, then runs
  ``EngineCore.step()`` and hands the outputs on. It does nothing else, except that under
  ``fair`` on the CPU a step pauses between layers to take the adds that arrived meanwhile
  and run a newcomer's first chunk at once (``EngineCore.admit_mid_step``; aborts and
  switches wait for the step's end).
- The **output thread** runs ``OutputProcessor`` (detokenize, stop strings, serialize) on one
  step's outputs while the next step runs, and pushes one frame per client per step. With
  ``async_output=False`` the busy loop does this work inline.

A client is known by its ROUTER identity; its request ids are namespaced by that identity in
the core, so one client can never abort another's request. A client sends STATS every
second (``AsyncEngineClient``'s heartbeat); one that has sent nothing for ``client_timeout``
seconds died (a web process killed mid-stream), and its requests are aborted instead of
running to their length for nobody. SIGTERM stops intake, lets
in-flight requests finish within the grace period, fails the rest with ``engine_error`` and
closes the sockets.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq

from inference_engine.compile_queue import CompileQueue, Outcome
from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.core import EngineCore, Refusal
from inference_engine.metrics import EngineMetrics
from inference_engine.model_control import LoadedModel, ModelController, load_model
from inference_engine.output_processor import OutputProcessor
from inference_engine.protocol import (
    HANDSHAKE_FAILED,
    HANDSHAKE_FAILURE_LOG_SECONDS,
    MAX_ID_CHARS,
    AbortRequest,
    ControlRequest,
    EngineOutput,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    RequestType,
    ResponseType,
    StatsResponse,
    Usage,
    handshake_failed_events,
    link_check,
    link_keys,
)
from inference_engine.queues import InputKind, InputQueue, QueuedAdd, QueuedInput, StepOutputs
from inference_engine.tokenization import (
    longest_token_chars,
    min_prompt_tokens,
    render_chat,
    tool_call_parser,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SHUT_DOWN_BEFORE_START = "the engine shut down before the request started"

# frames queued per client before ZeroMQ drops more; a client this far behind is stuck
SEND_HWM = 100_000
# how far past --max-frame-bytes the transport's own limit (MAXMSGSIZE) is set
TRANSPORT_FRAME_LIMIT_FACTOR = 4
# the exit code of an engine that took itself for hung (``ServerConfig.step_timeout``)
HUNG_EXIT_CODE = 70


@dataclass
class _Snapshot:
    """What the busy loop last saw; read by the I/O thread and by metrics scrapes."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)


@dataclass
class _Switch:
    """A model switch on its way to the busy loop, behind the requests accepted before it."""

    model: LoadedModel | None


@dataclass
class _Intake:
    """A generate the I/O thread accepted, for the intake thread to tokenize."""

    identity: bytes
    request: GenerateRequest
    req_id: str
    arrival: float


@dataclass
class _Compiled:
    """A request whose grammar the compile queue is done with, back to the intake thread."""

    item: _Intake
    token_ids: list[int]
    outcome: Outcome


class EngineServer:
    def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, token: str | None = None
    ) -> None:
        """``token`` secures the link (``protocol.link_keys``): only clients holding it are
        served; a network endpoint needs one (``protocol.link_check``)."""
        link_check(server_config.endpoint, token)
        self.engine_config = engine_config
        self.config = server_config
        self.token = token
        self.model_name = server_config.served_model_name or engine_config.model
        self.engine_id = uuid.uuid4().hex
        self.core: EngineCore | None = None
        self.input_tokenizer: PreTrainedTokenizerBase | None = None
        self.max_model_len = 0
        self.num_kv_blocks = 0
        self.snapshot = _Snapshot()
        self.metrics = EngineMetrics(
            self.model_name, self._gauges, lambda: self.snapshot.waiting_by_tenant
        )
        self.inputs = InputQueue()
        # its tokenizer is the serving model's, set when one is installed
        self.processor = OutputProcessor(None, abort=self._queue_abort, metrics=self.metrics)
        # None stops the output thread
        self.output_queue: queue.SimpleQueue[StepOutputs | None] = queue.SimpleQueue()
        # one writer each, so their difference (adds not yet in the core) needs no lock
        self._num_adds_queued = 0
        self._num_adds_taken = 0
        # written by the I/O thread and the busy loop respectively; their difference is in transit
        self._adds_queued_by_tenant: collections.Counter[str] = collections.Counter()
        self._adds_taken_by_tenant: collections.Counter[str] = collections.Counter()
        self.tenant_queue_cap = max(
            1, int(server_config.max_queued_requests * server_config.tenant_queue_share)
        )
        self._ready = threading.Event()
        self._draining = threading.Event()
        self._abort_now = threading.Event()
        self._io_stop = threading.Event()
        # when the busy loop's step under way began (monotonic); None between steps
        self._step_started_at: float | None = None
        self._io_bound = threading.Event()
        self._io_error: BaseException | None = None
        # I/O thread only: client identity -> time.monotonic() of its last frame
        self._last_heard: dict[bytes, float] = {}
        self._next_silence_check = 0.0
        self._last_loop_at = 0.0
        # generates (and the aborts and model switches that follow them) for the intake
        # thread; None stops it
        self._intake: queue.SimpleQueue[_Intake | _Compiled | _Switch | list[str] | None] = (
            queue.SimpleQueue()
        )
        # the requests the intake thread holds (added by the I/O thread, removed by intake)
        self._tokenizing: set[str] = set()
        # grammars compile there, off the intake thread (``compile_queue``)
        self._compiles = CompileQueue(
            server_config.grammar_compile_workers, server_config.grammar_compile_timeout
        )
        # intake thread only: the requests whose grammar is compiling, those of them aborted
        # meanwhile, and switches held until they are queued (a switch follows the requests
        # accepted before it)
        self._compiling: set[str] = set()
        self._aborted_compiling: set[str] = set()
        self._held_switches: list[_Switch] = []
        # written by the intake thread: adds counted as queued that it refused
        self._num_adds_refused = 0
        self._adds_refused_by_tenant: collections.Counter[str] = collections.Counter()
        self._longest_token_chars = 1
        self.controller = ModelController(
            engine_config, self._queue_switch, replace=server_config.model_swap == "replace"
        )
        self._pending_switch: QueuedInput | None = None
        # inputs taken between a step's layers that wait for its end (aborts, switches)
        self._deferred_inputs: list[QueuedInput] = []
        self.ctx = zmq.Context()
        self._authenticator = None  # the ZAP handler of a secured link
        self._handshake_logged_at = -float("inf")
        self._outputs_endpoint = f"inproc://engine-outputs-{id(self)}"

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        """Bind, load the model, serve until SIGTERM (or ``request_shutdown()``), clean up."""
        io_thread = threading.Thread(target=self._io_loop, name="engine-io", daemon=True)
        io_thread.start()
        self._io_bound.wait()
        if self._io_error is not None:
            raise self._io_error
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        self._install_signal_handlers()
        output_thread = None
        intake_thread = threading.Thread(
            target=self._intake_loop, name="engine-intake", daemon=True
        )
        intake_thread.start()
        self._compiles.start()
        try:
            self._load()
            self._ready.set()
            logger.info("engine ready: %s on %s", self.model_name, self.config.endpoint)
            if self.config.async_output:
                output_thread = threading.Thread(
                    target=self._output_loop, name="engine-output", daemon=True
                )
                output_thread.start()
                self._busy_loop(self.output_queue.put)
            else:
                push = self._connect_push()
                try:
                    self._busy_loop(lambda step: self._send_frames(push, self._process(step)))
                finally:
                    push.close(linger=-1)
        finally:
            self._ready.clear()
            self._draining.set()
            self._intake.put(None)
            intake_thread.join(timeout=10)
            self._compiles.close()  # what it still holds comes back to the intake queue
            self._refuse_leftover_intake()
            if output_thread is not None:
                self.output_queue.put(None)
                output_thread.join()
            self._refuse_leftover_adds()
            self._io_stop.set()
            io_thread.join(timeout=10)
            self.ctx.term()
            logger.info("engine stopped")

    def request_shutdown(self) -> None:
        """Stop intake and drain; a second call aborts what is left at once."""
        if self._draining.is_set():
            self._abort_now.set()
        self._draining.set()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.request_shutdown())

    def _load(self) -> None:
        self._install(load_model(self.engine_config))
        if self.config.model_swap == "auto":
            # a GPU's KV cache was sized to fill it: no room to build a second model beside
            self.controller.replace = self.core.on_accelerator

    def _install(self, loaded: LoadedModel | None) -> None:
        """Serve ``loaded`` (None: nothing). Only the busy loop calls this, between steps and
        with no request left in the current core."""
        self.core = loaded.core if loaded else None
        if self.core is not None and self.config.mid_step_admission:
            self.core.admit_mid_step(self._take_mid_step_inputs, self._deliver_mid_step)
        self.max_model_len = loaded.core.max_model_len if loaded else 0
        self.num_kv_blocks = loaded.core.scheduler.kv_cache.num_blocks if loaded else 0
        if loaded is not None:
            self.input_tokenizer = loaded.input_tokenizer
            self._longest_token_chars = longest_token_chars(loaded.input_tokenizer)
            self.processor.tokenizer = loaded.output_tokenizer
        self._publish_snapshot()

    def _queue_switch(self, loaded: LoadedModel | None) -> None:
        # through the intake: the requests accepted before it reach the busy loop before it
        # (tokenized by the model they were accepted for, and drained before the switch)
        self._intake.put(_Switch(loaded))

    def _switch_if_drained(self) -> None:
        if self._pending_switch is None:
            return
        if self.core is not None and self.core.has_unfinished_requests():
            return
        loaded, self._pending_switch = self._pending_switch.model, None
        previous = self.core
        self._install(loaded)
        if previous is not None and previous is not self.core:
            previous.close()  # its memory now, before a replacing load builds the next model
        self.controller.switched(loaded)
        logger.info("now serving %s", loaded.config.model if loaded else "nothing")

    # -- busy loop ---------------------------------------------------------------------------

    def _busy_loop(self, hand_off: Callable[[StepOutputs], None]) -> None:
        """``hand_off`` gets every step's outputs."""
        self._hand_off = hand_off
        deadline = None
        shutdown_aborted: set[str] = set()
        while True:
            self._switch_if_drained()
            core = self.core
            busy = core is not None and core.has_unfinished_requests()
            self._apply_inputs(block=not busy)
            core = self.core
            if self._draining.is_set():
                if deadline is None:
                    deadline = time.monotonic() + self.config.shutdown_grace_period
                    logger.info("draining %d requests", len(self.processor.states))
                is_ending = time.monotonic() >= deadline or self._abort_now.is_set()
                if is_ending and len(self._compiles):
                    self._compiles.close()  # requests whose grammar compiles are refused
                if is_ending and (
                    left := [r for r in list(self.processor.states) if r not in shutdown_aborted]
                ):
                    shutdown_aborted.update(left)
                    if core is not None:
                        core.abort_requests(left)
                idle = core is None or not core.has_unfinished_requests()
                # the intake queues an add before it lets go of the request: looked at first
                if idle and not self._tokenizing and self.inputs.empty():
                    return
            if core is None or not core.has_unfinished_requests():
                continue
            self._step_started_at = time.monotonic()
            outputs = core.step()
            self._step_started_at = None
            self._publish_snapshot()
            if shutdown_aborted:
                _mark_shutdown_aborts(outputs, shutdown_aborted)
            if outputs:
                hand_off(StepOutputs(outputs, time.time()))

    def _apply_inputs(self, block: bool) -> None:
        items, self._deferred_inputs = self._deferred_inputs, []
        items.extend(self.inputs.take_all(timeout=0.1 if block and not items else None))
        aborts = []
        for item in items:
            if item.kind == InputKind.ABORT:
                aborts.extend(item.req_ids)
            elif item.kind == InputKind.SWITCH:
                self._pending_switch = item
            else:
                self._add(item.add)
        # after the adds: an abort may name a request that arrived in the same batch
        if aborts and self.core is not None:
            self.core.abort_requests(aborts)
        if items:
            self._publish_snapshot()

    def _take_mid_step_inputs(self) -> bool:
        """Between two layers of a step (``EngineCore.admit_mid_step``): add the requests
        that arrived, keep aborts and switches for the step's end. True when any was added."""
        if self.inputs.empty():
            return False
        added = False
        for item in self.inputs.take_all():
            if item.kind == InputKind.ADD:
                self._add(item.add)
                added = True
            else:
                self._deferred_inputs.append(item)
        if added:
            self._publish_snapshot()
        return added

    def _deliver_mid_step(self, outputs: list[EngineOutput]) -> None:
        self.metrics.record_mid_step_admission()
        self._publish_snapshot()
        if outputs:
            self._hand_off(StepOutputs(outputs, time.time()))

    def _add(self, add: QueuedAdd) -> None:
        self._num_adds_taken += 1
        self._adds_taken_by_tenant[add.tenant_id] += 1
        try:
            self.core.add_request(
                add.req_id,
                add.prompt_token_ids,
                add.params,
                priority=add.priority,
                cache_salt=add.cache_salt,
                arrival_time=add.arrival_time,
                tenant_id=add.tenant_id,
                tenant_weight=add.tenant_weight,
                max_model_len=add.max_model_len,
                grammar=add.grammar,
            )
        except Exception as exc:  # noqa: BLE001 - the core should refuse by output
            logger.exception("adding %s failed", add.req_id)
            failed = EngineOutput(
                add.req_id,
                finish_reason=FinishReason.ERROR,
                error_code=ErrorCode.ENGINE_ERROR,
                error_message=f"the engine could not add the request: {exc}",
            )
            self._hand_off(StepOutputs([failed], time.time()))

    def _publish_snapshot(self) -> None:
        if self.core is None:
            self.snapshot = _Snapshot()
            return
        scheduler = self.core.scheduler
        self.snapshot = _Snapshot(
            scheduler.num_running,
            scheduler.num_waiting,
            scheduler.kv_cache.usage,
            scheduler.num_preemptions,
            scheduler.waiting.num_waiting_by_tenant(),
        )

    def _queue_abort(self, req_ids: list[str]) -> None:
        self.inputs.put_abort(req_ids)

    # -- output thread -----------------------------------------------------------------------

    def _output_loop(self) -> None:
        push = self._connect_push()
        try:
            while (step := self.output_queue.get()) is not None:
                try:
                    self._send_frames(push, self._process(step))
                except Exception:  # noqa: BLE001 - keep serving the other steps
                    logger.exception("output processing failed")
        finally:
            push.close(linger=-1)

    def _process(self, step: StepOutputs) -> list[list[bytes]]:
        return self.processor.process(step.outputs, step.step_time)

    def _connect_push(self) -> zmq.Socket:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(self._outputs_endpoint)
        return push

    @staticmethod
    def _send_frames(push: zmq.Socket, frames: list[list[bytes]]) -> None:
        for frame in frames:
            push.send_multipart(frame, copy=False)

    # -- I/O thread --------------------------------------------------------------------------

    def _log_failed_handshakes(self, handshakes: zmq.Socket) -> None:
        """A client whose link's security does not match this engine's (a token on one
        side only, or another token) is refused at the handshake: say so, at most once a
        minute (ZeroMQ retries every few hundred milliseconds)."""
        while True:
            try:
                handshakes.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        now = time.monotonic()
        if now - self._handshake_logged_at >= HANDSHAKE_FAILURE_LOG_SECONDS:
            self._handshake_logged_at = now
            logger.warning("a client failed the handshake: %s", HANDSHAKE_FAILED)

    def _secure(self, router: zmq.Socket, keys) -> None:
        """Serve over CurveZMQ, to the client key of the link's token alone (a ZAP handler
        on a thread of its own refuses any other at the handshake)."""
        from zmq.auth.thread import ThreadAuthenticator

        self._authenticator = ThreadAuthenticator(self.ctx, log=logger)
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", _OnlyKey(keys.client_public))
        router.curve_server = True
        router.curve_secretkey = keys.server_secret
        router.curve_publickey = keys.server_public

    def _io_loop(self) -> None:
        try:
            router = self.ctx.socket(zmq.ROUTER)
            # the transport drops the sender's whole connection for a frame past its limit,
            # every stream of that web process with it: its limit is a backstop well above
            # the engine's own, which refuses the one frame (``_handle_frames``)
            router.setsockopt(
                zmq.MAXMSGSIZE, self.config.max_frame_bytes * TRANSPORT_FRAME_LIMIT_FACTOR
            )
            router.setsockopt(zmq.SNDHWM, SEND_HWM)
            router.setsockopt(zmq.LINGER, 2000)
            # a client that reconnects under its routing id gets its streams back
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if self.token:
                self._secure(router, link_keys(self.token))
            router.bind(self.config.endpoint)
            pull = self.ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)
            pull.bind(self._outputs_endpoint)
        except Exception as exc:  # noqa: BLE001 - reported to run() on the main thread
            self._io_error = exc
            self._io_bound.set()
            return
        self._io_bound.set()
        self._generate_decoder = msgspec.msgpack.Decoder(GenerateRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(AbortRequest)
        self._control_decoder = msgspec.msgpack.Decoder(ControlRequest)
        self._encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        handshakes = router.get_monitor_socket(handshake_failed_events())
        poller.register(handshakes, zmq.POLLIN)
        try:
            while not self._io_stop.is_set():
                events = dict(poller.poll(100))
                if handshakes in events:
                    self._log_failed_handshakes(handshakes)
                if pull in events:
                    _forward(pull, router)
                if router in events:
                    for _ in range(256):
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle_frames(router, frames)
                self._abort_silent_clients(time.monotonic())
                self._exit_if_hung()
            _forward(pull, router)
        finally:
            pull.close(linger=0)
            router.disable_monitor()
            handshakes.close(linger=0)
            router.close()
            if self._authenticator is not None:
                self._authenticator.stop()

    def _handle_frames(self, router: zmq.Socket, frames: list[bytes]) -> None:
        identity = frames[0]
        self._last_heard[identity] = time.monotonic()
        try:
            if len(frames) != 3:
                raise ValueError(f"expected [type, payload] frames, got {len(frames) - 1}")
            kind, payload = frames[1], frames[2]
            if len(payload) > self.config.max_frame_bytes:
                is_generate = kind == RequestType.GENERATE.value
                self._reply_error(
                    router,
                    identity,
                    _recover_request_id(payload) if is_generate else "",
                    ErrorCode.INVALID_REQUEST,
                    f"the request is {len(payload)} bytes; the engine takes at most "
                    f"{self.config.max_frame_bytes} (--max-frame-bytes)",
                )
                return
            if kind == RequestType.GENERATE.value:
                self._on_generate(router, identity, payload)
            elif kind == RequestType.ABORT.value:
                abort = self._abort_decoder.decode(payload)
                self._route_aborts([_req_id(identity, r) for r in abort.req_ids])
            elif kind == RequestType.STATS.value:
                router.send_multipart(
                    [identity, ResponseType.STATS.value, self._encoder.encode(self.stats())]
                )
            elif kind == RequestType.CONTROL.value:
                reply = self.controller.handle(self._control_decoder.decode(payload))
                router.send_multipart(
                    [identity, ResponseType.CONTROL.value, self._encoder.encode(reply)]
                )
            else:
                raise ValueError(f"unknown request type {kind[:8]!r}")
        except (
            msgspec.DecodeError,
            msgspec.ValidationError,
            ValueError,
            TypeError,
            RecursionError,
        ) as exc:
            logger.warning("bad frame from %s: %s", identity.hex(), exc)
            self._reply_error(router, identity, "", ErrorCode.INVALID_REQUEST, str(exc))
        except Exception:  # noqa: BLE001 - one bad frame must not stop the engine
            logger.exception("handling a frame from %s failed", identity.hex())

    def _on_generate(self, router: zmq.Socket, identity: bytes, payload: bytes) -> None:
        arrival = time.time()
        try:
            request = self._generate_decoder.decode(payload)
            request.validate()
        except (
            msgspec.DecodeError,
            msgspec.ValidationError,
            ValueError,
            TypeError,
            RecursionError,  # an untyped field (a tool) nested past the decoder's stack
        ) as exc:
            request_id = _recover_request_id(payload)
            self._reply_error(router, identity, request_id, ErrorCode.INVALID_REQUEST, str(exc))
            return
        request_id = request.request_id
        req_id = _req_id(identity, request_id)
        if self._draining.is_set() or not self._ready.is_set():
            reason = "shutting down" if self._draining.is_set() else "loading the model"
            self._reply_error(
                router, identity, request_id, ErrorCode.OVERLOADED, f"the engine is {reason}"
            )
            return
        if (refusal := self.controller.refusal) is not None:
            self._reply_error(router, identity, request_id, *refusal)
            return
        num_queued = (
            self.snapshot.num_waiting
            + self._num_adds_queued
            - self._num_adds_taken
            - self._num_adds_refused
        )
        if num_queued >= self.config.max_queued_requests:
            self._reply_error(
                router,
                identity,
                request_id,
                ErrorCode.OVERLOADED,
                f"the waiting queue is full ({self.config.max_queued_requests} requests)",
            )
            return
        tenant = request.tenant_id or ""
        if self._num_waiting_of(tenant) >= self.tenant_queue_cap:
            self._reply_error(
                router,
                identity,
                request_id,
                ErrorCode.OVERLOADED,
                f"this tenant's share of the waiting queue is full ({self.tenant_queue_cap} "
                "requests)",
            )
            return
        if req_id in self.processor.states or req_id in self._tokenizing:
            self._reply_error(
                router,
                identity,
                request_id,
                ErrorCode.INVALID_REQUEST,
                f"request_id {request_id!r} is already in use",
            )
            return
        core = self.core
        at_least = min_prompt_tokens(request.prompt, request.messages, self._longest_token_chars)
        if core is not None and (
            refused := core.context_refusal(
                at_least, request.params, request.max_model_len, at_least=True
            )
        ):
            self._reply_error(router, identity, request_id, *refused)
            return
        # counted as queued from now: the caps above see it while it is tokenized
        self._num_adds_queued += 1
        self._adds_queued_by_tenant[tenant] += 1
        self._tokenizing.add(req_id)
        self._intake.put(_Intake(identity, request, req_id, arrival))

    # -- intake thread -----------------------------------------------------------------------

    def _intake_loop(self) -> None:
        push = self._connect_push()
        encoder = msgspec.msgpack.Encoder()
        try:
            while (item := self._intake.get()) is not None:
                if isinstance(item, list):  # aborts that followed their requests here
                    self._abort_held(item)
                    continue
                if isinstance(item, _Switch):
                    self._held_switches.append(item)
                    self._release_held_switches()
                    continue
                intake = item.item if isinstance(item, _Compiled) else item
                is_compiling = False
                try:
                    if isinstance(item, _Compiled):
                        self._take_compiled(item, push, encoder)
                    else:
                        is_compiling = self._take_in(item, push, encoder)
                except Exception:  # noqa: BLE001 - one request must not stop the intake
                    logger.exception("taking in %s failed", intake.req_id)
                    with contextlib.suppress(Exception):
                        self._refuse(intake, push, encoder, ErrorCode.ENGINE_ERROR, "intake failed")
                finally:
                    if not is_compiling:
                        self._tokenizing.discard(intake.req_id)
                        self._release_held_switches()
        finally:
            push.close(linger=-1)

    def _take_in(self, item: _Intake, push: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> bool:
        """Tokenize ``item``'s prompt, check what needs its tokens, and queue it for the core
        (or refuse it); True where its grammar went to compile (it comes back as a
        ``_Compiled``)."""
        request = item.request
        try:
            token_ids = self._tokenize(request)
        except Exception as exc:  # noqa: BLE001 - e.g. a chat template that rejects the roles
            self._refuse(item, push, encoder, ErrorCode.INVALID_REQUEST, f"cannot tokenize: {exc}")
            return False
        core = self.core
        if core is not None and (
            refused := core.context_refusal(len(token_ids), request.params, request.max_model_len)
        ):
            self._refuse(item, push, encoder, *refused)
            return False
        grammar = None
        if core is not None and request.params.structured_outputs is not None:
            # compiled before: taken from the cache at once, handed on with the request; else
            # compiled on the compile queue, neither here nor in the busy loop
            grammar = core.cached_grammar(request.params, request.cache_salt)
            if grammar is None:
                self._compiling.add(item.req_id)
                self._compiles.submit(
                    item.req_id,
                    request.tenant_id or "",
                    lambda: core.compile_structured_outputs(request.params, request.cache_salt),
                    lambda outcome: self._intake.put(_Compiled(item, token_ids, outcome)),
                )
                return True
        self._queue_add(item, token_ids, grammar)
        return False

    def _take_compiled(
        self, compiled: _Compiled, push: zmq.Socket, encoder: msgspec.msgpack.Encoder
    ) -> None:
        """Queue (or refuse, or end as aborted) a request whose grammar compile ended."""
        item, outcome = compiled.item, compiled.outcome
        self._compiling.discard(item.req_id)
        if outcome.cancelled or item.req_id in self._aborted_compiling:
            self._aborted_compiling.discard(item.req_id)
            aborted = GenerateDelta(
                item.request.request_id, finish_reason=FinishReason.ABORT, usage=Usage()
            )
            frame = [item.identity, ResponseType.OUTPUTS.value, encoder.encode([aborted])]
            self._end_unqueued(item, push, frame)
            return
        grammar = self._compiled_grammar(outcome)
        if isinstance(grammar, Refusal):
            self._refuse(item, push, encoder, *grammar)
            return
        self._queue_add(item, compiled.token_ids, grammar)

    def _compiled_grammar(self, outcome: Outcome) -> object:
        """The grammar a compile gave (``compile_structured_outputs``' answer), or why the
        request is refused."""
        timeout = self.config.grammar_compile_timeout
        if outcome.timed_out and outcome.started:
            return Refusal(
                ErrorCode.INVALID_REQUEST,
                f"structured_outputs did not compile within {timeout:g}s: simplify it",
                "structured_outputs",
            )
        if outcome.timed_out:
            return Refusal(
                ErrorCode.OVERLOADED,
                f"the grammar was not compiled within {timeout:g}s: this tenant's earlier "
                "grammars are still compiling",
            )
        if outcome.closed:
            return Refusal(ErrorCode.ENGINE_ERROR, SHUT_DOWN_BEFORE_START)
        if outcome.error is not None:
            return Refusal(
                ErrorCode.ENGINE_ERROR,
                f"compiling the grammar failed: {type(outcome.error).__name__}: {outcome.error}",
            )
        return outcome.result

    def _abort_held(self, req_ids: list[str]) -> None:
        """Aborts of requests this thread held when they came: those whose grammar is
        compiling end as soon as it is done (at once where it has not begun); the others were
        queued already, and their aborts follow them."""
        queued = []
        for req_id in req_ids:
            if req_id not in self._compiling:
                queued.append(req_id)
            elif not self._compiles.cancel(req_id):  # cancelled: it comes back as such
                self._aborted_compiling.add(req_id)
        if queued:
            self._queue_abort(queued)

    def _release_held_switches(self) -> None:
        """Hand on the switches held while the requests accepted before them compiled."""
        if self._compiling:
            return
        for switch in self._held_switches:
            self.inputs.put_switch(switch.model)
        self._held_switches.clear()

    def _queue_add(self, item: _Intake, token_ids: list[int], grammar: object = None) -> None:
        """Register ``item`` with the output processor and queue it for the busy loop, with
        its compiled grammar (the busy loop compiles nothing)."""
        request = item.request
        tenant = request.tenant_id or ""
        self.processor.add_request(
            item.req_id,
            item.identity,
            request.request_id,
            token_ids,
            request.params,
            tenant_id=tenant,
            return_prompt_text=request.return_prompt_text,
        )
        self.inputs.put_add(
            QueuedAdd(
                req_id=item.req_id,
                prompt_token_ids=token_ids,
                params=request.params,
                priority=request.priority,
                cache_salt=request.cache_salt,
                arrival_time=item.arrival,
                tenant_id=tenant,
                tenant_weight=request.tenant_weight,
                max_model_len=request.max_model_len,
                grammar=grammar,
            )
        )

    def _refuse(
        self,
        item: _Intake,
        push: zmq.Socket,
        encoder: msgspec.msgpack.Encoder,
        code: ErrorCode,
        message: str,
        param: str | None = None,
    ) -> None:
        """Answer a request the intake will not queue, and uncount it."""
        request_id = item.request.request_id
        frame = _error_frame(encoder, item.identity, request_id, code, message, param)
        self._end_unqueued(item, push, frame)

    def _end_unqueued(self, item: _Intake, push: zmq.Socket, frame: list[bytes]) -> None:
        """Send the last frame of a request the intake will not queue, and uncount it."""
        self._num_adds_refused += 1
        self._adds_refused_by_tenant[item.request.tenant_id or ""] += 1
        push.send_multipart(frame)

    def _refuse_leftover_adds(self) -> None:
        """Fail the adds the busy loop left when it stopped (queued as it drained its last):
        every request a client sent gets its final message."""
        left = [item.add for item in self.inputs.take_all() if item.kind == InputKind.ADD]
        if not left:
            return
        outputs = [
            EngineOutput(
                add.req_id,
                finish_reason=FinishReason.ERROR,
                error_code=ErrorCode.ENGINE_ERROR,
                error_message=SHUT_DOWN_BEFORE_START,
            )
            for add in left
        ]
        push = self._connect_push()
        try:
            self._send_frames(push, self._process(StepOutputs(outputs, time.time())))
        finally:
            push.close(linger=-1)

    def _refuse_leftover_intake(self) -> None:
        """Fail the generates handed to the intake as it stopped (accepted just before the
        drain began, behind its stop)."""
        push, encoder = self._connect_push(), msgspec.msgpack.Encoder()
        try:
            while True:
                try:
                    item = self._intake.get_nowait()
                except queue.Empty:
                    return
                if isinstance(item, _Compiled):
                    item = item.item
                if isinstance(item, _Intake):
                    self._refuse(
                        item, push, encoder, ErrorCode.ENGINE_ERROR, SHUT_DOWN_BEFORE_START
                    )
                    self._tokenizing.discard(item.req_id)
        finally:
            push.close(linger=-1)

    def _route_aborts(self, req_ids: list[str]) -> None:
        """Abort ``req_ids``: those the intake thread still holds after their adds, through it;
        the others at once (not behind the prompts it has yet to tokenize)."""
        held = [req_id for req_id in req_ids if req_id in self._tokenizing]
        if held:
            self._intake.put(held)
        if len(held) < len(req_ids):
            self._queue_abort([req_id for req_id in req_ids if req_id not in held])

    def _exit_if_hung(self) -> None:
        """A step that has run for ``step_timeout`` is taken for hung (a kernel that never
        returns, a deadlock): the process exits at once, so that its supervisor starts it
        again and its clients, their link dropped, fail their streams (metered) instead of
        waiting on an engine whose I/O thread still answers their heartbeats."""
        seconds, timeout = self._step_seconds(), self.config.step_timeout
        if not timeout or seconds < timeout:
            return
        logger.critical(
            "a step has run for %.0fs (--step-timeout %.0f): exiting to be restarted",
            seconds,
            timeout,
        )
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)

    def _abort_silent_clients(self, now: float) -> None:
        """Abort the requests of every client silent for ``client_timeout`` (see the module
        docstring); checked a few times a timeout."""
        previous, self._last_loop_at = self._last_loop_at, now
        if previous and now - previous > 1.0:
            # this thread was held up, not the clients: what it did not read is no silence
            stalled = now - previous
            self._last_heard = {client: at + stalled for client, at in self._last_heard.items()}
        if now < self._next_silence_check:
            return
        timeout = self.config.client_timeout
        self._next_silence_check = now + min(timeout / 4, 1.0)
        silent = [client for client, heard in self._last_heard.items() if now - heard > timeout]
        if not silent:
            return
        for client in silent:
            del self._last_heard[client]
        prefixes = tuple(_req_id(client, "") for client in silent)
        # the output thread removes finished requests meanwhile (and the intake thread those it
        # took in): a copy of the keys, at once
        # the intake registers a request with the processor before it lets go: looked at first
        known = list(self._tokenizing) + list(self.processor.states)
        req_ids = list(dict.fromkeys(r for r in known if r.startswith(prefixes)))
        if req_ids:
            logger.warning(
                "aborting %d requests of %d clients silent for %.0fs",
                len(req_ids),
                len(silent),
                timeout,
            )
            self._route_aborts(req_ids)

    def _num_waiting_of(self, tenant: str) -> int:
        """The tenant's waiting requests as the busy loop last saw them, plus its adds on
        their way there."""
        in_transit = (
            self._adds_queued_by_tenant[tenant]
            - self._adds_taken_by_tenant[tenant]
            - self._adds_refused_by_tenant[tenant]
        )
        return self.snapshot.waiting_by_tenant.get(tenant, 0) + in_transit

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if request.messages is not None:
            messages = [m.as_template_input() for m in request.messages]
            return render_chat(self.input_tokenizer, messages, request.tools)
        return list(self.input_tokenizer(request.prompt)["input_ids"])

    def _reply_error(
        self,
        router: zmq.Socket,
        identity: bytes,
        request_id: str,
        code: ErrorCode,
        message: str,
        param: str | None = None,
    ) -> None:
        router.send_multipart(
            _error_frame(self._encoder, identity, request_id, code, message, param)
        )

    # -- stats -------------------------------------------------------------------------------

    def _gauges(self) -> tuple[int, int, float]:
        snapshot = self.snapshot
        return snapshot.num_running, snapshot.num_waiting, snapshot.kv_cache_usage

    def stats(self) -> StatsResponse:
        snapshot, metrics = self.snapshot, self.metrics
        return StatsResponse(
            model=self.model_name,
            max_model_len=self.max_model_len,
            ready=self._ready.is_set()
            and not self._draining.is_set()
            and self.controller.refusal is None,
            num_requests_running=snapshot.num_running,
            num_requests_waiting=snapshot.num_waiting,
            kv_cache_usage=snapshot.kv_cache_usage,
            num_kv_blocks=self.num_kv_blocks,
            max_queued_requests=self.config.max_queued_requests,
            prefix_cache_queries=metrics.prefix_cache_queries,
            prefix_cache_hits=metrics.prefix_cache_hits,
            prompt_tokens_total=metrics.prompt_tokens_total,
            generation_tokens_total=metrics.generation_tokens_total,
            num_preemptions=snapshot.num_preemptions,
            engine_id=self.engine_id,
            state=self.controller.state,
            state_detail=self.controller.detail,
            model_path=self.controller.model_path or "",
            tool_call_parser=tool_call_parser(self.input_tokenizer),
            step_seconds=self._step_seconds(),
        )

    def _step_seconds(self) -> float:
        started = self._step_started_at  # read once: the busy loop clears it
        return 0.0 if started is None else max(time.monotonic() - started, 0.0)


def _error_frame(
    encoder: msgspec.msgpack.Encoder,
    identity: bytes,
    request_id: str,
    code: ErrorCode,
    message: str,
    param: str | None,
) -> list[bytes]:
    """The frame that ends a client's request with an error."""
    delta = GenerateDelta(
        request_id,
        finish_reason=FinishReason.ERROR,
        error=code,
        error_message=message,
        error_param=param,
    )
    return [identity, ResponseType.OUTPUTS.value, encoder.encode([delta])]


def _req_id(identity: bytes, request_id: str) -> str:
    return f"{identity.hex()}/{request_id}"


def _forward(pull: zmq.Socket, router: zmq.Socket) -> None:
    while True:
        try:
            frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        router.send_multipart(frames, copy=False)


def _recover_request_id(payload: bytes) -> str:
    """The request_id of an invalid GENERATE payload, when it can be read, so the client's
    stream gets the error; else ""."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except Exception:  # noqa: BLE001 - garbage
        return ""
    index = list(GenerateRequest.__struct_fields__).index("request_id")
    if isinstance(fields, list) and len(fields) > index and isinstance(fields[index], str):
        return fields[index][:MAX_ID_CHARS]
    return ""


def _mark_shutdown_aborts(outputs: list[EngineOutput], shutdown_aborted: set[str]) -> None:
    for output in outputs:
        if output.finish_reason == FinishReason.ABORT and output.req_id in shutdown_aborted:
            output.finish_reason = FinishReason.ERROR
            output.error_code = ErrorCode.ENGINE_ERROR
            output.error_message = "the engine shut down before the request finished"


class _OnlyKey:
    """A ZAP credentials provider that admits one CURVE client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        import hmac

        is_known = hmac.compare_digest(client_key, self.client_public)
        if not is_known:
            logger.warning("refused a client without the engine's token (CURVE key unknown)")
        return is_known
