"""A real `manage.py runplatform` for the live tests: started on a free port in the embedded
mode, its output drained on a thread (a full pipe would block every child that logs), and
its children found by their command lines."""

import contextlib
import http.client
import json
import re
import socket
import sqlite3
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
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


@contextlib.contextmanager
def long_context_platform(
    tmp_path: Path, env: dict[str, str] | None = None, engine_args: str = ""
) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """The platform on a tiny model with a long context, so that streams run long, once it is
    ready: (process, base URL, API key); ``engine_args`` adds engine flags. Killed on the way
    out if it still runs."""
    process, base = run_platform_on_tiny_model(
        tmp_path,
        engine_args=f"--dtype float32 --num-kv-blocks 1400 {engine_args}",
        env=env,
        max_position_embeddings=4096,
    )
    try:
        api_key = read_until(process, r"API key: (sk-\S+)", timeout=120).group(1)
        drain(process)
        wait_for_http(f"{base}/health/ready", timeout=120, ok_only=True)
        yield process, base, api_key
    finally:
        stop(process)


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


MESSAGES = [{"role": "user", "content": "hello world"}]


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage  # names in any case
    body: dict


def chat(base: str, api_key: str, max_tokens: int = 3) -> Answer:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens}
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, response.headers, json.loads(response.read()))
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers, json.loads(error.read()))


@dataclass
class Stream:
    """One streaming chat completion read on a thread, as a client sees it."""

    events: list[dict] = field(default_factory=list)
    num_tokens: int = 0  # as the chunks' logprobs count them
    is_done: bool = False  # data: [DONE] came
    ended_at: float | None = None  # when the body was read to its end
    failure: BaseException | None = None  # the connection dropped, or the answer was wrong

    @classmethod
    def open(cls, base: str, api_key: str) -> "Stream":
        stream = cls()
        stream.thread = threading.Thread(target=stream._read, args=(base, api_key), daemon=True)
        stream.thread.start()
        return stream

    def _read(self, base: str, api_key: str) -> None:
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 4000,
            "ignore_eos": True,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = urllib.parse.urlsplit(base)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        try:
            connection.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(body),
                headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
            )
            response = connection.getresponse()
            assert response.status == 200, response.read()
            # a chunked body cut short raises IncompleteRead here
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    self.is_done = True
                    continue
                event = json.loads(line[len(b"data: ") :])
                for choice in event.get("choices", []):
                    self.num_tokens += len((choice.get("logprobs") or {}).get("content") or [])
                self.events.append(event)
            self.ended_at = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.failure = exc
        finally:
            connection.close()


def usage_records(tmp_path) -> dict[str, dict]:
    """request_id -> usage record, read from the embedded database."""
    database = tmp_path / "var" / "db.sqlite3"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute(
            "SELECT request_id, source, status, error_code, prompt_tokens, completion_tokens "
            "FROM tenants_usagerecord"
        ).fetchall()
    return {row["request_id"]: dict(row) for row in rows}


def demo_login(tmp_path: Path, base: str) -> str:
    """The Cookie header of the demo admin signed in through the live server's own login form
    (the server signs sessions with its own secret key), with a CSRF token."""
    import http.cookiejar

    credentials = json.loads((tmp_path / "var" / "demo-credentials.json").read_text())
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{base}/accounts/login/", timeout=30).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    form = {
        "csrfmiddlewaretoken": token,
        "username": credentials["username"],
        "password": credentials["password"],
    }
    request = urllib.request.Request(
        f"{base}/accounts/login/",
        data=urllib.parse.urlencode(form).encode(),
        headers={"Referer": f"{base}/accounts/login/"},
    )
    opener.open(request, timeout=30)
    opener.open(f"{base}/chat/", timeout=30)  # picks the tenant to chat as
    return "; ".join(f"{cookie.name}={cookie.value}" for cookie in jar)


def new_conversation(base: str, cookie: str) -> int:
    """A new chat conversation with the "tiny" model, made through the chat's own view."""
    csrf = re.search(r"csrftoken=([^;]+)", cookie).group(1)
    request = urllib.request.Request(
        f"{base}/chat/new/",
        data=urllib.parse.urlencode({"model": "tiny"}).encode(),
        headers={
            "Cookie": cookie,
            "X-CSRFToken": csrf,
            "Referer": f"{base}/chat/",
            "Origin": base,
            "Accept": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["id"]


def chat_messages(tmp_path: Path, conversation_id: int) -> list[dict]:
    database = tmp_path / "var" / "db.sqlite3"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute(
            "SELECT id, role, content, status, error_code, request_id, completion_tokens "
            "FROM chat_message WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
    return [dict(row) for row in rows]
