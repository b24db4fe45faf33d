"""Fair sharing between tenants (the ``fair`` waiting queue), without torch: virtual token
counters order admission within a priority, weights scale them, a tenant back from idle banks
no credit, priorities still come first, and nobody starves."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import Counter

import pytest

from inference_engine.protocol import SamplingParams
from inference_engine.request import Request
from inference_engine.scheduler import RequestRejected, Scheduler
from tests.inference_engine.test_scheduler import make_request, make_scheduler, scheduled_tokens

PROMPT, OUTPUT = 8, 8  # tokens of every request here
REQUEST_COST = PROMPT * 1 + OUTPUT * 2  # its weighted cost once served in full

ids = itertools.count()


def scheduler(policy="fair", **overrides) -> Scheduler:
    options = dict(num_blocks=256, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    options.update(overrides)
    return Scheduler(policy=policy, **options)


def request(tenant: str, priority: int = 0, weight: float = 1.0) -> Request:
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    prompt = list(range(100, 100 + PROMPT))
    return Request(
        f"{tenant}-{next(ids)}", prompt, params, tenant_id=tenant, priority=priority, weight=weight
    )


def step(scheduler: Scheduler, served: Counter) -> list[str]:
    """One step; counts each tenant's weighted tokens. Returns the admitted tenants."""
    running_before = {r.req_id for r in scheduler.running}
    output = scheduler.schedule()
    admitted = []
    for item in output.scheduled:
        request = item.request
        if request.req_id not in running_before:
            admitted.append(request.tenant_id)
        is_decode = item.is_sampling and item.start >= request.num_prompt_tokens
        served[request.tenant_id] += (item.num_new_tokens - is_decode) + 2 * item.is_sampling
    sampled = {item.request.req_id: 7 for item in output.scheduled if item.is_sampling}
    scheduler.update_from_output(output, sampled)
    return admitted


def run_with_backlogs(scheduler: Scheduler, backlogs: dict[str, list[Request]], steps: int):
    for requests in backlogs.values():
        for r in requests:
            scheduler.add_request(r)
    served: Counter = Counter()
    for _ in range(steps):
        step(scheduler, served)
    return served


def test_two_tenants_with_backlogs_share_equally():
    s = scheduler()
    served = run_with_backlogs(
        s, {"a": [request("a") for _ in range(40)], "b": [request("b") for _ in range(40)]}, 100
    )
    assert abs(served["a"] - served["b"]) <= REQUEST_COST, served


def test_fcfs_lets_the_first_flood_take_everything():
    s = scheduler(policy="fcfs")
    served = run_with_backlogs(
        s, {"a": [request("a") for _ in range(40)], "b": [request("b") for _ in range(40)]}, 100
    )
    assert served["b"] == 0 and served["a"] > 0


def test_a_weight_of_two_gets_twice_the_share():
    s = scheduler(max_num_seqs=3)
    served = run_with_backlogs(
        s,
        {
            "gold": [request("gold", weight=2.0) for _ in range(60)],
            "free": [request("free") for _ in range(60)],
        },
        160,  # both still have a backlog
    )
    assert served["gold"] == pytest.approx(2 * served["free"], abs=2 * REQUEST_COST), served


def test_a_newcomer_is_admitted_next_despite_a_flood():
    s = scheduler()
    for _ in range(50):
        s.add_request(request("flood"))
    served: Counter = Counter()
    for _ in range(40):
        step(s, served)
    s.add_request(request("newcomer"))
    admitted = []
    while "newcomer" not in admitted:
        admitted = step(s, served)
        assert len(admitted) <= 1 or admitted[0] == "newcomer"
    assert s.waiting.counters["newcomer"] >= min(s.waiting.counters.values())


def test_a_tenant_back_from_idle_banks_no_credit():
    s = scheduler()
    served: Counter = Counter()
    s.add_request(request("b"))
    for _ in range(60):
        step(s, served)  # b finishes and goes idle
    assert not any(r.tenant_id == "b" for r in s.requests.values())
    for _ in range(60):
        s.add_request(request("a"))
    for _ in range(150):
        step(s, served)  # a is served alone for a long while
    a_before = served["a"]
    for _ in range(30):
        s.add_request(request("b"))
    served_after: Counter = Counter()
    for _ in range(120):
        step(s, served_after)
    # b does not get to catch up on what a was served while b was away
    assert served_after["a"] > 0 and served["a"] >= a_before
    assert abs(served_after["a"] - served_after["b"]) <= 2 * REQUEST_COST, served_after


