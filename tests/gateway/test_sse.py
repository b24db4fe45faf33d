"""Server-sent events of one Generation against a fake engine: what goes out in which write."""

import asyncio
import json

import msgspec
import pytest

from gateway import schemas
from gateway.generation import Generation, fan_out
from gateway.validation import plan_chat, plan_completion
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


def _generation(kind: str, plan, client: AsyncEngineClient, response_id: str) -> Generation:
    """A generation of model "m" for ``plan``, one engine request per choice."""
    return Generation(
        kind=kind,
        plan=plan,
        requests=fan_out(plan, response_id, None, "tenant"),
        client=client,
        meter=Meter(response_id),
        response_id=response_id,
        model="m",
    )


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
    generation = _generation("chat", plan, client, "chatcmpl-1")
    requests = generation.requests
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


# quotes, escapes, control characters, non-ASCII, the templates' own placeholder character
AWKWARD_TEXTS = ['say "hi"', "back\\slash", "line\nbreak\t", "\x00\x1f", "héllo 世界 🙂", "\ue000"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_text_events_are_exactly_the_encoded_response_objects(engine, kind):
    """Plain text events are cut from a template (the generation's fixed fields encoded
    once): each must be byte for byte the encoding of the whole chunk object."""
    fake, client = engine
    body = {"model": "m", "stream": True, "n": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        plan = plan_chat(json.dumps(body).encode())
    else:
        body["prompt"] = "hi"
        plan = plan_completion(json.dumps(body).encode())
    generation = _generation(kind, plan, client, "resp-1")
    requests = generation.requests
    starting = asyncio.create_task(generation.start())
    identities = {}
    for _ in requests:
        identity, request = await fake.generates.get()
        identities[request.request_id] = identity
    for index, request in enumerate(requests):  # the first token of each choice
        delta = GenerateDelta(request.request_id, AWKWARD_TEXTS[index], [1])
        await fake.send(identities[request.request_id], ResponseType.OUTPUTS, [delta])
    await starting
    for text in AWKWARD_TEXTS[2:]:
        for request in requests:
            delta = GenerateDelta(request.request_id, text, [2])
            await fake.send(identities[request.request_id], ResponseType.OUTPUTS, [delta])
    writes = generation.sse()
    text_events = []
    num_text_events = 2 + 2 * len(AWKWARD_TEXTS[2:])  # each choice's first token, then pairs
    while len(text_events) < num_text_events:
        write = await anext(writes)
        events = [event + b"\n\n" for event in write.split(b"\n\n")[:-1]]
        text_events += [event for event in events if b'"role"' not in event]

    def expected(index: int, text: str) -> bytes:
        if kind == "chat":
            choice = schemas.ChatChunkChoice(
                index=index,
                delta=schemas.ChunkDelta(content=text),
                logprobs=None,
                finish_reason=None,
            )
            chunk = schemas.ChatCompletionChunk(
                id="resp-1",
                object="chat.completion.chunk",
                created=generation.created,
                model="m",
                choices=[choice],
            )
        else:
            choice = schemas.CompletionChoice(
                index=index, text=text, logprobs=None, finish_reason=None
            )
            chunk = schemas.Completion(
                object="text_completion",
                id="resp-1",
                created=generation.created,
                model="m",
                choices=[choice],
            )
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    by_choice = {0: [], 1: []}  # the choices' streams interleave in arrival order
    for event in text_events:
        by_choice[json.loads(event[6:])["choices"][0]["index"]].append(event)
    for index in (0, 1):
        texts = [AWKWARD_TEXTS[index], *AWKWARD_TEXTS[2:]]
        assert by_choice[index] == [expected(index, text) for text in texts]
    assert json.loads(by_choice[1][-1][6:])["choices"][0] == (
        {"index": 1, "delta": {"content": "\ue000"}, "logprobs": None, "finish_reason": None}
        if kind == "chat"
        else {"index": 1, "text": "\ue000", "logprobs": None, "finish_reason": None}
    )
