"""Runs the platform's processes side by side, restarts the ones that die, and stops them
together.

`make run` starts one supervisor; it starts each child in its own session (so a Ctrl-C reaches
only the supervisor, which then stops the children in order), forwards SIGINT, SIGTERM, SIGHUP
(the terminal closed) and SIGQUIT as a graceful SIGTERM to every child, in stages (the engine
first: it finishes or fails its running requests, and the web processes pass that on to their
streams before they stop), and kills what is still alive after a grace period. A child that
exits on its own is restarted, as systemd's ``Restart=always`` or supervisord would: after 1 s,
then 2, 4, ... up to 30 s while it keeps dying, and from 1 s again once it has stayed up for a
minute. What a dead child leaves behind in its process group (a Celery worker's beat and pool
processes outlive a SIGKILL of the worker) gets SIGTERM at once and SIGKILL when the child is
restarted, as systemd's ``KillMode=control-group`` does, so a restart never runs beside a copy
of the old one. Only a stop signal stops the platform; a child that cannot be started at all (a
fork refused) is tried again on the same schedule. Each child's restarts and last exit code are
written to ``status_file`` (JSON) for the web tier's metrics and console, and once the platform
has stopped, that none runs. On Linux each child also gets PR_SET_PDEATHSIG, so even a
supervisor killed with SIGKILL leaves no child behind: with a signal that stops it without
waiting (``ProcessSpec.parent_death_signal``: a Celery worker's SIGTERM waits for its running
task, a batch of hours, so its children get SIGQUIT, Celery's cold shutdown).
"""

import contextlib
import ctypes
import json
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
# the signals that stop the platform: Ctrl-C, a service manager's stop, the terminal closing
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
POLL_SECONDS = 0.2
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
STABLE_SECONDS = 60.0  # up this long, a child's next crash backs off from the start again
# after a stop stage, what the next stage's children need to pass its end on (a web process
# writing the error events of streams whose engine just stopped)
STAGE_SETTLE_SECONDS = 1.0


def restart_delay(consecutive_failures: int) -> float:
    """Seconds before the restart that follows ``consecutive_failures`` (1, 2, ...) crashes
    in a row: 1, 2, 4, ... capped at 30."""
    return min(FIRST_BACKOFF_SECONDS * 2 ** (consecutive_failures - 1), MAX_BACKOFF_SECONDS)


@dataclass
class ChildState:
    started_at: float = 0.0
    restarts: int = 0
    consecutive_failures: int = 0
    last_exit_code: int | None = None
    restart_at: float | None = None  # when the next start is due; None while it runs


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pass_fds: tuple[int, ...] = ()  # file descriptors the child inherits (a listening socket)
    cpus: frozenset[int] | None = None  # pinned to these CPUs (config.placement), else anywhere
    # children stop in stages, lowest first: the engine before the web processes, so that the
    # streams open on them end with the engine's error event instead of a dropped connection
    stop_stage: int = 1
    # what the child gets should the supervisor die without stopping it (SIGKILL): one that
    # stops it without waiting for long work to finish, as nothing escalates after it
    parent_death_signal: int = signal.SIGTERM


def python_path_env(base_dir: Path) -> dict[str, str]:
    """PYTHONPATH with the web tier's source root and the project root first."""
    entries = [str(base_dir / "platform"), str(base_dir)]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return {"PYTHONPATH": os.pathsep.join(entries)}


def _die_with_parent(sig: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)


