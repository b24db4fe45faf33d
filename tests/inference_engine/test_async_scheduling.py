"""Async scheduling: the next step is scheduled and launched before the tokens of the step in
flight are back (a decode's input token is read on the device), and the outputs are what the
synchronous engine gives, token for token, through finishes, aborts and preemptions in flight.

On the CPU the device runs each step as it is launched, so these tests check the bookkeeping
(placeholders, device-fed tokens, late finishes), not the overlap itself."""

from __future__ import annotations

import json
import re

import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.model_runner import PendingStep
from inference_engine.protocol import FinishReason, StructuredOutputsParams
from inference_engine.request import Request, RequestStatus
from inference_engine.scheduler import Scheduler

from .test_parity import assert_parity, mixed_batch


def scheduler(num_blocks: int = 64, block_size: int = 4) -> Scheduler:
    return Scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        policy="fcfs",
    )


def test_a_decode_is_scheduled_while_the_token_it_reads_is_in_flight():
    s = scheduler()
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request(request)
    first = s.schedule()
    assert first.scheduled[0].is_sampling
    assert (request.num_computed_tokens, request.num_output_placeholders) == (5, 1)

    second = s.schedule()  # the prompt's first token is still being sampled
    [item] = second.scheduled
    assert (item.start, item.num_new_tokens) == (5, 1)
    assert item.has_device_token and item.is_sampling
    assert request.num_output_placeholders == 2

    assert s.update_from_output(first, {"a": 9}) == [request]
    assert request.output_token_ids == [9] and request.num_output_placeholders == 1
    third = s.schedule()
    assert [(i.start, i.has_device_token) for i in third.scheduled] == [(6, True)]
    s.update_from_output(second, {"a": 10})
    # the token in flight is the request's third and last: nothing more is scheduled for it
    assert s.schedule().is_empty
    s.update_from_output(third, {"a": 11})
    assert request.finish_reason == FinishReason.LENGTH
    assert request.output_token_ids == [9, 10, 11]


def test_a_finished_or_preempted_request_gets_nothing_from_a_step_in_flight():
    s = scheduler(num_blocks=3, block_size=4)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=8, stop_token_ids=[99]))
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert len(first.scheduled) == 2
    # both decodes need a block and one is left: the newest is preempted, its token in flight
    second = s.schedule()
    assert second.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    # the token was sampled from b's whole context: b keeps it, and recomputes it with the
    # rest when readmitted (dropped, its grammar and its seeded generator had moved on)
    updated = s.update_from_output(first, {"a": 20, "b": 21})
    assert updated == [a, b] and b.output_token_ids == [21]
    assert b.status == RequestStatus.PREEMPTED

    # a request that finished on the step before gets nothing from the one after
    s.update_from_output(second, {"a": 22})
    third = s.schedule()
    assert {item.request.req_id for item in third.scheduled} >= {"a"}
    a.sampling_params.stop_token_ids = [23]
    s.update_from_output(third, {"a": 23, "b": 24})
    assert a.finish_reason == FinishReason.STOP and a.output_token_ids == [20, 22, 23]


def async_llm(model_dir: str, **options) -> LLM:
    llm = LLM(model_dir, dtype="float32", async_scheduling="on", **options)
    assert llm.core.async_scheduling
    return llm


def sync_llm(model_dir: str, **options) -> LLM:
    """The reference: synchronous even on a GPU, where "auto" would overlap steps too."""
    llm = LLM(model_dir, dtype="float32", async_scheduling="off", **options)
    assert not llm.core.async_scheduling
    return llm


def assert_same_logprobs(mine: list | None, theirs: list | None, llm: LLM) -> None:
    """Equal on the CPU; on a GPU the steps' batches differ between the two engines, and
    cuBLAS may pick another kernel for another batch size, so within 1e-4."""
    if not llm.core.on_accelerator or mine is None or theirs is None:
        assert mine == theirs
        return
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.top_token_ids == b.top_token_ids
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def record_launches(llm: LLM) -> list[tuple[str, int, int]]:
    """("launch" | "result", step number, device-fed tokens) in the order they happen."""
    events: list[tuple[str, int, int]] = []
    runner, launch = llm.core.runner, llm.core.runner.launch

    def spy(scheduled, block_tables):
        number = sum(kind == "launch" for kind, _, _ in events)
        fed = sum(item.has_device_token for item in scheduled)
        events.append(("launch", number, fed))
        pending = launch(scheduled, block_tables)
        result = pending.result

        def recorded_result():
            events.append(("result", number, fed))
            return result()

        pending.result = recorded_result
        return pending

    runner.launch = spy
    return events