def test_priority_comes_before_fairness():
    s = scheduler(max_num_seqs=1)
    for _ in range(5):
        s.add_request(request("interactive", priority=0))
    for _ in range(5):
        s.add_request(request("batch", priority=10))
    admitted = []
    for _ in range(200):
        admitted += step(s, Counter())
    assert admitted == ["interactive"] * 5 + ["batch"] * 5


def test_a_low_weight_tenant_still_progresses():
    s = scheduler(max_num_seqs=2)
    served = run_with_backlogs(
        s,
        {
            "heavy": [request("heavy", weight=10.0) for _ in range(100)],
            "light": [request("light", weight=0.5) for _ in range(20)],
        },
        400,
    )
    assert served["light"] >= REQUEST_COST
    assert served["heavy"] > served["light"]


def test_preemption_takes_the_most_served_tenants_newest_request():
    # 4 blocks of 4 tokens: two 8-token prompts fill the cache; both need a third block
    s = scheduler(num_blocks=4, max_num_seqs=4)
    s.waiting.counters["heavy"] = 1000.0
    light = request("light")
    heavy = request("heavy")
    s.add_request(heavy)
    s.add_request(light)
    served: Counter = Counter()
    step(s, served)
    output = s.schedule()
    assert output.preempted_req_ids == [heavy.req_id]


def test_the_waiting_count_is_kept_per_tenant():
    s = scheduler(max_num_seqs=1)
    for tenant in ("a", "a", "b"):
        s.add_request(request(tenant))
    assert s.waiting.num_waiting_by_tenant() == {"a": 2, "b": 1}
    # counters tie at 0: the tenant with less in the engine goes first
    assert step(s, Counter()) == ["b"]
    assert s.waiting.num_waiting_by_tenant() == {"a": 2}


def test_tenant_metric_labels_are_bounded():
    from inference_engine.metrics import MAX_TENANT_LABELS, OTHER_TENANTS, EngineMetrics

    metrics = EngineMetrics("m", lambda: (0, 0, 0.0), lambda: {"t1": 3, "t200": 2})
    labels = {metrics.tenant_label(f"t{i}") for i in range(MAX_TENANT_LABELS + 50)}
    assert len(labels) == MAX_TENANT_LABELS + 1 and OTHER_TENANTS in labels
    assert metrics.tenant_label("t1") == "t1"
    [waiting] = [
        m for m in metrics.registry.collect() if m.name.endswith("tenant_requests_waiting")
    ]
    assert {s.labels["tenant"]: s.value for s in waiting.samples} == {"t1": 3, OTHER_TENANTS: 2}


def run_flood_with_newcomers(s: Scheduler, num_newcomers: int) -> list[int]:
    """Tenant a keeps 40 requests in the engine (a finished one is replaced at once) in a cache
    that holds a share of them; every 7 steps tenant b sends one request. Returns how many
    steps each of b's requests waited before its first step."""
    for _ in range(40):
        s.add_request(request("a"))
    waits, newcomer, waited = [], None, 0
    for t in range(40 + 7 * num_newcomers):
        if t >= 40 and t % 7 == 0 and newcomer is None:
            newcomer, waited = request("b"), 0
            s.add_request(newcomer)
        output = s.schedule()
        if newcomer is not None:
            if any(item.request is newcomer for item in output.scheduled):
                waits.append(waited)
                newcomer = None
            else:
                waited += 1
        sampled = {item.request.req_id: 7 for item in output.scheduled if item.is_sampling}
        for r in s.update_from_output(output, sampled):
            if r.is_finished and r.tenant_id == "a":
                s.add_request(request("a"))
    return waits


