"""Server-sent events of one Generation against a fake engine: what goes out in which write."""

import asyncio
import json

import pytest

from gateway.generation import Generation, fan_out
from gateway.validation import plan_chat
from inference_engine.client import AsyncEngineClient
from inference_engine.protocol import FinishReason, GenerateDelta, ResponseType, Usage
from tenants.metering import Meter
from tests.inference_engine.test_client import FakeEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def engine(tmp_path):
    fake = FakeEngine(f"ipc://{tmp_path}/fake.sock")
    client = AsyncEngineClient(f"ipc://{tmp_path}/fake.sock")
    await client.wait_ready(timeout=10)
    yield fake, client
    client.close()
    fake.close()


def _events(write: bytes) -> list:
    assert write.endswith(b"\n\n")
    return [
        event[6:] if event == b"data: [DONE]" else json.loads(event[6:])
        for event in write.split(b"\n\n")[:-1]
    ]


async def test_ready_events_share_a_write(engine):
    fake, client = engine
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plan = plan_chat(json.dumps(body).encode())
    requests = fan_out(plan, "chatcmpl-1", None, "tenant")
    generation = Generation(
        kind="chat",
        plan=plan,
        requests=requests,
        client=client,
        meter=Meter("chatcmpl-1"),
        response_id="chatcmpl-1",
        model="m",
    )
    request_id = requests[0].request_id
    starting = asyncio.create_task(generation.start())
    identity, _ = await fake.generates.get()
    usage = Usage(prompt_tokens=3)
    await fake.send(
        identity, ResponseType.OUTPUTS, [GenerateDelta(request_id, "Hel", [1], usage=usage)]
    )
    await starting
    writes = generation.sse()

    # the role chunk goes out with the first token
    first = _events(await anext(writes))
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
    ]

    # tokens that queued up while nobody read go out together, each its own event
    frame = [GenerateDelta(request_id, text, [i]) for i, text in enumerate("lo!", start=2)]
    await fake.send(identity, ResponseType.OUTPUTS, frame)
    while client.num_buffered(request_id) < 3:  # all three arrive before the next read
        await asyncio.sleep(0.01)
    queued = _events(await anext(writes))
    assert [e["choices"][0]["delta"]["content"] for e in queued] == ["l", "o", "!"]

    # the last token, its finish chunk, the usage and [DONE] share the last write
    last_delta = GenerateDelta(request_id, "?", [5], finish_reason=FinishReason.STOP, usage=usage)
    await fake.send(identity, ResponseType.OUTPUTS, [last_delta])
    last = _events(await anext(writes))
    assert last[0]["choices"][0]["delta"] == {"content": "?"}
    assert last[1]["choices"][0]["finish_reason"] == "stop"
    assert last[2]["usage"]["completion_tokens"] == 5 and last[2]["choices"] == []
    assert last[3] == b"[DONE]"
    with pytest.raises(StopAsyncIteration):
        await anext(writes)
