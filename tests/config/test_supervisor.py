import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from config.supervisor import ProcessSpec, Supervisor, restart_delay

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


_RUNNING: list[tuple[Supervisor, threading.Thread]] = []


@pytest.fixture(autouse=True)
def _stop_supervisors_left_running():
    """A test that fails between starting a supervisor and stopping it left the supervisor's
    thread restarting its child for good, so pytest never exited (CI ran out of its time)."""
    yield
    while _RUNNING:
        supervisor, thread = _RUNNING.pop()
        supervisor._on_signal(signal.SIGTERM, None)
        thread.join(timeout=30)


def _run_in_thread(supervisor: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    # signal handlers can only be installed from the main thread; patch them out here and
    # deliver the stop request directly, as the handler would.
    supervisor_run = supervisor.run

    def target() -> None:
        original = signal.signal
        signal.signal = lambda *args: None  # type: ignore[assignment]
        try:
            result.append(supervisor_run())
        finally:
            signal.signal = original

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    _RUNNING.append((supervisor, thread))
    return thread, result


def _wait_started(supervisor: Supervisor, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(supervisor.children) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(supervisor.children) == count


def test_a_stop_signal_stops_every_child():
    supervisor = Supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER)])
    thread, result = _run_in_thread(supervisor)
    _wait_started(supervisor, 2)
    pids = [child.pid for child in supervisor.children.values()]

    supervisor._on_signal(signal.SIGTERM, None)
    thread.join(timeout=20)

    assert result == [0]
    assert not any(_alive(pid) for pid in pids)


def test_a_dying_child_is_restarted_and_the_platform_keeps_running(tmp_path):
    crash = [sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"]
    status_file = tmp_path / "supervisor.json"
    supervisor = Supervisor(
        [ProcessSpec("crash", crash), ProcessSpec("b", SLEEPER)], status_file=status_file
    )
    thread, result = _run_in_thread(supervisor)
    _wait_started(supervisor, 2)
    first, survivor = supervisor.children["crash"].pid, supervisor.children["b"].pid

    deadline = time.monotonic() + 20
    while supervisor.children["crash"].pid == first and time.monotonic() < deadline:
        time.sleep(0.05)
    restarted = supervisor.children["crash"].pid
    status = json.loads(status_file.read_text())

    assert restarted != first and thread.is_alive() and _alive(survivor)
    assert status["crash"]["restarts"] >= 1 and status["crash"]["last_exit_code"] == 3
    assert status["b"] == {"running": True, "restarts": 0, "last_exit_code": None, "pid": survivor}
    supervisor._on_signal(signal.SIGTERM, None)
    thread.join(timeout=20)
    assert result == [0] and not _alive(survivor)


def test_a_crash_loop_backs_off_instead_of_spinning():
    crash = [sys.executable, "-c", "import sys; sys.exit(1)"]
    supervisor = Supervisor([ProcessSpec("crash", crash)])
    thread, _ = _run_in_thread(supervisor)
    _wait_started(supervisor, 1)
    time.sleep(4)
    restarts = supervisor.states["crash"].restarts
    supervisor._on_signal(signal.SIGTERM, None)
    thread.join(timeout=20)
    # 1 s, then 2 s, then 4 s between starts: at most 3 restarts in 4 s (20 without backoff)
    assert 1 <= restarts <= 3


def test_restart_delays_double_up_to_thirty_seconds():
    assert [restart_delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period():
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    ]
    supervisor = Supervisor([ProcessSpec("stubborn", stubborn)], grace_seconds=0.5)
    thread, result = _run_in_thread(supervisor)
    _wait_started(supervisor, 1)
    time.sleep(0.3)  # let the child install its handler
    supervisor._on_signal(signal.SIGINT, None)
    thread.join(timeout=20)

    assert result == [0]
    assert supervisor.children["stubborn"].returncode == -signal.SIGKILL


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_killed_supervisor(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = f"""
import sys
from config.supervisor import ProcessSpec, Supervisor, restart_delay
code = "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
child = [sys.executable, "-c", code]
Supervisor([ProcessSpec("child", child)]).run()
"""
    supervisor = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())

    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def _supervisor_process(spec: str) -> subprocess.Popen:
    """A supervisor of its own (its signal handlers installed) running ``spec``, Python for
    one ProcessSpec."""
    script = f"""
import signal, sys
from config.supervisor import ProcessSpec, Supervisor
sys.exit(Supervisor([{spec}], grace_seconds=5).run())
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", script], env=env)


def _read_pid(pid_file) -> int:
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(pid_file.read_text())


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_a_closed_terminal_stops_the_platform_as_a_stop_signal_does(tmp_path, sig):
    """SIGHUP (the terminal running `make run` closed, the ssh session dropped) killed the
    supervisor outright: no staged stop, and a child waiting out its work was left running."""
    pid_file, stopped = tmp_path / "child.pid", tmp_path / "stopped"
    code = (
        "import os, signal, sys, time; "
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(stopped)!r}, 'w').close(), "
        "sys.exit(0))); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    supervisor = _supervisor_process(f"ProcessSpec('child', [sys.executable, '-c', {code!r}])")
    child_pid = _read_pid(pid_file)

    supervisor.send_signal(sig)

    assert supervisor.wait(timeout=20) == 0  # it stopped its children, then itself
    assert stopped.exists() and _dies(child_pid)


def test_a_child_whose_sigterm_waits_dies_with_a_killed_supervisor_by_its_own_signal(tmp_path):
    """A Celery worker takes SIGTERM as "finish the running task" (a batch of hours): as the
    parent-death signal, it kept the worker running with no supervisor to escalate."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    supervisor = _supervisor_process(
        f"ProcessSpec('child', [sys.executable, '-c', {code!r}], "
        "parent_death_signal=signal.SIGQUIT)"
    )
    child_pid = _read_pid(pid_file)

    supervisor.kill()
    supervisor.wait()

    assert _dies(child_pid)


