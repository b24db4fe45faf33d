"""AsyncEngineClient against a fake engine (a ROUTER socket in the test's event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from inference_engine.client import AsyncEngineClient, EngineOverloaded, EngineUnavailable
from inference_engine.protocol import (
    AbortRequest,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    RequestType,
    ResponseType,
    StatsResponse,
    Usage,
)

pytestmark = pytest.mark.timeout(60)


class FakeEngine:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(endpoint)
        self.received: list[tuple[bytes, bytes, bytes]] = []
        self.generates: asyncio.Queue = asyncio.Queue()
        self.is_answering = True
        self.engine_id = "first"
        self.model = "fake"
        self.step_seconds = 0.0
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, kind, payload = await self.router.recv_multipart()
            self.received.append((identity, kind, payload))
            if kind == RequestType.GENERATE.value:
                request = msgspec.msgpack.decode(payload, type=GenerateRequest)
                self.generates.put_nowait((identity, request))
            elif kind == RequestType.STATS.value and self.is_answering:
                stats = StatsResponse(
                    model=self.model,
                    max_model_len=256,
                    ready=True,
                    engine_id=self.engine_id,
                    step_seconds=self.step_seconds,
                )
                await self.send(identity, ResponseType.STATS, stats)

    async def send(self, identity: bytes, kind: ResponseType, message) -> None:
        await self.router.send_multipart([identity, kind.value, msgspec.msgpack.encode(message)])

    def aborted(self) -> list[str]:
        return [
            request_id
            for _, kind, payload in self.received
            if kind == RequestType.ABORT.value
            for request_id in msgspec.msgpack.decode(payload, type=AbortRequest).req_ids
        ]

    def close(self) -> None:
        self.task.cancel()
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def fake(tmp_path):
    engine = FakeEngine(f"ipc://{tmp_path}/fake.sock")
    yield engine
    engine.close()


@pytest.fixture
async def client(fake, tmp_path):
    client = AsyncEngineClient(
        f"ipc://{tmp_path}/fake.sock", heartbeat_interval=0.05, heartbeat_timeout=0.5
    )
    await client.wait_ready(timeout=10)
    yield client
    client.close()


async def test_deltas_are_routed_by_request_id_and_batched_frames_split(fake, client):
    ids = ["r0", "r1", "r2"]
    tasks = {
        i: asyncio.create_task(_collect(client.generate(GenerateRequest(prompt=i, request_id=i))))
        for i in ids
    }
    requests = [await fake.generates.get() for _ in ids]
    assert sorted(request.request_id for _, request in requests) == ids
    identity = requests[0][0]
    frame = [GenerateDelta(i, text=i) for i in ids] + [GenerateDelta("unknown", text="x")]
    await fake.send(identity, ResponseType.OUTPUTS, frame)
    done = [GenerateDelta(i, text="!", finish_reason=FinishReason.LENGTH) for i in reversed(ids)]
    await fake.send(identity, ResponseType.OUTPUTS, done)
    for i, task in tasks.items():
        assert "".join(d.text for d in await task) == i + "!"
    assert client.num_open_streams == 0

    # a generated request_id is filled in
    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    _, request = await fake.generates.get()
    assert len(request.request_id) == 32
    task.cancel()


async def _collect(stream) -> list[GenerateDelta]:
    return [delta async for delta in stream]


async def test_leaving_a_stream_early_sends_abort(fake, client):
    request = GenerateRequest(prompt="hi", request_id="mine")
    async with contextlib.aclosing(client.generate(request)) as stream:
        task = asyncio.create_task(anext(stream))
        identity, _ = await fake.generates.get()
        await fake.send(identity, ResponseType.OUTPUTS, [GenerateDelta("mine", text="a")])
        assert (await task).text == "a"
    await _eventually(lambda: fake.aborted() == ["mine"])

    # a cancelled task aborts too
    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    _, request = await fake.generates.get()
    task.cancel()
    await _eventually(lambda: fake.aborted() == ["mine", request.request_id])
    assert client.num_open_streams == 0


async def test_a_stream_left_early_still_gets_its_last_delta(fake, client):
    """The engine answers an abort with the request's usage: final_delta hands it over."""
    request = GenerateRequest(prompt="hi", request_id="left")
    async with contextlib.aclosing(client.generate(request)) as stream:
        task = asyncio.create_task(anext(stream))
        identity, _ = await fake.generates.get()
        await fake.send(identity, ResponseType.OUTPUTS, [GenerateDelta("left", token_ids=[7])])
        await task
    await _eventually(lambda: fake.aborted() == ["left"])
    usage = Usage(prompt_tokens=5, completion_tokens=3)
    last = GenerateDelta("left", finish_reason=FinishReason.ABORT, usage=usage)
    await fake.send(identity, ResponseType.OUTPUTS, [last])
    assert (await client.final_delta("left", timeout=5)).usage == usage
    assert await client.final_delta("left", timeout=5) is None  # handed over once

    # a last delta that arrived before the stream was left is not lost either
    request = GenerateRequest(prompt="hi", request_id="queued")
    async with contextlib.aclosing(client.generate(request)) as stream:
        task = asyncio.create_task(anext(stream))
        identity, _ = await fake.generates.get()
        first = GenerateDelta("queued", token_ids=[1])
        done = GenerateDelta("queued", token_ids=[2], finish_reason=FinishReason.LENGTH)
        await fake.send(identity, ResponseType.OUTPUTS, [first, done])
        await task
        await _eventually(lambda: client.num_buffered("queued") == 1)
    assert (await client.final_delta("queued", timeout=5)).finish_reason == FinishReason.LENGTH

    # unknown, or never answered: None, without waiting past the timeout
    assert await client.final_delta("never-sent", timeout=5) is None
    request = GenerateRequest(prompt="hi", request_id="silent")
    async with contextlib.aclosing(client.generate(request)) as stream:
        task = asyncio.create_task(anext(stream))
        identity, _ = await fake.generates.get()
        await fake.send(identity, ResponseType.OUTPUTS, [GenerateDelta("silent", text="a")])
        await task
    assert await client.final_delta("silent", timeout=0.05) is None