def test_a_newcomer_is_admitted_at_once_into_a_cache_full_of_a_flood():
    # 24 blocks of 4 tokens: a's flood fills the cache and keeps preempting its own newest
    # requests to grow; b's request must not wait for a's to finish or free a block
    s = scheduler(num_blocks=24, max_num_seqs=64)
    waits = run_flood_with_newcomers(s, 30)
    assert len(waits) == 30 and waits == [0] * 30, waits
    assert s.num_preemptions > 0  # the cache was full


def test_under_fcfs_a_newcomer_still_waits_for_the_flood():
    s = scheduler(policy="fcfs", num_blocks=24, max_num_seqs=64)
    waits = run_flood_with_newcomers(s, 5)
    assert min(waits, default=1000) > 0, waits


def fill_the_cache(s: Scheduler, num_requests: int) -> list[Request]:
    """Tenant a's requests of 6 distinct prompt tokens (2 blocks of 4 each, room for two
    decodes): one step admits and prefills them all."""
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    flood = [
        Request(f"a-{next(ids)}", list(range(10 * i, 10 * i + 6)), params, tenant_id="a")
        for i in range(num_requests)
    ]
    for r in flood:
        s.add_request(r)
    step(s, Counter())
    return flood


def test_a_newcomer_takes_the_place_of_the_most_served_tenants_newest_request():
    s = scheduler(num_blocks=8, max_num_seqs=8)
    flood = fill_the_cache(s, 5)
    assert s.num_running == 4 and s.kv_cache.num_free_blocks == 0
    newcomer = request("b")
    s.add_request(newcomer)
    output = s.schedule()
    # the running decodes need no new block: the newcomer's request alone is short of memory
    assert output.preempted_req_ids == [flood[3].req_id]
    assert [item.request for item in output.scheduled] == [newcomer]


def test_a_newcomer_of_a_lower_priority_preempts_nobody():
    s = scheduler(num_blocks=8, max_num_seqs=8)
    flood = fill_the_cache(s, 5)
    newcomer = request("b", priority=1)
    s.add_request(newcomer)
    output = s.schedule()
    assert not output.preempted_req_ids
    assert [item.request for item in output.scheduled] == flood[:4]


def test_a_tenant_at_its_share_is_not_preempted_for_another():
    # a and b hold half the cache each; b's next request waits for b's own blocks
    s = scheduler(num_blocks=8, max_num_seqs=8)
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    for i, tenant in enumerate("abab"):
        s.add_request(
            Request(f"{tenant}{i}", list(range(10 * i, 10 * i + 6)), params, tenant_id=tenant)
        )
    step(s, Counter())
    assert s.kv_cache.num_free_blocks == 0
    s.add_request(request("b"))
    output = s.schedule()
    assert not output.preempted_req_ids and len(output.scheduled) == 4


def test_a_lone_flood_leaves_the_reserve_to_a_newcomer():
    s = scheduler(num_blocks=256, max_num_seqs=256, max_num_batched_tokens=4096)
    assert s.num_reserved_blocks == 4
    fill_the_cache(s, 150)
    assert s.kv_cache.num_free_blocks == s.num_reserved_blocks
    newcomer = request("b")
    s.add_request(newcomer)
    output = s.schedule()
    assert newcomer in [item.request for item in output.scheduled]
    assert not output.preempted_req_ids


def test_fcfs_and_priority_keep_no_reserve():
    for policy in ("fcfs", "priority"):
        s = scheduler(policy=policy, num_blocks=256, max_num_seqs=256, max_num_batched_tokens=4096)
        fill_the_cache(s, 150)
        assert s.kv_cache.num_free_blocks == 0


def test_memory_pressure_takes_no_request_of_a_tenant_below_its_share():
    s = scheduler(num_blocks=8, max_num_seqs=8)
    flood = fill_the_cache(s, 4)
    newcomer = request("b")
    s.add_request(newcomer)
    step(s, Counter())  # in, in place of a's newest
    s.waiting.counters["b"] = 1e6  # the most served by its counter, but not by its memory
    output = s.schedule()
    # b's first decode needs a third block: a, over its share, gives one up
    assert output.preempted_req_ids == [flood[2].req_id]
    assert [item.request for item in output.scheduled] == flood[:2] + [newcomer]