def test_the_celery_workers_die_cold_with_a_killed_supervisor(settings):
    from config.management.commands.runplatform import Command

    workers = Command()._workers({})
    assert [spec.name for spec in workers] == ["celery", "celery-batches"]
    assert all(spec.parent_death_signal == signal.SIGQUIT for spec in workers)


def _parent_of_a_sleeper(pid_file) -> list[str]:
    """A child that starts a grandchild of its own (as Celery starts its beat and pool),
    writes the grandchild's pid to ``pid_file`` and sleeps."""
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    return [sys.executable, "-c", code]


def _dies(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_what_a_killed_child_left_behind_dies_before_it_is_restarted(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    supervisor = Supervisor([ProcessSpec("parent", _parent_of_a_sleeper(pid_file))])
    thread, result = _run_in_thread(supervisor)
    try:
        _wait_started(supervisor, 1)
        first, orphan = supervisor.children["parent"].pid, _read_pid(pid_file)
        pid_file.unlink()

        os.kill(first, signal.SIGKILL)  # its grandchild lives on, an orphan
        deadline = time.monotonic() + 20
        while supervisor.children["parent"].pid == first and time.monotonic() < deadline:
            time.sleep(0.05)
        replacement = _read_pid(pid_file)

        # no second copy of what the child ran (a second Celery beat sends every task twice)
        assert _dies(orphan) and _alive(replacement)
    finally:
        supervisor._on_signal(signal.SIGTERM, None)
        thread.join(timeout=20)
    assert result == [0] and _dies(replacement)


def test_children_stop_in_stages_lowest_first(tmp_path):
    """The engine (stage 0) is stopped, and has exited, before the web processes get SIGTERM."""
    first_stopped = tmp_path / "first-stopped"
    seen = tmp_path / "seen"
    on_term = (
        "import signal, sys, time, pathlib; "
        "signal.signal(signal.SIGTERM, lambda *a: ({}, sys.exit(0))); time.sleep(60)"
    )
    first = [sys.executable, "-c", on_term.format(f"pathlib.Path({str(first_stopped)!r}).touch()")]
    second = [
        sys.executable,
        "-c",
        on_term.format(
            f"pathlib.Path({str(seen)!r}).write_text(str(pathlib.Path({str(first_stopped)!r}).exists()))"
        ),
    ]
    supervisor = Supervisor(
        [ProcessSpec("web", second), ProcessSpec("engine", first, stop_stage=0)]
    )
    thread, result = _run_in_thread(supervisor)
    _wait_started(supervisor, 2)
    time.sleep(0.5)  # let the children install their handlers

    supervisor._on_signal(signal.SIGTERM, None)
    thread.join(timeout=30)

    assert result == [0]
    assert seen.read_text() == "True"
    assert supervisor.children["engine"].returncode == supervisor.children["web"].returncode == 0


@pytest.mark.parametrize("failing_start", [1, 3])  # the first start of "flaky"; its restart
def test_a_child_that_cannot_be_started_is_tried_again_and_the_rest_runs(
    monkeypatch, tmp_path, failing_start
):
    """A fork refused (EAGAIN, ENOMEM: often right after the kernel killed a process) raised
    out of the supervisor's loop, and the whole platform stopped."""
    import errno

    from config import supervisor as supervisor_module

    real_popen, calls = subprocess.Popen, []

    def popen(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == failing_start:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(supervisor_module.subprocess, "Popen", popen)
    crash = [sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(1)"]
    flaky = crash if failing_start == 3 else SLEEPER
    status_file = tmp_path / "supervisor.json"
    supervisor = Supervisor(
        [ProcessSpec("flaky", flaky), ProcessSpec("web", SLEEPER)], status_file=status_file
    )
    thread, result = _run_in_thread(supervisor)
    try:
        deadline = time.monotonic() + 15
        while len(calls) < failing_start + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) >= failing_start + 2, calls  # tried again after the failure
        assert thread.is_alive() and supervisor.children["web"].poll() is None
    finally:
        supervisor._on_signal(signal.SIGTERM, None)
        thread.join(timeout=30)
    assert result == [0]


def test_a_stopped_platform_says_none_of_its_processes_runs(tmp_path):
    """The status file still said every process ran (with dead pids) after the platform
    stopped: the metrics and the console of a web process on the same folder believed it."""
    status_file = tmp_path / "supervisor.json"
    supervisor = Supervisor([ProcessSpec("engine", SLEEPER)], status_file=status_file)
    thread, _ = _run_in_thread(supervisor)
    _wait_started(supervisor, 1)
    # the child is in `children` a moment before the status file says so
    deadline = time.monotonic() + 10
    while not status_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(status_file.read_text())["engine"]["running"]

    supervisor._on_signal(signal.SIGTERM, None)
    thread.join(timeout=20)

    assert not json.loads(status_file.read_text())["engine"]["running"]
