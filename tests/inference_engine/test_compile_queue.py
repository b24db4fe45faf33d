"""The grammar compile queue: one compile at a time per tenant, in order, tenants in turn on a
few workers; each job answered exactly once (result, error, timeout, cancel or close)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from inference_engine.compile_queue import CompileQueue, Outcome

pytestmark = pytest.mark.timeout(30)


class Answers:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[str, Outcome]] = queue.SimpleQueue()

    def to(self, key: str):
        return lambda outcome: self.queue.put((key, outcome))

    def next(self, timeout: float = 10.0) -> tuple[str, Outcome]:
        return self.queue.get(timeout=timeout)

    def none_within(self, seconds: float) -> bool:
        try:
            self.queue.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def compiles():
    made = []

    def make(workers: int = 2, timeout: float = 10.0) -> CompileQueue:
        compiles = CompileQueue(workers=workers, timeout=timeout)
        compiles.start()
        made.append(compiles)
        return compiles

    yield make
    for compiles in made:
        compiles.close()


def gated(gate: threading.Event, value: object = None, started: threading.Event | None = None):
    def compile():
        if started is not None:
            started.set()
        assert gate.wait(20)
        return value

    return compile


def test_a_tenant_stuck_compiling_holds_up_only_its_own_jobs(compiles):
    """One tenant's endless compile kept every other request behind it on the intake thread."""
    queue_, answers, gate = compiles(workers=2), Answers(), threading.Event()
    queue_.submit("a1", "a", gated(gate, "a1"), answers.to("a1"))
    queue_.submit("a2", "a", lambda: "a2", answers.to("a2"))
    queue_.submit("b1", "b", lambda: "b1", answers.to("b1"))
    assert answers.next() == ("b1", Outcome(result="b1"))
    assert answers.none_within(0.3)  # a2 waits behind a1, though a worker is free
    gate.set()
    assert [answers.next(), answers.next()] == [
        ("a1", Outcome(result="a1")),
        ("a2", Outcome(result="a2")),
    ]
    assert len(queue_) == 0


def test_tenants_take_turns_on_one_worker(compiles):
    queue_, answers, gate = compiles(workers=1), Answers(), threading.Event()
    started = threading.Event()
    queue_.submit("first", "x", gated(gate, None, started), answers.to("first"))
    assert started.wait(10)
    for key in ("a1", "a2", "a3", "b1", "c1"):
        queue_.submit(key, key[0], lambda key=key: key, answers.to(key))
    gate.set()
    order = [answers.next()[0] for _ in range(6)]
    assert order == ["first", "a1", "b1", "c1", "a2", "a3"]


def test_a_compile_past_its_deadline_is_answered_once_and_its_tenant_waits_for_it(compiles):
    queue_, answers, gate = compiles(workers=2, timeout=0.5), Answers(), threading.Event()
    started = threading.Event()
    queue_.submit("slow", "a", gated(gate, "late", started), answers.to("slow"))
    assert started.wait(10)
    queue_.submit("next", "a", lambda: "next", answers.to("next"))
    key, outcome = answers.next()
    assert key == "slow" and outcome.timed_out and outcome.started
    # its tenant's next job waited behind the compile still running: its own deadline passed
    key, outcome = answers.next()
    assert key == "next" and outcome.timed_out and not outcome.started
    gate.set()
    assert answers.none_within(0.3)  # the late result is dropped, not answered again
    queue_.submit("after", "a", lambda: "after", answers.to("after"))
    assert answers.next() == ("after", Outcome(result="after"))


def test_an_error_is_the_jobs_answer_and_the_worker_lives_on(compiles):
    queue_, answers = compiles(workers=1), Answers()

    def broken():
        raise RuntimeError("boom")

    queue_.submit("bad", "a", broken, answers.to("bad"))
    key, outcome = answers.next()
    assert key == "bad" and isinstance(outcome.error, RuntimeError)
    queue_.submit("good", "a", lambda: 1, answers.to("good"))
    assert answers.next() == ("good", Outcome(result=1))


def test_only_a_job_not_yet_started_can_be_cancelled(compiles):
    queue_, answers, gate = compiles(workers=1), Answers(), threading.Event()
    started = threading.Event()
    queue_.submit("running", "a", gated(gate, "done", started), answers.to("running"))
    assert started.wait(10)
    queue_.submit("waiting", "a", lambda: "never", answers.to("waiting"))
    queue_.submit("other", "b", lambda: "never", answers.to("other"))
    assert queue_.cancel("waiting") and queue_.cancel("other")
    assert {answers.next(), answers.next()} == {
        ("waiting", Outcome(cancelled=True)),
        ("other", Outcome(cancelled=True)),
    }
    assert not queue_.cancel("running") and not queue_.cancel("unknown")
    gate.set()
    assert answers.next() == ("running", Outcome(result="done"))
    assert answers.none_within(0.3)


def test_closing_answers_what_is_left_and_what_comes_after(compiles):
    queue_, answers, gate = compiles(workers=1), Answers(), threading.Event()
    started = threading.Event()
    queue_.submit("running", "a", gated(gate, None, started), answers.to("running"))
    assert started.wait(10)
    queue_.submit("waiting", "b", lambda: None, answers.to("waiting"))
    queue_.close()
    assert {answers.next(), answers.next()} == {
        ("running", Outcome(closed=True)),
        ("waiting", Outcome(closed=True)),
    }
    queue_.submit("late", "c", lambda: None, answers.to("late"))
    assert answers.next() == ("late", Outcome(closed=True))
    gate.set()
    assert answers.none_within(0.3)


def test_a_grammar_that_waited_behind_its_tenants_gets_its_own_time_to_compile(compiles):
    """Its time ran from its submission: a fast grammar that started just before it ran out
    was refused as too slow to compile ("simplify it"), which no change of it could mend."""
    queue_, answers = compiles(workers=2, timeout=2.0), Answers()  # 2.4 s in all, each within
    queue_.submit("a1", "a", lambda: time.sleep(1.4) or "g1", answers.to("a1"))
    queue_.submit("a2", "a", lambda: time.sleep(1.0) or "g2", answers.to("a2"))
    assert [answers.next(), answers.next()] == [
        ("a1", Outcome(result="g1")),
        ("a2", Outcome(result="g2")),
    ]


def test_compiles_past_their_time_do_not_hold_the_workers_from_other_tenants(compiles):
    """Two tenants' endless compiles held both workers: every other tenant's grammars then
    waited out their time, refused."""
    queue_, answers, gate = compiles(workers=2, timeout=0.3), Answers(), threading.Event()
    for tenant in ("a", "b"):
        queue_.submit(tenant, tenant, gated(gate), answers.to(tenant))
    stuck = {answers.next()[0], answers.next()[0]}
    assert stuck == {"a", "b"}  # refused as too slow; their threads still compiling
    queue_.submit("c", "c", lambda: "fast", answers.to("c"))
    assert answers.next() == ("c", Outcome(result="fast"))
    queue_.submit("a-next", "a", lambda: "next", answers.to("a-next"))
    assert answers.none_within(0.1)  # its tenant's next still waits for the stuck one
    gate.set()
    assert answers.next() == ("a-next", Outcome(result="next"))
    deadline = time.monotonic() + 10
    while queue_._num_threads != 2:  # the stuck ones' threads go once done
        assert time.monotonic() < deadline, queue_._num_threads
        time.sleep(0.01)
