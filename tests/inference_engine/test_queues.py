"""The busy loop's input queue: aborts first, then first come first served."""

from __future__ import annotations

from inference_engine.protocol import SamplingParams
from inference_engine.queues import InputKind, InputQueue, QueuedAdd


def _add(req_id: str) -> QueuedAdd:
    return QueuedAdd(
        req_id=req_id,
        prompt_token_ids=[5],
        params=SamplingParams(),
        priority=0,
        cache_salt=None,
        arrival_time=0.0,
        tenant_id="",
        tenant_weight=1.0,
    )


def test_aborts_come_out_before_adds_and_switches_and_each_kind_in_order():
    inputs = InputQueue()
    inputs.put_add(_add("a"))
    inputs.put_switch(None)
    inputs.put_add(_add("b"))
    inputs.put_abort(["a"])
    inputs.put_abort(["b", "c"])
    items = inputs.take_all()
    assert [item.kind for item in items] == [
        InputKind.ABORT,
        InputKind.ABORT,
        InputKind.ADD,
        InputKind.ADD,
        InputKind.SWITCH,
    ]
    assert [item.req_ids for item in items[:2]] == [["a"], ["b", "c"]]
    assert [item.add.req_id for item in items[2:4]] == ["a", "b"]
    assert items[4].model is None
    assert inputs.empty() and inputs.take_all() == []


def test_take_all_waits_only_when_given_a_timeout():
    inputs = InputQueue()
    assert inputs.take_all(timeout=0.01) == []
    inputs.put_abort(["x"])
    assert [item.req_ids for item in inputs.take_all(timeout=0.01)] == [["x"]]