def test_steps_are_launched_before_the_one_in_flight_is_read_back(model_dirs, hf_models):
    llm = async_llm(model_dirs["llama"], max_num_batched_tokens=24)
    events = record_launches(llm)
    prompts, max_tokens = mixed_batch(seed=2)
    assert_parity(llm, hf_models("llama"), prompts, max_tokens)
    order = [(kind, number) for kind, number, _ in events]
    # step n + 1 is launched before step n's tokens are read: the host never waits idle
    for number in range(sum(kind == "launch" for kind, _ in order) - 1):
        assert order.index(("launch", number + 1)) < order.index(("result", number))
    assert sum(fed for kind, _, fed in events if kind == "launch") > 50  # decodes fed on device
    assert not llm.core.has_unfinished_requests()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_parity_with_preemption_in_flight(family, model_dirs, hf_models):
    llm = async_llm(model_dirs[family], block_size=4, num_kv_blocks=40)
    prompts, _ = mixed_batch(seed=4, num_prompts=5)
    assert_parity(llm, hf_models(family), prompts, [40] * len(prompts))
    assert llm.core.scheduler.num_preemptions > 0


def test_triton_decode_graph_inputs_take_the_tokens_in_flight(model_dirs, hf_models):
    """The GPU's path: decode steps through the graphs' static buffers (replayed eagerly
    here) whose input ids are completed on the device from the step in flight."""
    from .test_gpu_step import DEVICE, needs_triton

    if needs_triton.args[0]:
        pytest.skip(needs_triton.kwargs["reason"])
    llm = LLM(
        model_dirs["qwen2"],
        dtype="float32",
        device=DEVICE,
        attention_backend="triton",
        max_num_seqs=6,
        enforce_eager=True,
        async_scheduling="on",
    )
    runner = llm.core.runner
    runner.graphs = runner.decode_graphs(capture=DEVICE == "cuda")
    runner.graphs.capture()
    fills = []
    run = runner.graphs.run

    def spy(batch, fill=None):
        fills.append(fill is not None)
        return run(batch, fill)

    runner.graphs.run = spy
    prompts, max_tokens = mixed_batch(seed=7, num_prompts=5)
    assert_parity(llm, hf_models("qwen2"), prompts, max_tokens)
    assert sum(fills) > 10


def sampling_mix(stop_token: int) -> list[SamplingParams]:
    """Seeded random rows, logprobs, a stop token met mid-stream, min_tokens, penalties and a
    grammar."""
    return [
        SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.7, seed=5, min_tokens=6, max_tokens=9, top_k=20),
        SamplingParams(temperature=0, repetition_penalty=1.4, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5, max_tokens=14),
        SamplingParams(
            temperature=0.6,
            seed=8,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
        ),
    ]


def test_sampling_options_give_what_the_synchronous_engine_gives(eos_llama_dir):
    sync = sync_llm(eos_llama_dir, max_num_batched_tokens=32)
    prompts, _ = mixed_batch(seed=9)
    prompts.append(prompts[1])
    # a stop token the third request meets at its fifth token
    probe = sync.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=8))[0]
    stop_token = probe.token_ids[4]
    want = sync.generate(prompts, sampling_mix(stop_token))
    llm = async_llm(eos_llama_dir, max_num_batched_tokens=32)
    events = record_launches(llm)
    got = llm.generate(prompts, sampling_mix(stop_token))
    for mine, theirs in zip(got, want, strict=True):
        assert (mine.token_ids, mine.finish_reason) == (theirs.token_ids, theirs.finish_reason)
        assert_same_logprobs(mine.logprobs, theirs.logprobs, llm)
    assert got[2].finish_reason == "stop" and len(got[2].token_ids) <= 5
    assert len(got[3].token_ids) >= 6
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", got[6].text)
    assert any(fed for _, _, fed in events)


