"""A real `manage.py runplatform` for the live tests: started on a free port in the embedded
mode, its output drained on a thread (a full pipe would block every child that logs), and
its children found by their command lines."""

import json
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import PYTHON, ROOT, subprocess_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_until(process: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not printed; output was:\n{''.join(seen)}")


def drain(process: subprocess.Popen) -> list[str]:
    """Keep reading the process's output on a thread; the lines read from now on."""
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for_http(url: str, timeout: float, ok_only: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            if not ok_only:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


def run_platform(tmp_path: Path, *args: str, **env: str | None) -> tuple[subprocess.Popen, str]:
    """`manage.py runplatform` in the embedded mode on a free port: (process, base URL)."""
    port = free_port()
    process = subprocess.Popen(
        [PYTHON, "manage.py", "runplatform", "--port", str(port), *args],
        cwd=ROOT,
        env=subprocess_env(VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, DEBUG=None, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, f"http://127.0.0.1:{port}"


def run_platform_on_tiny_model(
    tmp_path: Path,
    engine_args: str = "--dtype float32 --num-kv-blocks 64",
    env: dict[str, str] | None = None,
    **model_overrides,
) -> tuple[subprocess.Popen, str]:
    """The whole platform, its engine serving a tiny random model as "tiny"; ``env`` adds
    settings."""
    from tests.inference_engine.conftest import save_model

    model = save_model(tmp_path / "model", "llama", **model_overrides)
    return run_platform(
        tmp_path,
        REDIS_URL=None,
        MODEL_PATH=model,
        SERVED_MODEL_NAME="tiny",
        ENGINE_ARGS=engine_args,
        **(env or {}),
    )


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is ``pid``."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(stat.parent.name)] = (
                    (stat.parent / "cmdline").read_text().replace("\0", " ")
                )
        except (OSError, IndexError, ValueError):
            continue
    return found


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (the supervisor starts each child in its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def child_pid(pid: int, command_part: str) -> int:
    """The one child of ``pid`` whose command line contains ``command_part``."""
    [found] = [child for child, command in children(pid).items() if command_part in command]
    return found


def supervisor_status(tmp_path: Path) -> dict[str, dict]:
    return json.loads((tmp_path / "var" / "supervisor.json").read_text())


def wait_restarted(tmp_path: Path, name: str, old_pid: int, timeout: float) -> dict:
    """The supervisor's status of ``name`` once it runs again under a new pid."""
    deadline = time.monotonic() + timeout
    while True:
        status = supervisor_status(tmp_path)[name]
        if status["running"] and status["pid"] != old_pid:
            return status
        assert time.monotonic() < deadline, f"{name} was not restarted: {status}"
        time.sleep(0.2)
