"""The engine server compiles grammars off its intake thread: a tenant's grammar compiling
holds up no other request, and its own requests after it only; an abort ends a request whose
grammar compiles; a grammar past the timeout is refused; a model switch waits for the
requests accepted before it. An in-process server, driven over a raw DEALER, whose grammar
compiles wait on a gate where the regex starts with "gated"."""

from __future__ import annotations

import threading
import time

import pytest

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.model_control import UNLOADED
from inference_engine.protocol import (
    AbortRequest,
    ControlRequest,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    RequestType,
    ResponseType,
    SamplingParams,
    StructuredOutputsParams,
)
from inference_engine.server import EngineServer
from tests.inference_engine.test_server_intake import DELTAS, Dealer, _wait_for

pytestmark = pytest.mark.timeout(120)


class Compiling:
    def __init__(self, server: EngineServer, dealer: Dealer) -> None:
        self.server, self.dealer = server, dealer
        self.gate, self.started = threading.Event(), []
        self.compiled: list[str | None] = []  # the regex of every compile begun, in order
        grammars = server.core.grammars
        compile_ = grammars.compile

        def gated(spec, salt=None):
            self.compiled.append(spec.regex)
            if spec.regex and spec.regex.startswith("gated"):
                self.started.append(spec.regex)
                assert self.gate.wait(60)
            return compile_(spec, salt)

        grammars.compile = gated

    def generate(self, request_id: str, tenant: str, regex: str | None = None) -> None:
        constraint = None if regex is None else StructuredOutputsParams(regex=regex)
        params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=constraint)
        request = GenerateRequest(
            prompt="hello world", params=params, request_id=request_id, tenant_id=tenant
        )
        self.dealer.send(RequestType.GENERATE, request)

    def finals(self, *request_ids: str, timeout: float = 30.0) -> dict:
        """The final deltas of ``request_ids``, in the order they came."""
        finals: dict = {}
        deadline = time.monotonic() + timeout
        while set(request_ids) - finals.keys():
            kind, payload = self.dealer.receive(max(deadline - time.monotonic(), 0.01))
            if kind != ResponseType.OUTPUTS.value:
                continue
            for delta in DELTAS.decode(payload):
                if delta.finish_reason is not None and delta.request_id in request_ids:
                    finals[delta.request_id] = delta
        return finals


