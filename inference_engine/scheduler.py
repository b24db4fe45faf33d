"""Continuous batching, vLLM V1 style: token budget, chunked prefill, admission, preemption.

Each step serves running requests first (a decode takes one token, an unfinished prefill its
next chunk) out of ``max_num_batched_tokens``, then admits waiting requests while the budget,
``max_num_seqs`` and free KV blocks allow. When blocks run out a running request is preempted
by recompute: its blocks are freed and it goes back to the front of its waiting queue. The
waiting queue's policy (``waiting_queue.py``: ``fcfs``, ``priority`` or ``fair``, the default)
orders admission and picks the victim; lower priority values go first, as in vLLM.

Under ``fair`` admission leaves ``num_reserved_blocks`` free, except for a tenant below its
fair share of the blocks held, and such a tenant's request that still does not fit preempts
the most-served tenant's newest request (of the same or a lower priority), also in a step that
preempted already. Without that, one tenant's flood keeps the cache full to the last block, its
running requests preempt its own newest ones to grow in most steps, and a step that preempted
admits nobody: another tenant's request waited at the head of the queue for a step that
neither preempted nor found the cache full. And when the head of the queue is a tenant with
nothing running, its first chunk gets a short step of its own before the next full one
(``_newcomer_step_excludes``), or, on engines that pause a step between layers for it
(``EngineCore``'s mid-step admission), inside the step under way (``schedule_newcomers``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from inference_engine.kv_cache import KVCacheBlock, KVCacheManager
from inference_engine.protocol import FinishReason
from inference_engine.request import Request, RequestStatus
from inference_engine.waiting_queue import make_waiting_queue

# 1/64 of the cache (8 of 512 blocks)
RESERVE_FRACTION = 64


class RequestRejected(ValueError):
    """The request can never be served with this configuration."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # num_computed_tokens when scheduled: the position of the first new token
    start: int
    # True when this chunk reaches the request's last token (known or being sampled by a
    # step in flight), so a new token is sampled
    is_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        request = self.request
        self.is_sampling = self.start + self.num_new_tokens == request.num_tokens_with_placeholders

    @property
    def has_device_token(self) -> bool:
        """Whether this chunk's last token is one a step in flight is sampling: its id is on
        the device only (async scheduling)."""
        return self.start + self.num_new_tokens > self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # the scheduled requests' block tables as the step was launched (the core's)
    block_tables: list[list[int]] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        policy: str = "fair",
    ) -> None:
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step's prompt positions whose logits are kept for prompt logprobs: the memory
        # profile sized a step's logits for max_num_seqs rows and the sampler's float32 and
        # sorted copies of them, three times what a kept prompt row costs
        self.max_prompt_logprob_rows = 2 * max_num_seqs
        self._prompt_rows_left = 0  # of the step being scheduled
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = make_waiting_queue(policy)
        # under fair, blocks that only a tenant below its fair share may take at admission
        self.num_reserved_blocks = num_blocks // RESERVE_FRACTION if self.waiting.is_fair else 0
        self._arrival_counter = itertools.count()
        self._was_newcomer_step = False
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_fits(self, request: Request) -> None:
        """Raise RequestRejected when the request could not run even with the cache to itself.
        The last token never needs KV, so ``max_num_tokens - 1`` slots suffice, unless that
        last token is the prompt's own (a prompt at the context limit): every prompt token is
        computed, so it needs them all (it was admitted, and never scheduled)."""
        num_needed = self.kv_cache.num_blocks_for(
            max(request.max_num_tokens - 1, request.num_prompt_tokens)
        )
        if num_needed > self.kv_cache.num_blocks:
            raise RequestRejected(
                f"request {request.req_id} needs up to {request.max_num_tokens} tokens "
                f"({num_needed} KV blocks) but the cache has only {self.kv_cache.num_blocks} "
                f"blocks of {self.kv_cache.block_size} tokens"
            )

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        self.check_fits(request)
        request.arrival_order = next(self._arrival_counter)
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.push(request)

    def abort_requests(self, req_ids: list[str]) -> list[Request]:
        """Finish the given unfinished requests with ABORT; unknown ids are ignored."""
        aborted = [self.requests[req_id] for req_id in req_ids if req_id in self.requests]
        for request in aborted:
            self._finish(request, FinishReason.ABORT)
        if aborted:
            self.running = [request for request in self.running if not request.is_finished]
        return aborted

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self.max_num_batched_tokens
        self._prompt_rows_left = self.max_prompt_logprob_rows
        busy_tenants = self._newcomer_step_excludes()
        self._was_newcomer_step = busy_tenants is not None

        for request in list(self.running):
            if budget == 0 or busy_tenants is not None:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if (
                request.num_output_placeholders
                and request.num_tokens_with_placeholders >= request.max_num_tokens
            ):
                continue  # the token a step in flight samples is its last
            num_new_tokens = self._cap_prompt_rows(
                request,
                min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget),
            )
            while self.kv_cache.allocate_slots(request, num_new_tokens) is None:
                victim = self._memory_victim()
                budget += self._preempt_in_step(victim, scheduled, output)
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                item = ScheduledRequest(request, num_new_tokens, request.num_computed_tokens)
                scheduled[request.req_id] = item
                self._charge(item)
                budget -= num_new_tokens

        preempted_tenants = {self.requests[req_id].tenant_id for req_id in output.preempted_req_ids}
        admitted: list[Request] = []
        while (
            budget > 0
            and len(self.running) < self.max_num_seqs
            and (request := self.waiting.peek()) is not None
        ):
            # memory is short once this step preempted: only a tenant below its fair share
            # goes on, if it lost no request itself (fcfs and priority know no shares)
            if output.preempted_req_ids and not self.waiting.is_fair:
                break
            if busy_tenants is not None and request.tenant_id in busy_tenants:
                break
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new_tokens = self._cap_prompt_rows(
                request, min(request.num_tokens - num_cached, budget)
            )
            new_block_ids = None
            if not output.preempted_req_ids:
                new_block_ids = self.kv_cache.allocate_slots(
                    request, num_new_tokens, computed_blocks, self._num_reserved_for_admission()
                )
            if (
                new_block_ids is None
                and request.tenant_id not in preempted_tenants
                and self._is_below_fair_share(request.tenant_id)
            ):
                # preempt only victims that make room: preempting some that leave it short
                # all the same would waste their places (and it would again each step)
                victims = self._fair_victims(request, computed_blocks, num_new_tokens, admitted)
                for victim in victims:
                    if victim.status == RequestStatus.RUNNING:  # not gone with another
                        budget += self._preempt_in_step(victim, scheduled, output)
                preempted_tenants.update(
                    self.requests[req_id].tenant_id for req_id in output.preempted_req_ids
                )
                if victims:
                    # a hit on a block a victim was to write this step is no hit any more;
                    # the chunk ends where the victims were chosen to make room for (their
                    # refunded budget would make it longer than the room they leave)
                    end = num_cached + num_new_tokens
                    computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
                    num_new_tokens = min(end - num_cached, budget)
                new_block_ids = self.kv_cache.allocate_slots(
                    request, num_new_tokens, computed_blocks
                )
            if new_block_ids is None:
                break
            item = self._admit(request, num_cached, num_new_tokens)
            scheduled[request.req_id] = item
            admitted.append(request)
            budget -= num_new_tokens

        output.scheduled = list(scheduled.values())
        if busy_tenants is not None and not output.scheduled and not output.preempted_req_ids:
            # a newcomer's step that found no room for one: a step of the running requests
            # instead (an empty step would leave the device idle, every other step, as long
            # as the newcomer waits)
            return self.schedule()
        self._commit(output)
        return output

    def schedule_newcomers(self, in_flight: SchedulerOutput) -> SchedulerOutput:
        """A newcomer's step inside the step ``in_flight`` (whose model run is paused between
        two layers): under fair, when the head of the waiting queue is of a tenant with
        nothing running (``_newcomer_step_excludes``), admit such tenants' requests into free
        blocks, preempting nobody, and reusing no cached block that ``in_flight`` is still
        writing. Empty when there is no such request, or no room for it, or ``in_flight`` is
        itself a newcomer's step. So a newcomer's first token waits for a layer of a long step,
        not for all of it."""
        output = SchedulerOutput()
        busy_tenants = self._newcomer_step_excludes()  # None while in_flight is a newcomer's
        if busy_tenants is None:
            return output
        being_written: set[int] | None = None
        budget = self.max_num_batched_tokens
        self._prompt_rows_left = self.max_prompt_logprob_rows
        while (
            budget > 0
            and len(self.running) < self.max_num_seqs
            and (request := self.waiting.peek()) is not None
            and request.tenant_id not in busy_tenants
        ):
            if being_written is None:
                being_written = self._blocks_being_written(in_flight)
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request, being_written)
            num_new_tokens = self._cap_prompt_rows(
                request, min(request.num_tokens - num_cached, budget)
            )
            reserve = (
                0
                if self._is_below_fair_share(request.tenant_id)
                else self._num_reserved_for_admission()
            )
            new_block_ids = self.kv_cache.allocate_slots(
                request, num_new_tokens, computed_blocks, reserve
            )
            if new_block_ids is None:
                break
            output.scheduled.append(self._admit(request, num_cached, num_new_tokens))
            budget -= num_new_tokens
        self._commit(output)
        return output

    @staticmethod
    def _commit(output: SchedulerOutput) -> None:
        """Count a scheduled step's tokens as computed as it is scheduled (so the next step can
        be scheduled before this one's tokens are back: async scheduling), and a token it
        samples as a placeholder until ``update_from_output`` has its id."""
        for item in output.scheduled:
            item.request.num_computed_tokens = item.start + item.num_new_tokens
            item.request.num_output_placeholders += item.is_sampling

    def _blocks_being_written(self, step: SchedulerOutput) -> set[int]:
        """The blocks that ``step``'s new tokens go into (their KV is not all there yet)."""
        written: set[int] = set()
        for item in step.scheduled:
            if item.request.status == RequestStatus.RUNNING:
                written.update(self._blocks_written_by(item))
        return written

    def _blocks_written_by(
        self, item: ScheduledRequest, block_ids: list[int] | None = None
    ) -> list[int]:
        """The blocks ``item``'s new tokens go into, in its block table (``block_ids``, or the
        request's current one)."""
        size = self.kv_cache.block_size
        if block_ids is None:
            block_ids = self.kv_cache.get_block_ids(item.request.req_id)
        first, last = item.start // size, (item.start + item.num_new_tokens - 1) // size
        return block_ids[first : last + 1]

    def _preempt_in_step(
        self, victim: Request, scheduled: dict[str, ScheduledRequest], output: SchedulerOutput
    ) -> int:
        """Preempt ``victim`` while this step is being scheduled; the tokens that go back to
        the step's budget. A victim scheduled in this step already leaves the blocks of its
        chunk unwritten: their prefix-cache entries go, and so does every request admitted in
        this step on a hit of one of them (its context would be KV nobody computed)."""
        item = scheduled.pop(victim.req_id, None)
        unwritten = set(self._blocks_written_by(item)) if item is not None else set()
        self._preempt(victim)
        output.preempted_req_ids.append(victim.req_id)
        if item is None:
            return 0
        self._charge(item, refund=True)
        num_refunded = item.num_new_tokens
        self.kv_cache.uncache(unwritten)
        size = self.kv_cache.block_size
        for other in list(scheduled.values()):
            context = self.kv_cache.get_block_ids(other.request.req_id)[: other.start // size]
            if other.request.req_id in scheduled and not unwritten.isdisjoint(context):
                if not other.request.num_preemptions and not other.request.output_token_ids:
                    other.request.num_cached_tokens = -1  # its hits were not hits after all
                    other.request.num_computed_tokens = 0  # nor were they computed: unmetered
                num_refunded += self._preempt_in_step(other.request, scheduled, output)
        return num_refunded

    def _cap_prompt_rows(self, request: Request, num_new_tokens: int) -> int:
        """``num_new_tokens``, cut so that a chunk whose prompt logprobs are wanted keeps no
        more logits rows than the step has left (taken from them), and never none: a long
        prompt's logprobs take more steps, not more memory."""
        if not request.reads_whole_prompt:
            return num_new_tokens
        num_new_tokens = min(num_new_tokens, max(self._prompt_rows_left, 1))
        self._prompt_rows_left = max(self._prompt_rows_left - num_new_tokens, 0)
        return num_new_tokens

    def _admit(self, request: Request, num_cached: int, num_new_tokens: int) -> ScheduledRequest:
        """Move ``request`` (the head of the waiting queue, its blocks allocated) to running."""
        self.waiting.pop(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if not request.timings.first_scheduled:
            request.timings.first_scheduled = time.time()
        self.running.append(request)
        item = ScheduledRequest(request, num_new_tokens, num_cached)
        # charged as it is admitted, so the next admission of this step sees it
        self._charge(item)
        return item

    def _newcomer_step_excludes(self) -> set[str] | None:
        """Under fair, when the request at the head of the waiting queue is of a tenant with
        nothing running (and as urgent as anything running), this step admits only such
        tenants' requests and runs nothing else: the tenants with requests running (returned)
        wait that one short step, as decodes waited for prefills in vLLM V0's steps, and the
        newcomer's first token waits for the step under way but not also for a full one of
        theirs. Never two such steps in a row, so the running requests lose at most every
        other step, each a short one."""
        if not (self.waiting.is_fair and self.running) or self._was_newcomer_step:
            return None
        head = self.waiting.peek()
        if head is None or head.priority > min(request.priority for request in self.running):
            return None
        busy_tenants = {request.tenant_id for request in self.running}
        return None if head.tenant_id in busy_tenants else busy_tenants

    def _num_reserved_for_admission(self) -> int:
        """Free blocks an admission must leave (fair only, and only beside running requests:
        alone, a request may have the whole cache)."""
        return self.num_reserved_blocks if self.running else 0

    def _num_blocks_by_tenant(self) -> dict[str, int]:
        """tenant -> KV blocks its running requests hold (a shared prefix block counts for
        each request that holds it: what each request would need alone)."""
        num_held: dict[str, int] = {}
        for request in self.running:
            num_blocks = len(self.kv_cache.get_block_ids(request.req_id))
            num_held[request.tenant_id] = num_held.get(request.tenant_id, 0) + num_blocks
        return num_held

    def _is_below_fair_share(self, tenant: str, num_held: dict[str, int] | None = None) -> bool:
        if not self.waiting.is_fair:
            return False
        num_held = self._num_blocks_by_tenant() if num_held is None else num_held
        return self.waiting.is_below_fair_share(tenant, num_held, sum(num_held.values()))

    def _memory_victim(self) -> Request:
        """The running request to preempt when a running one needs blocks: the queue's pick
        (lowest priority, most served, newest); under fair, within the lowest priority, a
        request of a tenant at or above its fair share where there is one, so a newcomer
        lifted to the others' counter is not the one to go.

        Under fair, a request preempted before is not taken again while one that was not can
        be, and among such requests the newest goes, as vLLM's rule has it: so the oldest
        always makes progress. The most-served tenant's request is the one closest to
        finishing, and requests that each needed most of the cache took turns preempting each
        other, none ever finishing."""
        if not self.waiting.is_fair:
            return self.waiting.victim(self.running)
        lowest = max(request.priority for request in self.running)
        pool = [request for request in self.running if request.priority == lowest]
        fresh = [request for request in pool if not request.num_preemptions]
        if not fresh:
            return max(pool, key=lambda request: request.arrival_order)
        num_held = self._num_blocks_by_tenant()
        over = [r for r in fresh if not self._is_below_fair_share(r.tenant_id, num_held)]
        return self.waiting.victim(over or fresh)

    def _fair_victims(
        self,
        request: Request,
        computed_blocks: list[KVCacheBlock],
        num_new_tokens: int,
        admitted: list[Request],
    ) -> list[Request]:
        """The running requests to preempt, one by one as ``_fair_victim`` picks them, so that
        ``request`` (its prefix hits ``computed_blocks``, then ``num_new_tokens``) fits; none
        when even all that may be taken would leave it short. None of ``admitted`` (in this
        step) is taken: the queue put it first, and it is a newcomer too."""
        kv = self.kv_cache
        num_blocks = kv.num_blocks_for(len(computed_blocks) * kv.block_size + num_new_tokens)
        # a hit in the free queue is taken from it like a new block
        num_needed = num_blocks - sum(1 for block in computed_blocks if block.ref_cnt > 0)
        num_free = kv.num_free_blocks
        num_held = self._num_blocks_by_tenant()
        hits = {block.block_id for block in computed_blocks}
        refs: dict[int, int] = {}  # block id -> holders left once the victims so far are gone
        victims: list[Request] = []
        while num_free < num_needed:
            victim = self._fair_victim(request, num_blocks, num_held, admitted + victims)
            if victim is None:
                return []
            victims.append(victim)
            blocks = kv.req_to_blocks.get(victim.req_id, [])
            num_held[victim.tenant_id] -= len(blocks)
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, block.ref_cnt) - 1
                if refs[block.block_id] == 0:
                    num_free += 1
                    # a hit the victim held alone goes to the free queue, to be taken back
                    num_needed += block.block_id in hits
        return victims

    def _fair_victim(
        self,
        request: Request,
        num_blocks: int,
        num_held: dict[str, int],
        taken: list[Request],
    ) -> Request | None:
        """The running request to preempt, besides ``taken``, so that ``request`` (of a tenant
        below its fair share, ``num_blocks`` blocks once admitted) fits, the tenants holding
        ``num_held`` blocks: the newest of the most-served tenant among those at or above
        their share that still hold more than ``request``'s tenant once the move is done
        (weighed by their shares, so two tenants never take a request back and forth), and
        never one of a higher priority than ``request``'s."""
        num_after = (num_held.get(request.tenant_id, 0) + num_blocks) / request.weight
        candidates = [
            running
            for running in self.running
            if running.tenant_id != request.tenant_id
            and running not in taken
            and running.priority >= request.priority
            and not self._is_below_fair_share(running.tenant_id, num_held)
            and (num_held[running.tenant_id] - len(self.kv_cache.get_block_ids(running.req_id)))
            / running.weight
            >= num_after
        ]
        return self.waiting.victim(candidates) if candidates else None

    def _charge(self, item: ScheduledRequest, refund: bool = False) -> None:
        """Tell the waiting queue what this step serves ``item``'s tenant: positions computed
        count as prompt tokens, except a decode's one position, which is its last sampled
        token; a sampled token counts as output."""
        is_decode = item.is_sampling and item.start >= item.request.num_prompt_tokens
        num_prompt, num_output = item.num_new_tokens - is_decode, int(item.is_sampling)
        sign = -1 if refund else 1
        self.waiting.charge(item.request, sign * num_prompt, sign * num_output)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Append a step's sampled tokens (req_id -> token id) and finish requests that hit
        EOS, a stop token or their length. Returns the requests that got a new token, finished
        ones included. A request finished since the step was scheduled (aborted while it ran;
        with async scheduling, also finished by the step before) gets nothing from it. One
        preempted since (by the step after, with async scheduling: a request is never admitted
        again by the step that preempted it) keeps its token, sampled from its whole context:
        its seeded generator drew it and its grammar accepted it, so dropping it would have
        made its output depend on the batch, and a guided one break its grammar. Readmitted,
        it recomputes the token's KV with the rest."""
        updated = []
        now = time.time()
        for item in output.scheduled:
            request = item.request
            if request.status == RequestStatus.RUNNING:
                request.num_output_placeholders -= item.is_sampling
            elif request.status != RequestStatus.PREEMPTED:
                continue
            token_id = sampled_token_ids.get(request.req_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            if not request.timings.first_token:
                request.timings.first_token = now
            reason = request.check_stop()
            if reason is not None:
                self._finish(request, reason)
            updated.append(request)
        if any(request.is_finished for request in updated):
            self.running = [request for request in self.running if not request.is_finished]
        return updated

    def forget_failed_step(self, step: SchedulerOutput) -> list[str]:
        """A step that failed may have written none of its KV: forget the prefix-cache entries
        of the blocks it was to fill. Returns the running requests outside the step that hold
        one of them (a later step in flight admitted them on a hit of one; or took it afresh,
        which cannot be told apart): their context may be KV nobody computed, so they fail
        with the step."""
        tables = step.block_tables or [
            self.kv_cache.get_block_ids(item.request.req_id) for item in step.scheduled
        ]
        unwritten: set[int] = set()
        for item, block_ids in zip(step.scheduled, tables, strict=True):
            unwritten.update(self._blocks_written_by(item, block_ids))
        self.kv_cache.uncache(unwritten)
        in_step = {item.request.req_id for item in step.scheduled}
        readers = [
            request.req_id
            for request in self.running
            if request.req_id not in in_step
            and not unwritten.isdisjoint(self.kv_cache.get_block_ids(request.req_id))
        ]
        self._uncache_held_only_by([*in_step, *readers])
        return readers

    def _uncache_held_only_by(self, req_ids: list[str]) -> None:
        """Forget the prefix-cache entries of the blocks these failing requests alone hold:
        a step launched after the failed one (async scheduling) wrote some of them from
        context the failed step never wrote, and a later request with the same prompt, once
        it wrote that context again, would hit them."""
        holders: Counter[int] = Counter()
        for req_id in req_ids:
            holders.update(self.kv_cache.get_block_ids(req_id))
        blocks = self.kv_cache.blocks
        self.kv_cache.uncache(
            block_id for block_id, count in holders.items() if blocks[block_id].ref_cnt == count
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.req_id)
        request.num_prompt_tokens_computed_before_preemption = request.num_prefilled_prompt_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        was_waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished = time.time()
        self.kv_cache.free(request.req_id)
        if self.requests.pop(request.req_id, None) is not None:
            self.waiting.finished(request, was_waiting)
