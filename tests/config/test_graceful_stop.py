"""SIGTERM to a running `make run` (issue 23): a graceful stop. Streams open at the time end
with an error event and a complete body, not a dropped connection; each is metered for what
it streamed; every child process is gone once `runplatform` exits, and it exits 0."""

import signal
import time

import pytest

from tests.config.live_platform import (
    Stream,
    children,
    long_context_platform,
    session_members,
    usage_records,
)

NUM_STREAMS = 3


@pytest.fixture
def platform(tmp_path):
    # runplatform gives the engine 10 s to finish open streams, in which a fast host streams
    # all of a stream's 4000 tokens; 1 s keeps them open at the stop, as a long reply is
    with long_context_platform(tmp_path, engine_args="--shutdown-grace-period 1") as running:
        yield running


def test_sigterm_ends_open_streams_with_an_error_event_and_stops_every_child(platform, tmp_path):
    process, base, api_key = platform
    streams = [Stream.open(base, api_key) for _ in range(NUM_STREAMS)]
    deadline = time.monotonic() + 60
    while not all(stream.num_tokens >= 5 for stream in streams):
        assert not any(stream.failure or stream.ended_at for stream in streams)
        assert time.monotonic() < deadline, [stream.num_tokens for stream in streams]
        time.sleep(0.05)
    child_pids = list(children(process.pid))

    process.send_signal(signal.SIGTERM)

    assert process.wait(timeout=60) == 0
    for stream in streams:
        stream.thread.join(timeout=30)
        assert stream.failure is None, repr(stream.failure)
        assert stream.ended_at is not None and not stream.is_done
        # the engine fails what did not finish in its grace period (engine_error), or the web
        # process finds it gone (engine_unavailable): either way the client is told
        error = stream.events[-1]["error"]
        assert error["code"] in ("engine_error", "engine_unavailable") and error["message"], error
    for pid in child_pids:
        assert session_members(pid) == [], pid
    records = usage_records(tmp_path)
    for stream in streams:
        record = records[stream.events[0]["id"]]
        assert record["status"] in ("error", "cancelled"), record
        assert record["completion_tokens"] >= stream.num_tokens
