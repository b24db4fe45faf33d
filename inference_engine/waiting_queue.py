"""Which waiting request the scheduler admits next, and which running one it preempts.

- ``fcfs``: arrival order; priorities are ignored.
- ``priority``: lower ``priority`` first, then arrival order (vLLM's priority policy).
- ``fair`` (default): priority first; within a priority, the tenant with the lowest virtual
  token counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), then
  that tenant's oldest request. A tenant's counter grows with the tokens it is served:
  prompt tokens computed count 1, each generated token 2, divided by the tenant's ``weight``
  (its plan's share). A tenant that comes back from idle starts at the lowest counter of the
  tenants with work in the engine, so idling banks no credit. Preemption under memory
  pressure takes the newest request of the most-served tenant at the lowest priority, of
  those not preempted before; once all were, the newest (so the oldest always progresses).

Running requests are never preempted for fairness alone. Under ``fair`` a tenant below its
fair share (of the KV blocks the running requests hold, split by weight among the tenants with
work in the engine) may take the few blocks that admission otherwise leaves free, and when its
request does not fit even so, that is memory pressure: the scheduler preempts the newest
request of the most-served tenant at or above its share. So one tenant's flood cannot keep a
newcomer waiting until its requests finish.
Pure Python, no torch, so it is tested without a model.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable

from inference_engine.request import Request, RequestStatus

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


def _is_waiting(request: Request) -> bool:
    return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _remove(heap: list[tuple], request: Request) -> None:
    """Remove ``request``'s entry from ``heap``: its head, as a rule (``peek`` returned it); a
    request that went back to the queue ahead of it meanwhile (preempted in the same step)
    stays queued."""
    if heap[0][-1] is request:
        heapq.heappop(heap)
        return
    index = next(i for i, entry in enumerate(heap) if entry[-1] is request)
    heap[index] = heap[-1]
    heap.pop()
    heapq.heapify(heap)


class WaitingQueue:
    """FCFS or priority order in one heap; aborted entries are skipped lazily."""

    # whether tenants have shares of the KV cache (``is_below_fair_share``)
    is_fair = False

    def __init__(self, use_priority: bool) -> None:
        self.use_priority = use_priority
        self._heap: list[tuple[int, int, Request]] = []
        self._waiting_counts: dict[str, int] = defaultdict(int)

    def push(self, request: Request) -> None:
        """A new request, or a preempted one going back (it keeps its arrival order, so it
        comes first again)."""
        self._waiting_counts[request.tenant_id] += 1
        priority = request.priority if self.use_priority else 0
        heapq.heappush(self._heap, (priority, request.arrival_order, request))

    def peek(self) -> Request | None:
        while self._heap:
            request = self._heap[0][2]
            if _is_waiting(request):
                return request
            heapq.heappop(self._heap)
        return None

    def pop(self, request: Request) -> None:
        """Remove ``request``, which ``peek`` just returned."""
        self._uncount(request.tenant_id)
        _remove(self._heap, request)

    def requests(self) -> list[Request]:
        """Every request waiting in the queue, in no particular order."""
        return [entry[-1] for entry in self._heap if _is_waiting(entry[-1])]

    def _uncount(self, tenant: str) -> None:
        self._waiting_counts[tenant] -= 1
        if self._waiting_counts[tenant] <= 0:
            del self._waiting_counts[tenant]

    def charge(self, request: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Tokens served to ``request`` in a step (only the fair queue keeps count)."""

    def finished(self, request: Request, was_waiting: bool) -> None:
        """``request`` left the engine (aborted while waiting, if ``was_waiting``)."""
        if was_waiting:
            self._uncount(request.tenant_id)

    def victim(self, running: Iterable[Request]) -> Request:
        if self.use_priority:
            return max(running, key=lambda r: (r.priority, r.arrival_order))
        return max(running, key=lambda r: r.arrival_order)

    def num_waiting_by_tenant(self) -> dict[str, int]:
        return dict(self._waiting_counts)

    def is_below_fair_share(self, tenant: str, num_held: dict[str, int], num_blocks: int) -> bool:
        """Whether ``tenant`` holds fewer than its share of ``num_blocks`` KV blocks, given the
        blocks each tenant holds (tenant -> blocks). Only the fair queue has shares."""
        return False