def test_memory_pressure_takes_a_lower_priority_first_even_below_its_share():
    s = scheduler(num_blocks=8, max_num_seqs=8)
    flood = fill_the_cache(s, 3)
    batch = request("b", priority=1)
    s.add_request(batch)
    step(s, Counter())  # the last two free blocks
    output = s.schedule()
    assert output.preempted_req_ids == [batch.req_id]
    assert [item.request for item in output.scheduled] == flood


def run_one_step(s: Scheduler) -> list[Request]:
    output = s.schedule()
    s.update_from_output(output, {i.request.req_id: 7 for i in output.scheduled if i.is_sampling})
    return [item.request for item in output.scheduled]


def test_a_newcomers_first_chunk_gets_a_step_of_its_own():
    # its first token waits for the step under way, not also for a step full of the others'
    s = scheduler(num_blocks=64, max_num_seqs=8)
    flood = fill_the_cache(s, 3)
    newcomer, second = request("b"), request("c")
    s.add_request(newcomer)
    assert run_one_step(s) == [newcomer]
    # never two such steps in a row: the next newcomer rides with everybody
    s.add_request(second)
    assert run_one_step(s) == [*flood, newcomer, second]


def test_a_newcomer_of_a_lower_priority_or_under_fcfs_gets_no_step_of_its_own():
    for policy, priority in (("fair", 1), ("fcfs", 0), ("priority", 0)):
        s = scheduler(policy=policy, num_blocks=64, max_num_seqs=8)
        flood = fill_the_cache(s, 3)
        newcomer = request("b", priority=priority)
        s.add_request(newcomer)
        assert run_one_step(s) == [*flood, newcomer], policy


def finish_step(s: Scheduler, output) -> None:
    s.update_from_output(output, {i.request.req_id: 7 for i in output.scheduled if i.is_sampling})


def test_a_newcomer_is_admitted_inside_the_step_in_flight():
    s = scheduler(num_blocks=16, max_num_seqs=8)
    flood = fill_the_cache(s, 4)
    in_flight = s.schedule()  # a's decodes, running
    newcomer = request("b")
    s.add_request(newcomer)
    inside = s.schedule_newcomers(in_flight)
    assert [item.request for item in inside.scheduled] == [newcomer]
    assert inside.scheduled[0].start == 0 and not inside.preempted_req_ids
    finish_step(s, inside)  # the newcomer's step ends first, within the other
    finish_step(s, in_flight)
    assert [r.num_output_tokens for r in flood] == [2] * 4 and newcomer.num_output_tokens == 1
    assert [item.request for item in s.schedule().scheduled] == flood + [newcomer]


def test_inside_a_step_a_newcomer_preempts_nobody():
    s = scheduler(num_blocks=8, max_num_seqs=8)
    fill_the_cache(s, 5)  # 4 running, no block free
    in_flight = s.schedule()
    newcomer = request("b")
    s.add_request(newcomer)
    assert s.schedule_newcomers(in_flight).is_empty
    assert s.num_preemptions == 0 and len(s.running) == 4
    finish_step(s, in_flight)
    # between steps it may take the place of a's newest
    assert newcomer in [item.request for item in s.schedule().scheduled]


def test_inside_a_step_only_a_tenant_with_nothing_running_is_admitted():
    s = scheduler(num_blocks=64, max_num_seqs=8)
    fill_the_cache(s, 2)
    in_flight = s.schedule()
    s.add_request(request("a"))
    assert s.schedule_newcomers(in_flight).is_empty
    s.add_request(request("b", priority=1))  # less urgent than what runs
    assert s.schedule_newcomers(in_flight).is_empty
    assert s.num_waiting == 2


def test_no_newcomer_step_inside_a_newcomers_step():
    s = scheduler(num_blocks=64, max_num_seqs=8)
    fill_the_cache(s, 2)
    s.add_request(request("b"))
    in_flight = s.schedule()  # b's own short step
    assert [item.request.tenant_id for item in in_flight.scheduled] == ["b"]
    s.add_request(request("c"))
    assert s.schedule_newcomers(in_flight).is_empty


