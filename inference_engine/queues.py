"""What the engine process's threads hand each other (see ``server.py``).

The I/O thread (and the model controller, for a switch) put work on the busy loop's
``InputQueue``: aborts come out before adds and switches, and within a kind in the order they
were put. The busy loop hands each step's outputs on as ``StepOutputs``.
"""

from __future__ import annotations

import enum
import itertools
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_engine.protocol import EngineOutput, SamplingParams

if TYPE_CHECKING:
    from inference_engine.model_control import LoadedModel


class InputKind(enum.IntEnum):
    # lower sorts first: an abort never waits behind adds
    ABORT = 0
    ADD = 1
    SWITCH = 2


@dataclass(slots=True)
class QueuedAdd:
    """A generate request on its way from the I/O thread to the core."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    tenant_id: str
    tenant_weight: float
    max_model_len: int | None = None  # the caller's, where lower than the engine's
    grammar: object | None = None  # its constraint compiled (an xgrammar.CompiledGrammar)


@dataclass(order=True, slots=True)
class QueuedInput:
    """One item of the busy loop's input queue; only ``kind`` and ``seq`` order it."""

    kind: InputKind
    seq: int
    # ABORT: the requests to abort
    req_ids: list[str] = field(default_factory=list, compare=False)
    # ADD: the request
    add: QueuedAdd | None = field(default=None, compare=False)
    # SWITCH: the model to serve once the current one's requests are done (None: nothing)
    model: LoadedModel | None = field(default=None, compare=False)


class InputQueue:
    """The busy loop's input queue; any thread may put, the busy loop takes."""

    def __init__(self) -> None:
        self._queue: queue.PriorityQueue[QueuedInput] = queue.PriorityQueue()
        self._seq = itertools.count()

    def put_abort(self, req_ids: list[str]) -> None:
        self._queue.put(QueuedInput(InputKind.ABORT, next(self._seq), req_ids=req_ids))

    def put_add(self, add: QueuedAdd) -> None:
        self._queue.put(QueuedInput(InputKind.ADD, next(self._seq), add=add))

    def put_switch(self, model: LoadedModel | None) -> None:
        self._queue.put(QueuedInput(InputKind.SWITCH, next(self._seq), model=model))

    def take_all(self, timeout: float | None = None) -> list[QueuedInput]:
        """Everything queued, in order. With a ``timeout`` it waits up to that many seconds
        for a first item; without one it returns at once."""
        items = []
        try:
            items.append(self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait())
            while True:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def empty(self) -> bool:
        return self._queue.empty()


@dataclass(slots=True)
class StepOutputs:
    """One step's outputs, for the output processor."""

    outputs: list[EngineOutput]
    # when the step's tokens were sampled (time.time())
    step_time: float