class FairQueue(WaitingQueue):
    """Priority, then the least-served tenant (virtual token counters), then arrival."""

    is_fair = True

    def __init__(self) -> None:
        super().__init__(use_priority=True)
        # priority -> tenant -> heap of (arrival_order, request)
        self._tenants: dict[int, dict[str, list[tuple[int, Request]]]] = defaultdict(dict)
        self.counters: dict[str, float] = {}
        self._num_unfinished: dict[str, int] = defaultdict(int)
        # tenant -> weight of its latest request
        self._weights: dict[str, float] = {}

    def push(self, request: Request) -> None:
        tenant = request.tenant_id
        if request.status == RequestStatus.WAITING and request.num_preemptions == 0:
            if self._num_unfinished[tenant] == 0:
                self._lift(tenant)
            self._num_unfinished[tenant] += 1
            self._weights[tenant] = request.weight
        self._waiting_counts[tenant] += 1
        queue = self._tenants[request.priority].setdefault(tenant, [])
        heapq.heappush(queue, (request.arrival_order, request))

    def _lift(self, tenant: str) -> None:
        """A tenant back from idle starts at the lowest counter among those with work."""
        active = [self.counters.get(t, 0.0) for t, n in self._num_unfinished.items() if n > 0]
        floor = min(active) if active else 0.0
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def peek(self) -> Request | None:
        for priority in sorted(self._tenants):
            tenants = self._tenants[priority]
            best: tuple[tuple[float, int, int], Request] | None = None
            for tenant, queue in list(tenants.items()):
                while queue and not _is_waiting(queue[0][1]):
                    heapq.heappop(queue)
                if not queue:
                    del tenants[tenant]
                    continue
                arrival, request = queue[0]
                # on a tie the tenant with less in the engine goes first (a newcomer, lifted
                # to the lowest counter, does not wait behind a flood's oldest request)
                key = (self.counters.get(tenant, 0.0), self._num_unfinished[tenant], arrival)
                if best is None or key < best[0]:
                    best = (key, request)
            if best is not None:
                return best[1]
            del self._tenants[priority]
        return None

    def pop(self, request: Request) -> None:
        self._uncount(request.tenant_id)
        _remove(self._tenants[request.priority][request.tenant_id], request)

    def requests(self) -> list[Request]:
        return [
            entry[-1]
            for tenants in self._tenants.values()
            for queue in tenants.values()
            for entry in queue
            if _is_waiting(entry[-1])
        ]

    def charge(self, request: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = num_prompt_tokens * PROMPT_TOKEN_COST + num_output_tokens * OUTPUT_TOKEN_COST
        tenant = request.tenant_id
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / request.weight

    def finished(self, request: Request, was_waiting: bool) -> None:
        super().finished(request, was_waiting)
        tenant = request.tenant_id
        self._num_unfinished[tenant] -= 1
        if self._num_unfinished[tenant] <= 0:
            del self._num_unfinished[tenant]
            self._weights.pop(tenant, None)

    def is_below_fair_share(self, tenant: str, num_held: dict[str, int], num_blocks: int) -> bool:
        total_weight = sum(self._weights.values())
        share = num_blocks * self._weights.get(tenant, 0.0) / total_weight if total_weight else 0
        return num_held.get(tenant, 0) < share

    def victim(self, running: Iterable[Request]) -> Request:
        return max(
            running,
            key=lambda r: (r.priority, self.counters.get(r.tenant_id, 0.0), r.arrival_order),
        )


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fair":
        return FairQueue()
    if policy in ("fcfs", "priority"):
        return WaitingQueue(use_priority=policy == "priority")
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