def test_fcfs_admits_nobody_inside_a_step():
    s = scheduler(policy="fcfs", num_blocks=64, max_num_seqs=8)
    fill_the_cache(s, 2)
    in_flight = s.schedule()
    s.add_request(request("b"))
    assert s.schedule_newcomers(in_flight).is_empty


def test_inside_a_step_no_cached_block_that_the_step_is_still_writing_is_reused():
    s = scheduler(num_blocks=64, max_num_seqs=8)
    fill_the_cache(s, 2)
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    prompt = list(range(500, 513))  # three full blocks of 4 and a token
    s.add_request(Request("a-shared", prompt, params, tenant_id="a"))
    in_flight = s.schedule()  # a's decodes and a-shared's prompt, its blocks cached already
    assert in_flight.scheduled[-1].request.req_id == "a-shared"
    s.add_request(Request("b-early", prompt, params, tenant_id="b"))
    inside = s.schedule_newcomers(in_flight)
    assert [(i.request.req_id, i.start) for i in inside.scheduled] == [("b-early", 0)]
    finish_step(s, inside)
    finish_step(s, in_flight)
    # once the step that wrote them is over, the blocks are hits
    s.add_request(Request("c-late", prompt, params, tenant_id="c"))
    in_flight = s.schedule()
    assert [(i.request.req_id, i.start) for i in in_flight.scheduled] == [("c-late", 12)]


def test_inside_a_step_a_newcomer_below_its_share_may_take_the_reserve():
    s = scheduler(num_blocks=256, max_num_seqs=256, max_num_batched_tokens=4096)
    fill_the_cache(s, 150)
    assert s.kv_cache.num_free_blocks == s.num_reserved_blocks
    in_flight = s.schedule()
    newcomer = request("b")
    s.add_request(newcomer)
    assert [item.request for item in s.schedule_newcomers(in_flight).scheduled] == [newcomer]


def run_steps(s: Scheduler, num_steps: int) -> list:
    outputs = []
    for _ in range(num_steps):
        outputs.append(s.schedule())
        sampled = {i.request.req_id: 7 for i in outputs[-1].scheduled if i.is_sampling}
        s.update_from_output(outputs[-1], sampled)
    return outputs


def test_a_newcomer_that_would_not_fit_anyway_preempts_nobody():
    """B (tenant b, below its share) needs 4 blocks; A1 holds 4 of the 7 and is not to be
    taken, so preempting A2 (2 blocks, admitted just before B in the same step) leaves B short
    all the same. A2 was preempted for nothing in every step, and waited for A1 to finish."""
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("B0", 20, max_tokens=2, first_token=700, tenant="b"))
    run_steps(scheduler, 2)  # b has been served more than a will have been
    scheduler.add_request(make_request("A1", 13, max_tokens=4, tenant="a"))
    run_steps(scheduler, 1)
    scheduler.add_request(make_request("A2", 5, max_tokens=2, first_token=300, tenant="a"))
    scheduler.add_request(make_request("B", 16, max_tokens=2, first_token=500, tenant="b"))

    output = run_steps(scheduler, 1)[0]
    assert output.preempted_req_ids == []
    assert scheduled_tokens(output) == {"A1": 1, "A2": 5}