async def test_a_finished_stream_sends_no_abort(fake, client):
    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    identity, request = await fake.generates.get()
    done = GenerateDelta(request.request_id, finish_reason=FinishReason.STOP)
    await fake.send(identity, ResponseType.OUTPUTS, [done])
    assert [d.finish_reason for d in await task] == [FinishReason.STOP]
    await asyncio.sleep(0.1)
    assert fake.aborted() == []


async def test_a_silent_engine_fails_open_streams_within_the_timeout(fake, client):
    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    await fake.generates.get()
    fake.is_answering = False
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="silent"):
        await task
    assert time.monotonic() - started < 2
    with pytest.raises(EngineUnavailable):
        await client.stats(timeout=0.2)

    fake.is_answering = True
    assert (await client.wait_ready(timeout=5)).ready


async def test_an_engine_restart_fails_open_streams(fake, client):
    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    await fake.generates.get()
    fake.engine_id = "second"
    with pytest.raises(EngineUnavailable, match="restarted"):
        await task
    assert (await client.stats()).engine_id == "second"


async def test_no_engine_and_closed_client_raise_engine_unavailable(tmp_path, fake, client):
    lonely = AsyncEngineClient(
        f"ipc://{tmp_path}/nobody.sock", heartbeat_interval=0.05, heartbeat_timeout=0.3
    )
    with pytest.raises(EngineUnavailable):
        await _collect(lonely.generate(GenerateRequest(prompt="x")))
    with pytest.raises(EngineUnavailable):
        await lonely.wait_ready(timeout=0.5)
    lonely.close()

    task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
    await fake.generates.get()
    client.close()
    with pytest.raises(EngineUnavailable, match="closed"):
        await task
    with pytest.raises(EngineUnavailable):
        await _collect(client.generate(GenerateRequest(prompt="y")))


