"""The engine server's intake: prompts are tokenized on a thread of their own, in arrival order,
so the I/O thread answers heartbeats and forwards streams while a long prompt is tokenized;
an abort follows its request through the intake; a prompt whose characters alone exceed the
context is refused without tokenizing. An in-process server, driven over a raw DEALER."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.model_control import UNLOADED
from inference_engine.protocol import (
    AbortRequest,
    ControlRequest,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    RequestType,
    ResponseType,
    SamplingParams,
)
from inference_engine.server import EngineServer

pytestmark = pytest.mark.timeout(120)

DELTAS = msgspec.msgpack.Decoder(list[GenerateDelta])


class Dealer:
    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.connect(endpoint)

    def send(self, kind: RequestType, payload: object) -> None:
        encoded = b"" if payload is None else msgspec.msgpack.encode(payload)
        self.socket.send_multipart([kind.value, encoded])

    def generate(self, request_id: str, prompt: str, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.send(
            RequestType.GENERATE,
            GenerateRequest(prompt=prompt, params=params, request_id=request_id),
        )

    def receive(self, timeout: float = 30.0) -> tuple[bytes, bytes]:
        assert self.socket.poll(int(timeout * 1000)), "no reply"
        kind, payload = self.socket.recv_multipart()
        return kind, payload

    def until_final(self, request_id: str) -> list[GenerateDelta]:
        """The request's deltas up to its final one (other replies are dropped)."""
        deltas: list[GenerateDelta] = []
        while True:
            kind, payload = self.receive()
            if kind != ResponseType.OUTPUTS.value:
                continue
            for delta in DELTAS.decode(payload):
                if delta.request_id == request_id:
                    deltas.append(delta)
                    if delta.finish_reason is not None:
                        return deltas

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def served(llama_dir, tmp_path):
    """A running server whose tokenizer waits on ``gate`` for a request id starting with
    "gated", and records the id of every request it tokenizes."""
    server = EngineServer(
        EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=64, device="cpu"),
        ServerConfig(endpoint=f"ipc://{tmp_path}/engine.sock", async_output=True),
    )
    gate, tokenized = threading.Event(), []
    tokenize = server._tokenize

    def gated(request: GenerateRequest) -> list[int]:
        tokenized.append(request.request_id)
        if request.request_id.startswith("gated"):
            assert gate.wait(60)
        return tokenize(request)

    server._tokenize = gated
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    dealer = Dealer(server.config.endpoint)
    deadline = time.monotonic() + 60
    while not server._ready.is_set():
        assert time.monotonic() < deadline, "the engine never got ready"
        time.sleep(0.05)
    yield server, dealer, gate, tokenized
    gate.set()
    dealer.close()
    server.request_shutdown()
    server.request_shutdown()
    thread.join(timeout=30)
    assert not thread.is_alive()


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_prompt_being_tokenized_holds_up_no_heartbeat_and_no_stream(served):
    """A prompt of megabytes took the I/O thread for seconds (17 s for 12 MB): no heartbeat
    was answered, no stream forwarded, and every client failed its streams as the engine's
    silence passed 5 s."""
    server, dealer, gate, tokenized = served
    dealer.generate("stream", "hello world", max_tokens=60)
    assert dealer.until_final("stream")[-1].finish_reason == FinishReason.LENGTH  # warm
    dealer.generate("stream-2", "hello world", max_tokens=60)
    dealer.generate("gated-1", "the quick brown fox", max_tokens=4)
    _wait_for(lambda: "gated-1" in tokenized)
    dealer.send(RequestType.STATS, None)
    stats_answered, streamed, finals = False, 0, {}
    while not (stats_answered and "stream-2" in finals):
        kind, payload = dealer.receive()
        if kind == ResponseType.STATS.value:
            stats_answered = True
            continue
        for delta in DELTAS.decode(payload):
            streamed += delta.request_id == "stream-2"
            if delta.finish_reason is not None:
                finals[delta.request_id] = delta
    assert "gated-1" not in finals and streamed > 1  # all while gated-1's prompt was held
    gate.set()
    [*_, final] = dealer.until_final("gated-1")
    assert final.finish_reason == FinishReason.LENGTH


def test_an_abort_of_a_request_being_tokenized_ends_it_once_it_is_added(served):
    server, dealer, gate, tokenized = served
    dealer.generate("gated-2", "hello world", max_tokens=50)
    _wait_for(lambda: "gated-2" in tokenized)
    dealer.generate("gated-2", "hello world", max_tokens=50)  # its id, while it is taken in
    [refused] = dealer.until_final("gated-2")
    assert refused.error == ErrorCode.INVALID_REQUEST and "already in use" in refused.error_message
    dealer.send(RequestType.ABORT, AbortRequest(req_ids=["gated-2"]))
    gate.set()
    deltas = dealer.until_final("gated-2")
    assert deltas[-1].finish_reason == FinishReason.ABORT
    assert sum(len(d.token_ids) for d in deltas) < 50
    _wait_for(lambda: server.snapshot.num_running == 0 and server.snapshot.num_waiting == 0)


def test_a_prompt_whose_characters_exceed_the_context_is_refused_untokenized(served):
    server, dealer, _, tokenized = served
    limit = server.max_model_len * server._longest_token_chars
    dealer.generate("too-long", "a" * (limit + 1), max_tokens=1)
    [refused] = dealer.until_final("too-long")
    assert refused.error == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "at least" in refused.error_message
    assert "too-long" not in tokenized
    dealer.generate("fits", "a" * 20, max_tokens=1)  # a prompt within the bound is tokenized
    assert dealer.until_final("fits")[-1].finish_reason == FinishReason.LENGTH
    assert "fits" in tokenized


def test_an_unload_waits_for_the_requests_accepted_before_it(served):
    """A request still being tokenized when an unload came: the switch reached the busy loop
    first, the model was gone when the request's add came, and it failed ("could not add the
    request"). The switch now follows the requests accepted before it through the intake."""
    server, dealer, gate, tokenized = served
    dealer.generate("gated-3", "hello world", max_tokens=8)
    _wait_for(lambda: "gated-3" in tokenized)
    dealer.send(RequestType.CONTROL, ControlRequest(action="unload"))
    _wait_for(lambda: server.controller.refusal is not None)
    gate.set()
    deltas = dealer.until_final("gated-3")
    assert deltas[-1].finish_reason == FinishReason.LENGTH, deltas[-1]
    assert sum(len(d.token_ids) for d in deltas) == 8
    _wait_for(lambda: server.controller.state == UNLOADED)
    dealer.generate("after", "hello world", max_tokens=1)
    [refused] = dealer.until_final("after")
    assert refused.error == ErrorCode.MODEL_NOT_LOADED
