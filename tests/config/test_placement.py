"""How `make run` splits the machine's CPUs between the engine and the web tier."""

from __future__ import annotations

import os
import sys
import time

import pytest

from config.placement import parse_cpu_list, plan_placement
from config.supervisor import ProcessSpec, Supervisor


def cpus(*ids: int) -> frozenset[int]:
    return frozenset(ids)


def test_two_cores_give_the_engine_one_core_and_one_thread_and_the_web_tier_the_other():
    placement = plan_placement(cpus(0, 1), web_processes=1, engine_cpus="auto")
    assert placement.web_cpus == cpus(0)
    assert placement.engine_cpus == cpus(1)
    assert placement.engine_threads == 1
    assert placement.engine_env == {"OMP_NUM_THREADS": "1"}


def test_the_web_tier_gets_a_core_per_daphne_process_up_to_half_the_machine():
    sixteen = frozenset(range(16))
    placement = plan_placement(sixteen, web_processes=4, engine_cpus="auto")
    assert placement.web_cpus == frozenset(range(4))
    assert placement.engine_cpus == frozenset(range(4, 16)) and placement.engine_threads == 12
    placement = plan_placement(cpus(0, 1, 2, 3), web_processes=8, engine_cpus="auto")
    assert placement.web_cpus == cpus(0, 1) and placement.engine_threads == 2


def test_one_core_or_off_pins_nothing_and_stops_openmp_spinning():
    for placement in (
        plan_placement(cpus(3), web_processes=1, engine_cpus="auto"),
        plan_placement(cpus(0, 1, 2, 3), web_processes=1, engine_cpus="off"),
    ):
        assert placement.engine_cpus is None and placement.web_cpus is None
        assert placement.engine_env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_an_explicit_list_is_the_engines_and_the_rest_the_web_tiers():
    placement = plan_placement(frozenset(range(8)), web_processes=1, engine_cpus="2-5,7")
    assert placement.engine_cpus == cpus(2, 3, 4, 5, 7) and placement.engine_threads == 5
    assert placement.web_cpus == cpus(0, 1, 6)
    with pytest.raises(ValueError, match="outside"):
        plan_placement(cpus(0, 1), web_processes=1, engine_cpus="1-3")


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,x"])
def test_bad_cpu_lists_are_refused(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_the_supervisor_starts_a_child_on_its_cpus():
    cpu = min(os.sched_getaffinity(0))
    spec = ProcessSpec(
        "pinned", [sys.executable, "-c", "import time; time.sleep(30)"], cpus=frozenset({cpu})
    )
    supervisor = Supervisor([spec])
    supervisor._start(spec)
    child = supervisor.children["pinned"]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.sched_getaffinity(child.pid) == {cpu}:
                break
            time.sleep(0.05)
        assert os.sched_getaffinity(child.pid) == {cpu}
    finally:
        supervisor._stop_all()