async def test_stats_gives_up_within_its_own_timeout_while_no_engine_ever_connected(tmp_path):
    # a new client retries its first sends for up to the heartbeat timeout (its socket may
    # still be connecting); a STATS asked with a shorter timeout must not wait that long
    # (a readiness probe or /v1/models with one dead replica took the full 5 s)
    lonely = AsyncEngineClient(f"ipc://{tmp_path}/nobody.sock", heartbeat_timeout=30.0)
    began = time.monotonic()
    with pytest.raises(EngineUnavailable):
        await lonely.stats(timeout=0.2)
    with pytest.raises(EngineUnavailable):
        await lonely.wait_ready(timeout=0.2)
    lonely.close()
    assert time.monotonic() - began < 10, "a 0.2 s timeout waited for the 30 s heartbeat one"


async def _eventually(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_heartbeats_keep_the_latest_stats_fresh(fake, client):
    assert client.latest_stats()[0].model == "fake"
    fake.model = "renamed"  # only a heartbeat's STATS can bring the new name
    await _eventually(lambda: client.latest_stats()[0].model == "renamed")


async def test_no_stats_before_the_engine_answers(tmp_path):
    client = AsyncEngineClient(f"ipc://{tmp_path}/nobody.sock")
    assert client.latest_stats() == (None, float("inf"))
    client.close()


async def test_num_buffered_counts_deltas_not_yet_taken(fake, client):
    request = GenerateRequest(prompt="hi", request_id="slow")
    async with contextlib.aclosing(client.generate(request)) as stream:
        first = asyncio.create_task(anext(stream))
        identity, _ = await fake.generates.get()
        frame = [GenerateDelta("slow", text=t) for t in "abc"]
        await fake.send(identity, ResponseType.OUTPUTS, frame)
        assert (await first).text == "a"
        assert client.num_buffered("slow") == 2
        assert (await anext(stream)).text == "b"
        assert client.num_buffered("slow") == 1
    assert client.num_buffered("slow") == 0


async def test_an_engine_that_goes_away_fails_the_open_streams_at_once(fake, tmp_path):
    """A dropped connection (the engine died) ends the streams without waiting out the
    heartbeat timeout: their requests died with the engine."""
    client = AsyncEngineClient(
        f"ipc://{tmp_path}/fake.sock", heartbeat_interval=0.05, heartbeat_timeout=60
    )
    try:
        task = asyncio.create_task(_collect(client.generate(GenerateRequest(prompt="x"))))
        await fake.generates.get()
        started = time.monotonic()
        fake.close()
        with pytest.raises(EngineUnavailable, match="went away"):
            await asyncio.wait_for(task, timeout=10)
        assert time.monotonic() - started < 5
    finally:
        client.close()


async def test_a_full_send_queue_to_a_live_engine_is_overloaded_not_unavailable(tmp_path):
    """A burst faster than the engine reads fills the queue to it: the engine is up, so that
    is EngineOverloaded (worth a retry), never EngineUnavailable ("no engine connected")."""
    endpoint = f"ipc://{tmp_path}/stalled.sock"
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)
    router.bind(endpoint)
    client = AsyncEngineClient(endpoint, send_hwm=1, send_wait=0.05)

    async def answer_one_stats() -> None:
        identity, _, _ = await router.recv_multipart()
        stats = StatsResponse(model="fake", max_model_len=256, ready=True, engine_id="e")
        await router.send_multipart(
            [identity, ResponseType.STATS.value, msgspec.msgpack.encode(stats)]
        )

    try:
        answering = asyncio.create_task(answer_one_stats())
        await client.stats()
        await answering  # from here on the engine reads nothing: a stalled busy engine
        prompt = "x" * 1_000_000  # a few fill every buffer on the way
        streams, refusal = [], None
        for i in range(200):
            stream = client.generate(GenerateRequest(prompt=prompt, request_id=f"r{i}"))
            first = asyncio.ensure_future(anext(stream))
            streams.append((stream, first))
            # refused after send_wait; a request that went out waits for deltas that never come
            await asyncio.wait([first], timeout=1)
            if first.done():
                refusal = first.exception()
                break
        assert isinstance(refusal, EngineOverloaded), refusal
        assert "full" in str(refusal)
        for _, first in streams:
            first.cancel()
        await asyncio.gather(*(first for _, first in streams), return_exceptions=True)
    finally:
        client.close()
        router.close(linger=0)
        ctx.term()


