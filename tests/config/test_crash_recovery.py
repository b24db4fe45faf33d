"""A process of a running `make run` killed with SIGKILL (issue 23): open streams end with
OpenAI's error event and a complete body, new requests get a 503 with Retry-After while the
engine is down, the supervisor restarts what died and the platform serves again without a
restart of its own, and every admitted request is metered."""

import json
import os
import signal
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime

import pytest

from tests.config.live_platform import (
    Stream,
    chat,
    child_pid,
    long_context_platform,
    session_members,
    stop,
    supervisor_status,
    usage_records,
    wait_restarted,
)
from tests.conftest import PYTHON, ROOT, subprocess_env

NUM_STREAMS = 5
STREAM_END_DEADLINE_SECONDS = 5.0  # the issue asks for 2 s; the margin is for a loaded machine
SERVED_AGAIN_DEADLINE_SECONDS = 60.0


@pytest.fixture
def platform(tmp_path):
    with long_context_platform(tmp_path) as running:
        yield running


def test_a_killed_engine_ends_open_streams_with_an_error_and_comes_back(platform, tmp_path):
    process, base, api_key = platform
    warm = chat(base, api_key)
    assert warm.status == 200, warm.body
    streams = [Stream.open(base, api_key) for _ in range(NUM_STREAMS)]
    deadline = time.monotonic() + 60
    while not all(stream.num_tokens >= 5 for stream in streams):
        assert not any(stream.failure or stream.ended_at for stream in streams), [
            (stream.failure, stream.events[-1:]) for stream in streams
        ]
        assert time.monotonic() < deadline, [stream.num_tokens for stream in streams]
        time.sleep(0.05)
    engine = child_pid(process.pid, " -m inference_engine ")

    os.kill(engine, signal.SIGKILL)
    killed_at = time.monotonic()

    # The supervisor waits a second before it restarts the engine, which then loads its
    # model: a readiness check made now sees it down.
    with pytest.raises(urllib.error.HTTPError) as not_ready:
        urllib.request.urlopen(f"{base}/health/ready", timeout=10)
    assert not_ready.value.code == 503
    checks = json.loads(not_ready.value.read())["checks"]
    assert checks["models"].startswith("error") and checks["database"] == "ok", checks

    refused = []
    while (served := chat(base, api_key)).status != 200:
        refused.append(served)
        assert time.monotonic() - killed_at < SERVED_AGAIN_DEADLINE_SECONDS, refused[-1]
        time.sleep(0.2)
    served_after = time.monotonic() - killed_at
    for stream in streams:
        stream.thread.join(timeout=STREAM_END_DEADLINE_SECONDS)

    for stream in streams:
        assert stream.failure is None, repr(stream.failure)
        assert stream.ended_at is not None and not stream.is_done
        assert stream.events[-1]["error"]["code"] == "engine_unavailable", stream.events[-1]
        assert stream.events[-1]["error"]["type"] == "service_unavailable"
        assert stream.events[-1]["error"]["message"]
    stream_ends = [stream.ended_at - killed_at for stream in streams]
    assert max(stream_ends) < STREAM_END_DEADLINE_SECONDS, stream_ends
    for answer in refused:  # new requests while the engine was down: 503, come back later
        assert answer.status == 503, answer.body
        assert int(answer.headers["Retry-After"]) > 0
        assert answer.body["error"]["code"] in ("engine_unavailable", "model_loading")
    status = supervisor_status(tmp_path)["engine"]
    assert status["restarts"] == 1 and status["last_exit_code"] == -signal.SIGKILL
    assert status["running"] and status["pid"] != engine
    assert process.poll() is None
    print(
        f"\nstreams ended {', '.join(f'{t:.2f}' for t in stream_ends)} s after the kill; "
        f"{len(refused)} requests refused; served again {served_after:.1f} s after it"
    )

    # exactly one record per admitted request: the killed streams with what they streamed
    records = usage_records(tmp_path)
    prompt_tokens = warm.body["usage"]["prompt_tokens"]
    for stream in streams:
        record = records.pop(stream.events[0]["id"])
        assert record["status"] == "error" and record["error_code"] == "engine_unavailable"
        assert record["completion_tokens"] == stream.num_tokens
        assert record["prompt_tokens"] == prompt_tokens
    for answer in (warm, served):
        assert records.pop(answer.body["id"])["status"] == "ok"
    for answer in refused:
        # every answer has a request id; one admitted before it failed has its record's
        request_id = answer.headers["x-request-id"]
        record = records.pop(request_id, None)
        if request_id.startswith("req_"):  # refused before admission: nothing metered
            assert record is None, record
        else:
            assert record is not None and record["status"] == "error", (request_id, record)
            assert record["completion_tokens"] == 0, record
    assert records == {}

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


# queues the engine health poll when told to, and prints what it returned
QUEUER = """
import json
import sys
import django
django.setup()
from serving.tasks import poll_engine_health
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(poll_engine_health.delay().get(timeout=120)), flush=True)
"""


def _checked_at(tmp_path) -> str:
    database = tmp_path / "var" / "db.sqlite3"
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as connection:
        [(checked_at,)] = connection.execute(
            "SELECT checked_at FROM serving_modeldeployment WHERE name = 'tiny'"
        ).fetchall()
    return checked_at


def test_a_killed_celery_worker_is_restarted_and_runs_what_was_queued(platform, tmp_path):
    process, _, _ = platform
    queuer = subprocess.Popen(
        [PYTHON, "-c", QUEUER],
        cwd=ROOT,
        env=subprocess_env(
            VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, REDIS_URL=None, DEBUG=None
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert queuer.stdout.readline().strip() == "ready"
        worker = child_pid(process.pid, " --queues celery ")  # the worker with beat
        assert len(session_members(worker)) > 1  # its pool processes and its beat

        os.kill(worker, signal.SIGKILL)
        killed_at = datetime.now(UTC)
        queuer.stdin.write("\n")  # queued while no worker runs: the restart takes a second
        queuer.stdin.flush()

        status = wait_restarted(tmp_path, "celery", worker, timeout=30)
        assert status["restarts"] == 1 and status["last_exit_code"] == -signal.SIGKILL
        assert json.loads(queuer.stdout.readline()) == {"tiny": "ready"}
        assert queuer.wait(timeout=30) == 0
    finally:
        stop(queuer)
    checked_at = datetime.fromisoformat(_checked_at(tmp_path)).replace(tzinfo=UTC)
    assert checked_at > killed_at
    # nothing of the killed worker runs on beside its replacement (a second beat would send
    # every scheduled task twice)
    assert session_members(worker) == []
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