@pytest.fixture
def compiling(llama_dir, tmp_path, request):
    timeout = getattr(request, "param", 30.0)
    server = EngineServer(
        EngineConfig(model=llama_dir, dtype="float32", num_kv_blocks=64, device="cpu"),
        ServerConfig(endpoint=f"ipc://{tmp_path}/engine.sock", grammar_compile_timeout=timeout),
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    dealer = Dealer(server.config.endpoint)
    _wait_for(server._ready.is_set, timeout=60)
    compiling = Compiling(server, dealer)
    compiling.thread = thread
    yield compiling
    compiling.gate.set()
    dealer.close()
    server.request_shutdown()
    server.request_shutdown()
    thread.join(timeout=30)
    assert not thread.is_alive()


def _served(delta) -> bool:
    return delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and delta.error is None


def test_a_grammar_compiling_holds_up_only_its_tenants_later_structured_requests(compiling):
    """Grammars compiled on the intake thread, which every request waits behind: one tenant's
    schema that took minutes to compile held up every tenant's requests."""
    compiling.generate("a-slow", "a", regex="gated[a-z]{1,3}")
    _wait_for(lambda: compiling.started)
    compiling.generate("a-later", "a", regex="[0-9]{1,3}")
    compiling.generate("a-plain", "a")
    compiling.generate("b-plain", "b")
    compiling.generate("b-structured", "b", regex="[xyz]{1,3}")
    finals = compiling.finals("a-plain", "b-plain", "b-structured")
    assert all(_served(delta) for delta in finals.values()), finals
    assert "[0-9]{1,3}" not in compiling.compiled  # its own grammars wait, in order
    compiling.gate.set()
    later = compiling.finals("a-slow", "a-later")
    assert all(_served(delta) for delta in later.values()), later
    assert compiling.compiled.index("[0-9]{1,3}") > compiling.compiled.index("gated[a-z]{1,3}")


def test_an_abort_ends_a_request_whose_grammar_compiles(compiling):
    compiling.generate("compiling", "a", regex="gated[a-z]{1,3}")
    _wait_for(lambda: compiling.started)
    compiling.generate("queued", "a", regex="[0-9]{1,3}")  # waits behind it: cancelled at once
    compiling.dealer.send(RequestType.ABORT, AbortRequest(req_ids=["queued", "compiling"]))
    [queued] = compiling.finals("queued").values()
    assert queued.finish_reason == FinishReason.ABORT and queued.usage.prompt_tokens == 0
    compiling.gate.set()  # the one under way ends once its compile does, never run
    [aborted] = compiling.finals("compiling").values()
    assert aborted.finish_reason == FinishReason.ABORT and aborted.usage.completion_tokens == 0
    _wait_for(lambda: not compiling.server._tokenizing and len(compiling.server._compiles) == 0)
    compiling.generate("after", "a", regex="gated[a-z]{1,3}")  # compiled: served at once
    assert _served(compiling.finals("after")["after"])


@pytest.mark.parametrize("compiling", [0.5], indirect=True)
def test_a_grammar_not_compiled_in_time_is_refused(compiling):
    compiling.generate("slow", "a", regex="gated[a-z]{1,3}")
    compiling.generate("behind", "a", regex="[0-9]{1,3}")
    compiling.generate("other", "b", regex="[xyz]{1,3}")
    finals = compiling.finals("slow", "behind", "other")
    assert finals["slow"].error == ErrorCode.INVALID_REQUEST
    assert finals["slow"].error_param == "structured_outputs"
    assert "did not compile within 0.5s" in finals["slow"].error_message
    assert finals["behind"].error == ErrorCode.OVERLOADED  # never started: not its fault
    assert _served(finals["other"])
    compiling.gate.set()
    _wait_for(lambda: len(compiling.server._compiles) == 0)
    compiling.generate("retried", "a", regex="[0-9]{1,3}")
    assert _served(compiling.finals("retried")["retried"])


def test_an_unload_waits_for_the_requests_whose_grammar_compiles(compiling):
    """The switch follows the requests accepted before it, their grammar compiled or not."""
    compiling.generate("compiling", "a", regex="gated[a-z]{1,3}")
    _wait_for(lambda: compiling.started)
    compiling.dealer.send(RequestType.CONTROL, ControlRequest(action="unload"))
    _wait_for(lambda: compiling.server.controller.refusal is not None)
    time.sleep(0.2)
    assert compiling.server.core is not None
    compiling.gate.set()
    assert _served(compiling.finals("compiling")["compiling"])
    _wait_for(lambda: compiling.server.controller.state == UNLOADED)


def test_the_busy_loop_never_compiles_a_grammar_the_intake_had_compiled(compiling):
    """The compiled grammar travels with the add: where the bounded cache dropped it before
    the add reached the busy loop, the busy loop compiled it again, every running request
    waiting on it."""
    server = compiling.server
    queue_add = server._queue_add

    def evicting(*args, **kwargs):
        with server.core.grammars._lock:
            server.core.grammars._compiled.clear()
        queue_add(*args, **kwargs)

    server._queue_add = evicting
    compiling.generate("first", "a", regex="[xyz]{1,3}")  # compiled on the compile queue
    assert _served(compiling.finals("first")["first"])
    compiling.generate("again", "a", regex="[xyz]{1,3}")  # dropped: compiled again there
    assert _served(compiling.finals("again")["again"])
    assert compiling.compiled == ["[xyz]{1,3}", "[xyz]{1,3}"]


def test_a_shutdown_that_aborts_at_once_waits_for_no_grammar(compiling):
    """A second SIGTERM aborted the requests running, but one whose grammar compiled kept
    the engine up until its compile ended or timed out."""
    compiling.generate("compiling", "a", regex="gated[a-z]{1,3}")
    _wait_for(lambda: compiling.started)
    compiling.server.request_shutdown()
    compiling.server.request_shutdown()  # abort what is left, now
    [refused] = compiling.finals("compiling").values()
    assert refused.error == ErrorCode.ENGINE_ERROR and "shut down" in refused.error_message
    compiling.thread.join(timeout=10)
    assert not compiling.thread.is_alive()