@pytest.mark.parametrize("seed", range(3))
def test_a_newcomer_preempts_only_to_be_admitted(seed, monkeypatch):
    """Random traffic of three tenants sharing prefixes in small caches: whenever fair
    admission picks victims for a newcomer, the newcomer is admitted in that step. It was not,
    at times: the victims' refunded budget made its chunk longer than the room they left, a
    prefix hit the victim held alone was counted as room, or a later newcomer took the place
    of one admitted just before it in the same step."""
    chosen: list[tuple[Request, list[Request]]] = []
    fair_victims = Scheduler._fair_victims

    def recorded(self, request, *args):
        victims = fair_victims(self, request, *args)
        chosen.append((request, victims))
        return victims

    monkeypatch.setattr(Scheduler, "_fair_victims", recorded)
    rng = random.Random(seed)
    num_wasted = num_taken = 0
    for trial in range(300):
        s = scheduler(
            num_blocks=rng.randint(6, 20), max_num_seqs=6, max_num_batched_tokens=rng.randint(4, 40)
        )
        prefix = [rng.randrange(5, 300) for _ in range(16)]
        for t in range(80):
            if rng.random() < 0.4:
                prompt = prefix[: rng.randint(0, 16)]
                prompt += [rng.randrange(5, 300) for _ in range(rng.randint(1, 20))]
                params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
                new = Request(f"{trial}-{t}", prompt, params, tenant_id=rng.choice("abc"))
                with contextlib.suppress(RequestRejected):
                    s.add_request(new)
            chosen.clear()
            output = s.schedule()
            admitted = {item.request.req_id for item in output.scheduled}
            for request, victims in chosen:
                num_taken += bool(victims)
                num_wasted += bool(victims) and request.req_id not in admitted
            sampled = {item.request.req_id: 7 for item in output.scheduled if item.is_sampling}
            s.update_from_output(output, sampled)
            assert not _unqueued(s)
    assert num_taken > 0  # the case it says
    assert num_wasted == 0


def _unqueued(scheduler: Scheduler) -> set[str]:
    """Requests that wait (new or preempted) but are in no queue: they would never run."""
    queued = {r.req_id for r in scheduler.waiting.requests()}
    waiting = {
        r.req_id for r in scheduler.requests.values() if r.status.name in ("WAITING", "PREEMPTED")
    }
    return waiting - queued


def test_a_request_preempted_in_the_step_that_admitted_it_keeps_its_place_in_the_queue():
    """B (tenant T) does not fit, and fair admission preempts V (tenant U) for it. V's chunk
    in this step goes unwritten, so A, admitted earlier in the step on a prefix hit of V's
    blocks, is preempted too, and goes back to T's queue ahead of B. Admitting B then popped
    the head of T's queue, A's entry: A waited in no queue, never to finish, and the engine
    never idled again."""
    s = Scheduler(num_blocks=19, block_size=4, max_num_seqs=8, max_num_batched_tokens=14)

    def add(req_id: str, prompt: list[int], tenant: str) -> None:
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        s.add_request(Request(req_id, prompt, params, tenant_id=tenant))

    def step() -> None:
        output = s.schedule()
        s.update_from_output(
            output, {i.request.req_id: 7 for i in output.scheduled if i.is_sampling}
        )
        assert not _unqueued(s)

    shared = list(range(200, 220))
    add("Z", [1, 2, 3], "T")
    add("W", list(range(300, 340)), "U")
    for _ in range(4):
        step()
    add("V", shared, "U")
    step()
    add("A", shared[:16] + [99], "T")
    add("B", list(range(400, 412)), "T")
    step()
    a = s.requests["A"]
    assert a.status.name == "PREEMPTED"  # the case it says
    # its hits were on blocks nobody wrote: an abort now meters none of them
    assert a.num_prefilled_prompt_tokens == 0
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests()
    assert s.kv_cache.num_free_blocks == 19


@pytest.mark.parametrize("num_tenants", [3, 5])
def test_requests_that_each_need_the_whole_cache_finish_one_after_another(num_tenants):
    """Each request needs all 11 blocks. Memory pressure took the most-served tenant's
    request, the one closest to finishing, and the next tenant's took its place: three
    tenants preempted each other 1,111 times each in 20,000 steps, and none finished (one
    tenant's three, or fcfs, finished at once)."""
    s = scheduler(num_blocks=11, max_num_seqs=8, max_num_batched_tokens=8)
    for t in range(num_tenants):
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        prompt = [100 * t + j for j in range(40)]  # 40 + 4 tokens: 11 blocks of 4
        s.add_request(Request(f"r{t}", prompt, params, tenant_id="abcde"[t]))
    for _ in range(1_000):
        if not s.has_unfinished_requests():
            break
        output = s.schedule()
        s.update_from_output(
            output, {i.request.req_id: 7 for i in output.scheduled if i.is_sampling}
        )
    assert not s.has_unfinished_requests()
    assert s.num_preemptions <= 4 * num_tenants