def _signal_group(pgid: int, sig: int) -> None:
    """Signal every process left in a child's group (each child leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _child_setup(cpus: frozenset[int] | None, parent_death_signal: int):
    def setup() -> None:
        _die_with_parent(parent_death_signal)
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    return setup


class Supervisor:
    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        grace_seconds: float = 15.0,
        status_file: Path | None = None,
    ) -> None:
        self.specs = list(specs)
        self.grace_seconds = grace_seconds
        self.status_file = status_file
        self.children: dict[str, subprocess.Popen] = {}
        self.states = {spec.name: ChildState() for spec in self.specs}
        self._stop_signal: int | None = None
        self._is_stopped = False  # all stopped: the status file says none runs

    def run(self) -> int:
        """Start every child, wait for a signal or a child's exit, stop all; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            for spec in self.specs:
                self._start_or_retry(spec)
            exit_code = self._wait()
        finally:
            self._stop_all()
            self._is_stopped = True
            self._write_status()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return exit_code

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum

    def _start(self, spec: ProcessSpec) -> None:
        pinned = f" on CPUs {sorted(spec.cpus)}" if spec.cpus is not None else ""
        logger.info("starting %s%s: %s", spec.name, pinned, " ".join(spec.argv))
        state = self.states.setdefault(spec.name, ChildState())
        state.started_at, state.restart_at = time.monotonic(), None
        if spec.name in self.children:
            _signal_group(self.children[spec.name].pid, signal.SIGKILL)
        self.children[spec.name] = subprocess.Popen(
            spec.argv,
            env={**os.environ, **spec.env},
            start_new_session=True,
            preexec_fn=_child_setup(spec.cpus, spec.parent_death_signal),
            pass_fds=spec.pass_fds,
        )
        self._write_status()

    def _wait(self) -> int:
        while self._stop_signal is None:
            now = time.monotonic()
            for spec in self.specs:
                state = self.states[spec.name]
                if state.restart_at is not None:
                    if now >= state.restart_at:
                        self._start_or_retry(spec)
                    continue
                code = self.children[spec.name].poll()
                if code is not None:
                    self._schedule_restart(spec.name, code, now)
            time.sleep(POLL_SECONDS)
        logger.info("received %s; stopping", signal.Signals(self._stop_signal).name)
        return 0

    def _start_or_retry(self, spec: ProcessSpec) -> None:
        """Start the child; if it cannot be started (a fork refused for memory or for the
        number of processes, as right after the kernel killed one; the interpreter missing
        while the virtual environment is rebuilt), try again later, as after a crash: that
        failure stopped the whole platform."""
        try:
            self._start(spec)
        except (OSError, subprocess.SubprocessError) as exc:
            state = self.states[spec.name]
            state.consecutive_failures += 1
            delay = restart_delay(state.consecutive_failures)
            state.restart_at = time.monotonic() + delay
            logger.error("could not start %s (%s); trying again in %.0f s", spec.name, exc, delay)
            self._write_status()

    def _schedule_restart(self, name: str, code: int, now: float) -> None:
        state = self.states[name]
        if now - state.started_at >= STABLE_SECONDS:
            state.consecutive_failures = 0
        state.consecutive_failures += 1
        state.restarts += 1
        state.last_exit_code = code
        delay = restart_delay(state.consecutive_failures)
        state.restart_at = now + delay
        _signal_group(self.children[name].pid, signal.SIGTERM)
        logger.error(
            "%s exited with code %s; restarting it in %.0f s (restart %d)",
            name,
            code,
            delay,
            state.restarts,
        )
        self._write_status()

    def _write_status(self) -> None:
        if self.status_file is None:
            return
        status = {
            name: {
                "running": state.restart_at is None and not self._is_stopped,
                "restarts": state.restarts,
                "last_exit_code": state.last_exit_code,
                "pid": self.children[name].pid if name in self.children else None,
            }
            for name, state in self.states.items()
        }
        temporary = self.status_file.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(status))
            temporary.replace(self.status_file)
        except OSError:
            logger.exception("could not write %s", self.status_file)

    def _stop_all(self) -> None:
        """Stop the children stage by stage (``ProcessSpec.stop_stage``, lowest first): SIGTERM,
        the grace period, then SIGKILL for what is left; then every child's group is swept."""
        stages = sorted({spec.stop_stage for spec in self.specs})
        for stage in stages:
            names = [spec.name for spec in self.specs if spec.stop_stage == stage]
            alive = [
                self.children[name]
                for name in names
                if name in self.children and self.children[name].poll() is None
            ]
            self._stop(alive)
            if alive and stage != stages[-1]:
                time.sleep(STAGE_SETTLE_SECONDS)
        for child in self.children.values():
            _signal_group(child.pid, signal.SIGKILL)

    def _stop(self, alive: list[subprocess.Popen]) -> None:
        for child in alive:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for child in alive:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
