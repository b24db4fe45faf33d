"""Grammar compiles off the engine's intake thread.

A request's grammar compiles in tens of milliseconds, but a schema can be written to take
minutes (each pattern costs a millisecond or more, and a body holds 8 MB of them). On the
intake thread, which every new request waits behind, one tenant's such schema held up every
tenant's requests. Here compiles run on a few worker threads (xgrammar lets go of the GIL
while it compiles), one at a time per tenant in arrival order, the tenants taking turns, as
vLLM compiles its grammars on a pool while their requests wait: a tenant whose grammars take
long waits behind its own alone, and requests without one do not wait at all.

Each job is answered exactly once, through its ``answer`` callback: with what its compile
returned (or raised); or as timed out, when it waited ``timeout`` seconds without starting
(``started`` False: the workers were busy with its tenant's earlier jobs, or everyone's) or
its compile ran ``timeout`` seconds (``started`` True: the grammar itself is too slow); or as
cancelled, or closed when the queue stops. A compile cannot be interrupted: one past its
time runs on, its result dropped and its tenant's next job waiting for it, but its thread no
longer counts as a worker: another takes its place (up to ``MAX_STUCK_COMPILES`` such), so
tenants whose grammars are slow cannot hold the pool from the others.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# compiles past their time that may run on beside the workers (each holds a core until done)
MAX_STUCK_COMPILES = 8


@dataclass(frozen=True)
class Outcome:
    """How a job ended; exactly one of these holds."""

    result: object = None  # what its compile returned
    error: Exception | None = None  # what its compile raised
    timed_out: bool = False  # not done by its deadline (``started``: its compile had begun)
    started: bool = False
    cancelled: bool = False
    closed: bool = False  # the queue stopped first


@dataclass(eq=False)
class _Job:
    key: str
    tenant: str
    compile: Callable[[], object]
    answer: Callable[[Outcome], None]
    deadline: float  # to start by; once started, to compile by
    started: bool = False
    answered: bool = False
    is_stuck: bool = False  # its compile ran past its time: its thread is no worker now


@dataclass
class CompileQueue:
    """``workers`` threads running compiles; see the module docstring."""

    workers: int
    timeout: float
    _lock: threading.Condition = field(default_factory=threading.Condition, init=False)
    _jobs: dict[str, _Job] = field(default_factory=dict, init=False)  # unanswered, by key
    _waiting: dict[str, deque[_Job]] = field(default_factory=dict, init=False)  # by tenant
    _turns: deque[str] = field(default_factory=deque, init=False)  # tenants to start next
    _running: set[str] = field(default_factory=set, init=False)  # tenants compiling now
    _deadlines: list[tuple[float, int, _Job]] = field(default_factory=list, init=False)
    _order: itertools.count = field(default_factory=itertools.count, init=False)
    _num_threads: int = field(default=0, init=False)  # worker threads alive, stuck ones too
    _num_stuck: int = field(default=0, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")

    def start(self) -> None:
        with self._lock:
            for _ in range(self.workers):
                self._add_worker()
        threading.Thread(target=self._watch, name="engine-grammar-watch", daemon=True).start()

    def _add_worker(self) -> None:
        """Start one more worker thread (lock held; not kept: a stuck one's replacement would
        leave a dead thread in a list for every slow grammar)."""
        self._num_threads += 1
        name = f"engine-grammar-{next(self._order)}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(
        self,
        key: str,
        tenant: str,
        compile: Callable[[], object],
        answer: Callable[[Outcome], None],
    ) -> None:
        """Queue ``compile`` behind ``tenant``'s earlier jobs; ``answer`` gets its outcome (on
        a worker or the deadline watcher's thread; at once where the queue is closed)."""
        job = _Job(key, tenant, compile, answer, time.monotonic() + self.timeout)
        with self._lock:
            if not self._closed:
                self._jobs[key] = job
                queued = self._waiting.setdefault(tenant, deque())
                queued.append(job)
                if len(queued) == 1 and tenant not in self._running:
                    self._turns.append(tenant)
                heapq.heappush(self._deadlines, (job.deadline, next(self._order), job))
                self._lock.notify_all()
                return
        answer(Outcome(closed=True))

    def cancel(self, key: str) -> bool:
        """Answer the job ``key`` as cancelled where its compile has not begun (True); a
        compile under way is left to finish (False, and False for no such job)."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.started:
                return False
            self._take_waiting(job)
        job.answer(Outcome(cancelled=True))
        return True

    def close(self) -> None:
        """Stop: every job not answered yet is answered as closed (a compile under way runs
        on in its daemon thread, its result dropped)."""
        with self._lock:
            self._closed = True
            left = list(self._jobs.values())
            for job in left:
                job.answered = True
            self._jobs.clear()
            self._waiting.clear()
            self._turns.clear()
            self._lock.notify_all()
        for job in left:
            job.answer(Outcome(closed=True))

    def __len__(self) -> int:
        """Jobs not answered yet."""
        with self._lock:
            return len(self._jobs)

    def _take_waiting(self, job: _Job) -> None:
        """Take a job that has not started out of its tenant's line, answered (lock held)."""
        job.answered = True
        del self._jobs[job.key]
        queued = self._waiting[job.tenant]
        queued.remove(job)
        if not queued:
            del self._waiting[job.tenant]
            if job.tenant in self._turns:
                self._turns.remove(job.tenant)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._turns and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                tenant = self._turns.popleft()
                queued = self._waiting[tenant]
                job = queued.popleft()
                if not queued:
                    del self._waiting[tenant]
                job.started = True
                job.deadline = time.monotonic() + self.timeout  # its own time, from now
                heapq.heappush(self._deadlines, (job.deadline, next(self._order), job))
                self._running.add(tenant)
                self._lock.notify_all()
            try:
                outcome = Outcome(result=job.compile())
            except Exception as exc:  # noqa: BLE001 - answered with it, the worker lives on
                logger.exception("compiling the grammar of %s failed", job.key)
                outcome = Outcome(error=exc)
            with self._lock:
                self._running.discard(tenant)
                if tenant in self._waiting:
                    self._turns.append(tenant)  # its next job, after the other tenants'
                    self._lock.notify_all()
                is_late = job.answered
                if not is_late:
                    job.answered = True
                    del self._jobs[job.key]
                is_surplus = False
                if job.is_stuck:  # another thread took this one's place meanwhile
                    self._num_stuck -= 1
                    is_surplus = self._num_threads - self._num_stuck > self.workers
                    if is_surplus:
                        self._num_threads -= 1
            if not is_late:
                job.answer(outcome)
            if is_surplus:
                return

    def _watch(self) -> None:
        """Answer each job not done by its deadline as timed out."""
        while True:
            expired = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][2].answered or self._deadlines[0][0] <= now
                ):
                    deadline, _, job = heapq.heappop(self._deadlines)
                    if job.answered or deadline != job.deadline:
                        continue  # answered, or started since: its compile has its own time
                    if job.started:
                        job.answered = True
                        del self._jobs[job.key]
                        job.is_stuck = True
                        self._num_stuck += 1
                        if self._num_stuck <= MAX_STUCK_COMPILES:
                            self._add_worker()  # in its place, for the other jobs
                    else:
                        self._take_waiting(job)
                    expired.append(job)
                if not expired:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._lock.wait(wait)
            for job in expired:
                job.answer(Outcome(timed_out=True, started=job.started))