async def test_a_delta_this_client_cannot_read_ends_its_stream_alone(fake, client):
    """A newer engine's error code in one delta failed the whole frame: every stream of the
    web process lost that step's tokens, and the one whose last delta it was hung."""
    from inference_engine.protocol import ErrorCode

    tasks = {
        i: asyncio.create_task(_collect(client.generate(GenerateRequest(prompt=i, request_id=i))))
        for i in ("A", "B")
    }
    identity, _ = await fake.generates.get()
    await fake.generates.get()
    readable = msgspec.msgpack.encode(GenerateDelta("A", text="a"))
    unknown = msgspec.msgpack.encode(["B", "", [], 3, "code_of_a_newer_engine"])
    frame = b"\x92" + readable + unknown  # a msgpack array of the two
    await fake.router.send_multipart([identity, ResponseType.OUTPUTS.value, frame])
    done = GenerateDelta("A", text="!", finish_reason=FinishReason.STOP)
    await fake.send(identity, ResponseType.OUTPUTS, [done])

    assert "".join(d.text for d in await asyncio.wait_for(tasks["A"], 5)) == "a!"
    [ended] = await asyncio.wait_for(tasks["B"], 5)
    assert (ended.finish_reason, ended.error) == (FinishReason.ERROR, ErrorCode.ENGINE_ERROR)


async def test_an_abort_no_engine_took_is_sent_once_it_is_back(tmp_path):
    """A stream left while the link was down sent its abort into nothing: the engine, back
    on the same link, generated the request to its end for nobody."""
    endpoint = f"ipc://{tmp_path}/fake.sock"
    fake = FakeEngine(endpoint)
    client = AsyncEngineClient(endpoint, heartbeat_interval=0.05, heartbeat_timeout=60)
    try:
        task = asyncio.create_task(
            _collect(client.generate(GenerateRequest(prompt="x", request_id="orphan")))
        )
        await fake.generates.get()
        fake.close()  # the link drops: the stream fails, its abort finds no engine
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(task, timeout=10)
        assert not fake.aborted()

        fake = FakeEngine(endpoint)  # the engine is back on the link
        await _eventually(lambda: "orphan" in fake.aborted())
    finally:
        client.close()
        fake.close()


async def test_a_failed_socket_fails_its_streams_and_the_next_request_opens_a_new_link(
    fake, client
):
    """The reader returned on an unexpected socket error and nothing read again: every later
    request of the process waited on replies nobody read."""
    stream = asyncio.create_task(_collect(client.generate(GenerateRequest("hi", request_id="a"))))
    await fake.generates.get()
    broken = client._socket

    async def fail(*args, **kwargs):
        raise zmq.ZMQError(zmq.EFSM)

    broken.recv_multipart = fail
    broken.send_multipart(  # wakes the reader: its next read fails
        [RequestType.STATS.value, b""]
    )
    with pytest.raises(EngineUnavailable, match="link to the engine .* failed"):
        await asyncio.wait_for(stream, 5)
    await _eventually(lambda: client._socket is not broken)
    again = asyncio.create_task(_collect(client.generate(GenerateRequest("hi", request_id="b"))))
    identity, request = await asyncio.wait_for(fake.generates.get(), 5)
    assert request.request_id == "b"
    await fake.send(
        identity,
        ResponseType.OUTPUTS,
        [GenerateDelta("b", text="ok", finish_reason=FinishReason.LENGTH)],
    )
    assert [d.text for d in await asyncio.wait_for(again, 5)] == ["ok"]


async def test_a_frame_that_fails_to_be_handled_is_dropped_alone(fake, client, monkeypatch):
    dispatch, failed = client._dispatch, []

    def failing_once(frames):
        if not failed:
            failed.append(frames)
            raise RuntimeError("a bug in handling one frame")
        dispatch(frames)

    monkeypatch.setattr(client, "_dispatch", failing_once)
    stream = asyncio.create_task(_collect(client.generate(GenerateRequest("hi", request_id="c"))))
    identity, _ = await fake.generates.get()
    await _eventually(lambda: bool(failed))  # a heartbeat's STATS, say
    done = [GenerateDelta("c", text="!", finish_reason=FinishReason.LENGTH)]
    await fake.send(identity, ResponseType.OUTPUTS, done)
    assert [d.text for d in await asyncio.wait_for(stream, 5)] == ["!"]
