"""Mid-step admission (``EngineCore.admit_mid_step``): on the CPU, a request of a tenant with
nothing running gets its first chunk between two layers of the step under way, on the real
runner, and nobody's tokens change; the server takes only adds between layers."""

from __future__ import annotations

import pytest

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.core import EngineCore
from inference_engine.protocol import FinishReason, SamplingParams
from inference_engine.queues import QueuedAdd
from inference_engine.server import EngineServer

FLOOD = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make_core(model_dir: str) -> EngineCore:
    # the CPU's feature (a GPU's host runs ahead of its kernels): on the CPU on a GPU machine too
    return EngineCore(
        EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128, device="cpu")
    )


def flood_prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j) % 300 for j in range(20 + i)]


def newcomer_prompt(i: int) -> list[int]:
    return [40 + i, 41, 42, 43, 44, 45, 46, 47, 48]


def run_between_steps(core: EngineCore, arrivals: dict[int, list[str]]) -> dict[str, list[int]]:
    """Tenant a's flood of 6 requests; before step k the newcomers ``arrivals[k]`` (a tenant
    each) arrive. Returns each request's tokens."""
    for i in range(6):
        core.add_request(f"a{i}", flood_prompt(i), FLOOD, tenant_id="a")
    tokens: dict[str, list[int]] = {}
    step = 0
    while core.has_unfinished_requests() or step <= max(arrivals):
        for name in arrivals.get(step, []):
            core.add_request(name, newcomer_prompt(len(name)), SHORT, tenant_id=name)
        for output in core.step():
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
        step += 1
    return tokens


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_newcomer_runs_inside_the_step_under_way_and_changes_no_token(model_dirs, family):
    arrivals = {2: ["b"], 5: ["c"], 9: ["d"]}
    expected = run_between_steps(make_core(model_dirs[family]), arrivals)
    core = make_core(model_dirs[family])
    delivered: dict[str, list[int]] = {}
    outputs_inside: list[tuple[int, str, list[int]]] = []
    step = 0
    for i in range(6):
        core.add_request(f"a{i}", flood_prompt(i), FLOOD, tenant_id="a")
    arriving: list[str] = []

    def take_inputs() -> bool:
        for name in arriving:
            core.add_request(name, newcomer_prompt(len(name)), SHORT, tenant_id=name)
        added, arriving[:] = bool(arriving), []
        return added

    def deliver(outputs) -> None:
        for output in outputs:
            outputs_inside.append((step, output.req_id, output.new_token_ids))
            delivered.setdefault(output.req_id, []).extend(output.new_token_ids)

    assert core.admit_mid_step(take_inputs, deliver)
    while core.has_unfinished_requests() or step <= max(arrivals):
        arriving.extend(arrivals.get(step, []))
        for output in core.step():
            delivered.setdefault(output.req_id, []).extend(output.new_token_ids)
        step += 1
    assert delivered == expected
    # each newcomer's first token came out of the step it arrived in, before that step ended
    assert [(s, req_id) for s, req_id, _ in outputs_inside] == [(2, "b"), (5, "c"), (9, "d")]
    assert all(len(ids) == 1 for _, _, ids in outputs_inside)


def test_one_newcomers_step_inside_a_step(llama_dir):
    core = make_core(llama_dir)
    for i in range(4):
        core.add_request(f"a{i}", flood_prompt(i), FLOOD, tenant_id="a")
    core.step()
    names = iter(f"t{i}" for i in range(100))
    inside: list[list[str]] = []

    def take_inputs() -> bool:  # a new tenant's request at every layer boundary
        name = next(names)
        core.add_request(name, newcomer_prompt(1), SHORT, tenant_id=name)
        return True

    core.admit_mid_step(take_inputs, lambda outputs: inside.append([o.req_id for o in outputs]))
    core.step()
    # after one, the step is not paused again (the server's queue keeps what arrives)
    assert inside == [["t0"]] and next(names) == "t1"
    core.step()
    assert inside == [["t0"], ["t2"]]


def loaded_server(model_dir: str, **server_options) -> EngineServer:
    """A server with its model installed and its outputs collected in ``server.delivered``
    (no sockets, no threads: the test drives its busy loop's calls)."""
    server = EngineServer(
        EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64, device="cpu"),
        ServerConfig(endpoint="inproc://unused", **server_options),
    )
    server._load()
    server.delivered = []
    server._hand_off = server.delivered.append
    return server


def queued_add(req_id: str, tenant: str, prompt: list[int]) -> QueuedAdd:
    return QueuedAdd(
        req_id=req_id,
        prompt_token_ids=prompt,
        params=SHORT,
        priority=0,
        cache_salt=None,
        arrival_time=0.0,
        tenant_id=tenant,
        tenant_weight=1.0,
    )


def test_a_newcomer_arriving_during_a_step_streams_its_first_token_before_it_ends(llama_dir):
    server = loaded_server(llama_dir)
    core = server.core
    for i in range(4):
        core.add_request(f"a{i}", flood_prompt(i), FLOOD, tenant_id="a")
    core.step()
    # queued on the server's input queue as the I/O thread does, while nothing runs a step
    server.inputs.put_add(queued_add("c/1", "b", newcomer_prompt(1)))
    outputs = core.step()
    [inside] = server.delivered
    assert [(o.req_id, len(o.new_token_ids)) for o in inside.outputs] == [("c/1", 1)]
    assert sorted(o.req_id for o in outputs) == ["a0", "a1", "a2", "a3"]
    assert server.inputs.empty() and server.snapshot.num_running == 5
    [admissions] = [
        m for m in server.metrics.registry.collect() if m.name.endswith("mid_step_admissions")
    ]
    assert [s.value for s in admissions.samples if s.name.endswith("_total")] == [1.0]


def test_the_server_takes_only_adds_between_layers(llama_dir):
    server = loaded_server(llama_dir)
    core = server.core
    assert core._take_inputs is not None
    server.inputs.put_add(queued_add("c/1", "b", newcomer_prompt(1)))
    server.inputs.put_abort(["c/1"])
    assert server._take_mid_step_inputs() is True
    assert "c/1" in core.scheduler.requests  # added; its abort waits for the step's end
    assert server.snapshot.waiting_by_tenant == {"b": 1}
    assert server._take_mid_step_inputs() is False
    server._apply_inputs(block=False)
    assert "c/1" not in core.scheduler.requests
    [aborted] = core.step()
    assert aborted.req_id == "c/1" and aborted.finish_reason == FinishReason.ABORT


def test_mid_step_admission_can_be_turned_off(llama_dir):
    server = loaded_server(llama_dir, mid_step_admission=False)
    core = server.core
    core.add_request("a0", flood_prompt(0), FLOOD, tenant_id="a")
    core.step()
    server.inputs.put_add(queued_add("c/1", "b", newcomer_prompt(1)))
    core.step()
    assert not server.delivered and "c/1" not in core.scheduler.requests


def test_not_under_fcfs(llama_dir):
    core = EngineCore(
        EngineConfig(
            model=llama_dir,
            dtype="float32",
            num_kv_blocks=64,
            scheduling_policy="fcfs",
            device="cpu",  # on a GPU it is off whatever the policy
        )
    )
    assert not core.admit_mid_step(lambda: False, lambda outputs: None)
