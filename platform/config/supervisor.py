"""Runs the platform's processes side by side and stops them together.

`make run` starts one supervisor; it starts each child in its own session (so a Ctrl-C
reaches only the supervisor, which then stops the children in order), forwards SIGINT and
SIGTERM as a graceful SIGTERM to every child, kills what is still alive after a grace
period, and stops everything when any child dies. On Linux each child also gets
PR_SET_PDEATHSIG, so even a supervisor killed with SIGKILL leaves no orphan behind.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.2


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pass_fds: tuple[int, ...] = ()  # file descriptors the child inherits (a listening socket)
    cpus: frozenset[int] | None = None  # pinned to these CPUs (config.placement), else anywhere


def python_path_env(base_dir: Path) -> dict[str, str]:
    """PYTHONPATH with the web tier's source root and the project root first."""
    entries = [str(base_dir / "platform"), str(base_dir)]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return {"PYTHONPATH": os.pathsep.join(entries)}


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cpus: frozenset[int] | None):
    def setup() -> None:
        _die_with_parent()
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    return setup


class Supervisor:
    def __init__(self, specs: Sequence[ProcessSpec], grace_seconds: float = 15.0) -> None:
        self.specs = list(specs)
        self.grace_seconds = grace_seconds
        self.children: dict[str, subprocess.Popen] = {}
        self._stop_signal: int | None = None

    def run(self) -> int:
        """Start every child, wait for a signal or a child's exit, stop all; the exit code."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for spec in self.specs:
                self._start(spec)
            exit_code = self._wait()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return exit_code

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def _start(self, spec: ProcessSpec) -> None:
        pinned = f" on CPUs {sorted(spec.cpus)}" if spec.cpus is not None else ""
        logger.info("starting %s%s: %s", spec.name, pinned, " ".join(spec.argv))
        self.children[spec.name] = subprocess.Popen(
            spec.argv,
            env={**os.environ, **spec.env},
            start_new_session=True,
            preexec_fn=_child_setup(spec.cpus),
            pass_fds=spec.pass_fds,
        )

    def _wait(self) -> int:
        while self._stop_signal is None:
            for name, child in self.children.items():
                code = child.poll()
                if code is not None:
                    logger.error("%s exited with code %s; stopping the platform", name, code)
                    return code or 1
            time.sleep(POLL_SECONDS)
        logger.info("received %s; stopping", signal.Signals(self._stop_signal).name)
        return 0

    def _stop_all(self) -> None:
        alive = [child for child in self.children.values() if child.poll() is None]
        for child in alive:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for child in alive:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
