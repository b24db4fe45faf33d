"""Which CPUs each process of ``make run`` runs on, so the engine's torch threads never wait
on a core that Daphne or Celery holds, and the web tier never waits on the engine's spinning
OpenMP threads.

The web tier (Daphne × ``WEB_PROCESSES`` and the Celery worker) gets one core per Daphne
process, at most half the machine; the engine gets every other core and one torch thread per
core. With one core, or ``ENGINE_CPUS=off``, nothing is pinned and the engine's OpenMP threads
sleep instead of spinning when idle (``OMP_WAIT_POLICY=PASSIVE``). ``ENGINE_CPUS`` may also
name the engine's cores itself (``2-7`` or ``1,3``); the web tier then gets the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    engine_cpus: frozenset[int] | None  # None: not pinned
    web_cpus: frozenset[int] | None
    engine_threads: int

    @property
    def engine_env(self) -> dict[str, str]:
        threads = str(self.engine_threads)
        env = {"OMP_NUM_THREADS": threads}
        if self.engine_cpus is None:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return env


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``, as ``taskset -c`` and cgroups write CPU lists."""
    cpus: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"not a CPU list: {text!r}")
    return frozenset(cpus)


def plan_placement(available: frozenset[int], web_processes: int, engine_cpus: str) -> Placement:
    """Split ``available`` (this process's CPUs) between the engine and the web tier.
    ``engine_cpus`` is ``ENGINE_CPUS``: ``auto``, ``off`` or a CPU list."""
    setting = engine_cpus.strip().lower()
    if setting == "off" or (setting == "auto" and len(available) < 2):
        return Placement(None, None, max(1, len(available)))
    if setting == "auto":
        ordered = sorted(available)
        num_web = min(max(1, web_processes), len(ordered) // 2)
        web, engine = frozenset(ordered[:num_web]), frozenset(ordered[num_web:])
        return Placement(engine, web, len(engine))
    engine = parse_cpu_list(setting)
    if not engine <= available:
        raise ValueError(
            f"ENGINE_CPUS={engine_cpus} names CPUs outside this process's {sorted(available)}"
        )
    web = available - engine
    return Placement(engine, web or None, len(engine))


def available_cpus() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))
