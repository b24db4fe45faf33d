"""`make run`'s command end to end: a real Daphne serving the admin, the printed
credentials logging in, and SIGTERM stopping everything."""

import http.cookiejar
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _read_until(process: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
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


def _wait_for_http(url: str, timeout: float, ok_only: bool = False) -> None:
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


def _run_platform(tmp_path, *args: str, **env: str | None) -> tuple[subprocess.Popen, str]:
    """`manage.py runplatform` in the embedded mode on a free port: (process, base URL)."""
    port = _free_port()
    process = subprocess.Popen(
        [PYTHON, "manage.py", "runplatform", "--port", str(port), *args],
        cwd=ROOT,
        env=subprocess_env(VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, DEBUG=None, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture
def platform_process(tmp_path):
    from tests.inference_engine.conftest import save_model

    model = save_model(tmp_path / "model", "llama")
    process, base = _run_platform(
        tmp_path,
        REDIS_URL=None,
        MODEL_PATH=model,
        SERVED_MODEL_NAME="tiny",
        ENGINE_ARGS="--dtype float32 --num-kv-blocks 64",
    )
    yield process, base
    if process.poll() is None:
        process.kill()
        process.wait()


def test_run_serves_the_admin_and_the_printed_credentials_log_in(platform_process):
    process, base = platform_process
    login = _read_until(process, r"login: (\S+) / (\S+)", timeout=120)
    api_key = _read_until(process, r"API key: (sk-\S+)", timeout=10).group(1)
    _wait_for_http(f"{base}/admin/login/", timeout=60)

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base}/admin/login/").read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    form = urllib.parse.urlencode(
        {
            "csrfmiddlewaretoken": token,
            "username": login.group(1),
            "password": login.group(2),
            "next": "/admin/",
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/admin/login/", data=form, headers={"Referer": f"{base}/admin/login/"}
    )
    admin_index = opener.open(request).read().decode()
    assert "Site administration" in admin_index
    assert "Tenants, plans, keys and usage" in admin_index
    assert opener.open(f"{base}/static/admin/css/base.css").status == 200

    # the engine it started answers through the API with the printed key
    _wait_for_http(f"{base}/health/ready", timeout=120, ok_only=True)
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    completion = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert completion["usage"]["completion_tokens"] == 3

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/admin/login/", timeout=2)
    rest = process.stdout.read()
    assert "engine stopped" in rest  # the engine shut down cleanly too
    assert "celery@" in rest and " ready." in rest  # and the Celery worker had started


def _children(pid: int) -> list[str]:
    """Command lines of the processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _run_web_only(tmp_path, **env: str | None) -> tuple[subprocess.Popen, str]:
    return _run_platform(tmp_path, "--no-demo", RUN_ENGINE="0", RUN_WORKER="0", **env)


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="several web processes need Redis")
def test_several_web_processes_share_one_port(tmp_path):
    process, base = _run_web_only(tmp_path, WEB_PROCESSES="3")
    try:
        _wait_for_http(f"{base}/health/live", timeout=60, ok_only=True)
        daphnes = [c for c in _children(process.pid) if "config.webserver --fd" in c]
        assert len(daphnes) == 3
        for _ in range(20):  # every connection is answered, whichever process takes it
            assert urllib.request.urlopen(f"{base}/health/live", timeout=5).status == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_several_web_processes_without_redis_are_refused(tmp_path):
    process, _ = _run_web_only(tmp_path, WEB_PROCESSES="2", REDIS_URL=None)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "WEB_PROCESSES > 1 needs REDIS_URL" in output


def _complete(base: str, api_key: str) -> dict:
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 3}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_a_killed_engine_is_restarted_and_serves_again(platform_process, tmp_path):
    process, base = platform_process
    api_key = _read_until(process, r"API key: (sk-\S+)", timeout=120).group(1)
    _wait_for_http(f"{base}/health/ready", timeout=120, ok_only=True)
    assert _complete(base, api_key)["usage"]["completion_tokens"] == 3
    [engine] = [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if _is_child_engine(stat, process.pid)
    ]

    os.kill(engine, signal.SIGKILL)

    status_file = tmp_path / "var" / "supervisor.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = json.loads(status_file.read_text())["engine"]
        if status["restarts"] >= 1 and status["running"]:
            break
        time.sleep(0.2)
    assert status["restarts"] == 1 and status["last_exit_code"] == -signal.SIGKILL
    assert status["pid"] != engine and process.poll() is None
    deadline = time.monotonic() + 120
    while True:  # the web tier picks the new engine up without a restart of its own
        try:
            assert _complete(base, api_key)["usage"]["completion_tokens"] == 3
            break
        except urllib.error.HTTPError as error:
            assert error.code == 503, error.read()
            assert time.monotonic() < deadline, "the restarted engine never served"
            time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def _is_child_engine(stat: Path, parent: int) -> bool:
    try:
        if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
            return False
        return "inference_engine" in (stat.parent / "cmdline").read_text()
    except (OSError, IndexError, ValueError):
        return False
