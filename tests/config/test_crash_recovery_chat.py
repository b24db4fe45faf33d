"""A chat reply streaming over a WebSocket when the engine is killed with SIGKILL (issue 23):
the reply ends with an error frame, not a dropped socket; its partial text is saved with the
error, metered for the tokens streamed; and once the supervisor has restarted the engine the
same socket gets replies again."""

import json
import os
import signal
import time

import pytest

from bench.ws_probes import WebSocket
from tests.config.live_platform import (
    chat_messages,
    child_pid,
    demo_login,
    long_context_platform,
    new_conversation,
    usage_records,
)

REPLY_END_DEADLINE_SECONDS = 5.0  # as the API's streams (test_crash_recovery)
SERVED_AGAIN_DEADLINE_SECONDS = 60.0


@pytest.fixture
def platform(tmp_path):
    with long_context_platform(tmp_path) as running:
        yield running


async def _frame(socket: WebSocket, timeout: float = 60) -> dict:
    received = await socket.receive(timeout=timeout)
    assert received.kind == "text", (received.kind, received.code)
    return received.frame()


async def test_a_reply_over_a_killed_engine_ends_with_an_error_and_keeps_its_text(
    platform, tmp_path
):
    process, base, _ = platform
    cookie = demo_login(tmp_path, base)
    conversation_id = new_conversation(base, cookie)
    status, socket = await WebSocket.connect(
        base, f"/ws/chat/{conversation_id}/", {"Cookie": cookie, "Origin": base}
    )
    assert status == 101
    try:
        # no max tokens: the reply runs to the 4096-token context, long past the kill
        await socket.send_text(json.dumps({"type": "send", "content": "tell me a story"}))
        texts: list[str] = []
        reply_id = None
        while len(texts) < 5:
            frame = await _frame(socket)
            assert frame["type"] in ("message", "settings", "start", "token"), frame
            if frame["type"] == "start":
                reply_id = frame["message_id"]
            elif frame["type"] == "token":
                texts.append(frame["text"])

        os.kill(child_pid(process.pid, " -m inference_engine "), signal.SIGKILL)
        killed_at = time.monotonic()

        while (frame := await _frame(socket, timeout=30))["type"] == "token":
            texts.append(frame["text"])
        ended_after = time.monotonic() - killed_at
        assert frame["type"] == "error", frame
        assert frame["code"] == "engine_unavailable" and frame["message_id"] == reply_id, frame
        assert frame["message"]
        assert ended_after < REPLY_END_DEADLINE_SECONDS

        # the socket stays open: once the engine is back, the same socket gets a reply
        await socket.send_text(json.dumps({"type": "settings", "max_tokens": 3}))
        assert (await _frame(socket))["type"] == "settings"
        attempts = []
        while True:
            # a new message (a regenerate would replace the interrupted reply)
            await socket.send_text(json.dumps({"type": "send", "content": "again"}))
            while (frame := await _frame(socket))["type"] not in ("done", "error"):
                pass
            if frame["type"] == "done":
                break
            attempts.append(frame)
            assert frame["code"] in ("engine_unavailable", "model_loading"), frame
            assert time.monotonic() - killed_at < SERVED_AGAIN_DEADLINE_SECONDS, attempts
            time.sleep(0.5)
    finally:
        await socket.close()

    messages = chat_messages(tmp_path, conversation_id)
    records = usage_records(tmp_path)
    interrupted = next(m for m in messages if m["id"] == reply_id)
    assert interrupted["status"] == "error" and interrupted["error_code"] == "engine_unavailable"
    assert interrupted["content"] == "".join(texts) and interrupted["content"]
    record = records[interrupted["request_id"]]
    assert (record["source"], record["status"], record["error_code"]) == (
        "chat",
        "error",
        "engine_unavailable",
    )
    # every token streamed is metered: a token frame carries one token's text or more held
    # back by the detokenizer
    assert record["completion_tokens"] == interrupted["completion_tokens"] >= len(texts)
    print(f"\nthe reply ended {ended_after:.2f} s after the kill, {len(texts)} pieces streamed")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
