"""A batch survives its Celery worker (issue 21): on a real `make run`, the worker running a
batch is killed with SIGKILL mid-way; the supervisor restarts it, the sweep resumes the batch
once the dead runner's lease runs out, and the batch completes with every line exactly once
and exactly one usage record per line."""

import json
import os
import signal
import time

import openai
import pytest

from tests.batches.conftest import jsonl
from tests.config.live_platform import (
    child_pid,
    drain,
    read_until,
    run_platform_on_tiny_model,
    session_members,
    stop,
    usage_records,
    wait_for_http,
    wait_restarted,
)

NUM_LINES = 50
MAX_TOKENS = 48


@pytest.fixture
def platform(tmp_path):
    process, base = run_platform_on_tiny_model(
        tmp_path,
        engine_args="--dtype float32 --num-kv-blocks 256",
        # a short lease and a frequent sweep, so that the killed worker's batch resumes soon;
        # two lines in flight, so that the batch is still running when the worker is killed
        env={"BATCH_LEASE_SECONDS": "4", "BATCH_SWEEP_SECONDS": "2", "BATCH_MAX_IN_FLIGHT": "2"},
        max_position_embeddings=512,
    )
    try:
        api_key = read_until(process, r"API key: (sk-\S+)", timeout=120).group(1)
        drain(process)
        wait_for_http(f"{base}/health/ready", timeout=120, ok_only=True)
        yield process, openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)
    finally:
        stop(process)


def _lines() -> list[dict]:
    return [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"count to {n}"}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for n in range(NUM_LINES)
    ]


def test_a_batch_completes_exactly_once_across_a_killed_worker(platform, tmp_path):
    process, client = platform
    file = client.files.create(file=("in.jsonl", jsonl(_lines())), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).request_counts.completed < 4:
        assert batch.status in ("validating", "in_progress"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    worker = child_pid(process.pid, " --queues batches ")  # the batch runs' worker
    group = session_members(worker)

    os.kill(worker, signal.SIGKILL)

    done_at_kill = client.batches.retrieve(batch.id).request_counts.completed
    assert done_at_kill < NUM_LINES, "the batch ended before the kill: nothing was resumed"
    wait_restarted(tmp_path, "celery-batches", worker, timeout=30)
    assert not any(pid in session_members(worker) for pid in group)
    deadline = time.monotonic() + 240
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)

    assert batch.request_counts.total == NUM_LINES
    assert (batch.request_counts.completed, batch.request_counts.failed) == (NUM_LINES, 0)
    assert batch.error_file_id is None
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).iter_lines()]
    assert sorted(line["custom_id"] for line in output) == sorted(
        line["custom_id"] for line in _lines()
    )
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        usage = line["response"]["body"]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, line
    records = [r for r in usage_records(tmp_path).values() if r["source"] == "batch"]
    assert len(records) == NUM_LINES
    assert {r["request_id"] for r in records} == {line["response"]["request_id"] for line in output}
    # a line the dead worker left running was run again under its request id: its record
    # is the one run that answered it
    assert {(r["status"], r["completion_tokens"]) for r in records} == {("ok", MAX_TOKENS)}
    print(f"\n{done_at_kill} of {NUM_LINES} lines were done when the worker was killed")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