def test_penalised_requests_do_not_wait_for_their_tokens(model_dirs):
    """Penalties count the token in flight on the device: requests with them are scheduled
    and launched while their last token is still being sampled, and draw what the synchronous
    engine draws."""
    sync = sync_llm(model_dirs["llama"])
    prompts, _ = mixed_batch(seed=5, num_prompts=4)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.6, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=1.5, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.9, seed=4, frequency_penalty=0.8, max_tokens=22, ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    ]
    want = sync.generate(prompts, params)
    llm = async_llm(model_dirs["llama"])
    events = record_launches(llm)
    got = llm.generate(prompts, params)
    assert [output.token_ids for output in got] == [output.token_ids for output in want]
    order = [(kind, number) for kind, number, _ in events]
    for number in range(sum(kind == "launch" for kind, _ in order) - 1):
        assert order.index(("launch", number + 1)) < order.index(("result", number))
    assert sum(fed for kind, _, fed in events if kind == "launch") > 50
    assert len(llm.core.runner.sampler.token_arrays) == 0  # released with their requests


def test_guided_requests_sample_once_their_token_in_flight_is_back(eos_llama_dir):
    """A grammar sees a request's last token before its next one is drawn: a step with a
    guided request whose token is in flight launches its forward at once and its sampling once
    the step before is read back (a request finished by that step gets a bare greedy row
    and nothing from it). The outputs are the synchronous engine's, token for token."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    params = [
        # a budget this short makes the sampler favour the closing tokens near its end
        SamplingParams(
            temperature=0.8,
            seed=21,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        ),
        SamplingParams(
            temperature=0.6,
            seed=8,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
        ),
        SamplingParams(
            temperature=0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.4),
    ]
    prompts, _ = mixed_batch(seed=6, num_prompts=len(params))
    want = sync_llm(eos_llama_dir).generate(prompts, params)
    llm = async_llm(eos_llama_dir)
    events = record_launches(llm)
    runner, sample_deferred = llm.core.runner, llm.core.runner._sample_deferred
    deferred = []

    def spy(logits, sampling):
        deferred.append([r.req_id for r in sampling])
        return sample_deferred(logits, sampling)

    runner._sample_deferred = spy
    got = llm.generate(prompts, params)
    for mine, theirs in zip(got, want, strict=True):
        assert (mine.token_ids, mine.finish_reason) == (theirs.token_ids, theirs.finish_reason)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", got[1].text)
    assert got[2].text in ("yes", "no")
    order = [(kind, number) for kind, number, _ in events]
    for number in range(sum(kind == "launch" for kind, _ in order) - 1):
        assert order.index(("launch", number + 1)) < order.index(("result", number))
    assert len(deferred) > 5
    assert not llm.core.has_unfinished_requests()
    # a finished request's seeded generator is gone, also after a deferred sampling drew its row
    assert runner.sampler.generators == {}


def test_an_abort_while_a_step_is_in_flight_is_metered_as_delivered(llama_dir):
    llm = async_llm(llama_dir)
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts, _ = mixed_batch(seed=5, num_prompts=3)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    delivered: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    finals = {}
    steps = 0
    while core.has_unfinished_requests():
        for output in core.step():
            assert output.req_id not in finals, "nothing comes after a request's last output"
            delivered[output.req_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finals[output.req_id] = output
        steps += 1
        if steps == 6:
            assert core._in_flight is not None
            core.abort_requests(["r1"])
    aborted = finals["r1"]
    assert aborted.finish_reason == FinishReason.ABORT
    assert aborted.num_output_tokens == len(delivered["r1"]) < 40
    expected = sync_llm(llama_dir).generate([prompts[0], prompts[2]], [params, params])
    assert delivered["r0"] == expected[0].token_ids and delivered["r2"] == expected[1].token_ids
    assert core.scheduler.kv_cache.usage == 0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(llama_dir, monkeypatch):
    llm = async_llm(llama_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts, _ = mixed_batch(seed=6, num_prompts=2)
    calls = {"n": 0}
    result = PendingStep.result

    def failing_third(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return result(self)

    monkeypatch.setattr(PendingStep, "result", failing_third)
    outputs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outputs] == ["error", "error"]
    assert "device lost" in outputs[0].error
    monkeypatch.setattr(PendingStep, "result", result)
    again = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in again] == [8, 8]
    assert llm.core.scheduler.kv_cache.usage == 0


def test_a_request_preempted_with_its_token_in_flight_samples_as_it_would_alone(llama_dir):
    """Preempted while the step in flight samples its token, a request lost that token but
    not its side effects: its seeded generator had drawn and its grammar had accepted it. Its
    output then depended on the batch, and a guided one broke its grammar."""
    regex = "(the|quick|brown|fox|dog|lazy)( (the|quick|brown|fox|dog|lazy)){5,12}\\."
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=30, ignore_eos=True)
    guided = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    crowd = [[20 + i] * (8 + 3 * i) for i in range(4)]
    crowd_params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    options = dict(block_size=4, scheduling_policy="fcfs", enable_prefix_caching=False)
    alone = async_llm(llama_dir, **options).generate([[5, 6, 7], [5, 6, 7]], [seeded, guided])

    llm = async_llm(llama_dir, num_kv_blocks=26, **options)
    outputs = llm.generate(crowd + [[5, 6, 7], [5, 6, 7]], crowd_params + [seeded, guided])
    assert llm.core.scheduler.num_preemptions > 0  # the case it says
    assert re.fullmatch(regex, outputs[-1].text)
    assert [o.token_ids for o in outputs[-2:]] == [o.token_ids for o in alone]


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_a_failed_step_leaves_nothing_in_the_prefix_cache_it_did_not_write(
    llama_dir, monkeypatch, async_scheduling
):
    """The blocks a step fills are registered in the prefix cache as they are allocated. A
    step that failed before its forward ran wrote none: the same prompts sent again hit them
    and read KV nobody computed (and answered other tokens than an engine that never failed)."""
    llm = LLM(llama_dir, dtype="float32", async_scheduling=async_scheduling, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[(i * 13 + k) % 370 + 7 for i in range(40)] for k in range(2)]

    def failing(scheduled, block_tables):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.core.runner, "launch", failing)
    assert [o.finish_reason for o in llm.generate(prompts, params)] == ["error", "error"]
    monkeypatch.undo()
    again = llm.generate(prompts, params)
    expected = sync_llm(llama_dir, block_size=4).generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    assert llm.core.scheduler.kv_cache.usage == 0


def test_a_chunk_computed_on_top_of_a_failed_step_is_no_prefix_cache_hit(llama_dir):
    """A prompt's first chunk is in a step that fails (having written none of its KV), its
    second was launched on top of it before the failure was seen: the second's blocks stayed
    registered, KV computed over context nobody wrote. Once the same prompt wrote its first
    chunk again, a third request hit them and answered other tokens."""
    options = dict(block_size=4, max_num_batched_tokens=16, scheduling_policy="fcfs")
    llm = LLM(llama_dir, dtype="float32", async_scheduling="on", **options)
    runner = llm.core.runner
    launch, launches = runner.launch, []

    class Failed(PendingStep):
        def result(self):
            raise RuntimeError("device lost")

    def failing_first(scheduled, block_tables):
        launches.append(len(scheduled))
        if len(launches) == 1:  # its forward never ran: none of its KV is written
            return Failed([], None)
        return launch(scheduled, block_tables)

    runner.launch = failing_first
    prompt = [(i * 13) % 370 + 7 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert llm.generate([prompt], params)[0].finish_reason == "error"
    assert len(launches) >= 2  # the second chunk went out before the failure was read
    runner.launch = launch
    expected = sync_llm(llama_dir, **options).generate([prompt], params)[0].token_ids
    assert llm.generate([prompt], params)[0].token_ids == expected
    third = llm.generate([prompt], params)[0]
    assert third.token_ids == expected and third.num_cached_tokens == 36


def test_async_scheduling_is_on_by_default_only_on_an_accelerator(llama_dir):
    assert not LLM(llama_dir, dtype="float32", device="cpu").core.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(llama_dir, async_scheduling="sometimes")
