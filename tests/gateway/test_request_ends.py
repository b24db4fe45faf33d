"""How an API request ends: a web server that stops (Daphne on SIGTERM: each request's
instance cancelled once, then the process exits) meters the requests in flight and gives their
slots back, as a client's disconnect does; a request served leaves nothing running; a
stream's slot is free before its client reads the end."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async

from inference_engine.protocol import FinishReason, GenerateDelta, ResponseType, Usage
from tenants import quotas, services
from tests.serving.fake_runs import run_world  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


async def _one_token_then_silence(fake, sent: asyncio.Event) -> None:
    identity, request = await fake.generates.get()
    delta = GenerateDelta(
        request.request_id, "a", [1], usage=Usage(prompt_tokens=3, completion_tokens=1)
    )
    await fake.send(identity, ResponseType.OUTPUTS, [delta])
    sent.set()
    await asyncio.Event().wait()  # a long generation, still running


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.tenant_limits(max_concurrent_requests=5)
async def test_a_stopping_web_server_meters_its_requests_in_flight(run_world, stream):  # noqa: F811
    from config.asgi import application

    _, raw_key = await sync_to_async(services.api_key_create)(tenant=run_world.tenant, name="h")
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": stream})
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {raw_key}".encode()),
                    (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }  # fmt: skip
    incoming = [{"type": "http.request", "body": body.encode(), "more_body": False}]
    started, token_sent = asyncio.Event(), asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # the client stays connected

    async def send(message: dict) -> None:
        started.set()

    engine = asyncio.create_task(_one_token_then_silence(run_world.fake, token_sent))
    instance = asyncio.create_task(application(scope, receive, send))
    try:
        await asyncio.wait_for(token_sent.wait(), 20)
        if stream:
            await asyncio.wait_for(started.wait(), 20)  # streaming, one token out
        else:
            await asyncio.sleep(0.2)  # its first token in
        # what Daphne does on SIGTERM: cancel the instance, wait for it, then exit
        instance.cancel()
        await asyncio.gather(instance, return_exceptions=True)

        records = await run_world.records()
        held = await sync_to_async(quotas.quota_usage)(tenant=run_world.tenant)
        assert [r.status for r in records] == ["cancelled"]
        assert held.concurrent_requests == 0
        assert run_world.fake.aborted()  # the engine stops generating for it
    finally:
        engine.cancel()


async def test_a_request_served_leaves_no_task_behind():
    """Each request left two tasks pending (the wait for the client's next message, and for
    the server's stop), each logged as destroyed pending when collected."""
    import gc

    from config.asgi import application

    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": "/health/live", "raw_path": b"/health/live",
        "query_string": b"", "root_path": "", "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }  # fmt: skip
    queue = asyncio.Queue()  # as Daphne's application queue
    queue.put_nowait({"type": "http.request", "body": b"", "more_body": False})
    sent = []
    before = asyncio.all_tasks()

    async def send(message: dict) -> None:
        sent.append(message)

    await application(scope, queue.get, send)
    await asyncio.sleep(0.05)
    gc.collect()
    await asyncio.sleep(0.05)

    assert sent[0]["status"] == 200
    assert [task for task in asyncio.all_tasks() - before if not task.done()] == []
    assert errors == []


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_a_streams_slot_is_free_when_its_client_reads_the_end(run_world, monkeypatch):  # noqa: F811
    """A client at its concurrency limit sends its next request the moment it reads [DONE];
    the slot was freed by the settlement, which runs as that last event goes out, and under
    load the next request was refused (429)."""
    from serving import metering
    from tests.asgi_client import asgi_request

    original = metering.settle

    async def slow_settle(settlement):  # a loaded database
        await asyncio.sleep(1.0)
        return await original(settlement)

    monkeypatch.setattr(metering, "settle", slow_settle)
    _, raw_key = await sync_to_async(services.api_key_create)(tenant=run_world.tenant, name="h")
    headers = {"Authorization": f"Bearer {raw_key}", "Content-Type": "application/json"}
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True}).encode()

    async def engine() -> None:
        for _ in range(2):
            identity, request = await run_world.fake.generates.get()
            done = GenerateDelta(
                request.request_id, "a", [1], finish_reason=FinishReason.LENGTH,
                usage=Usage(prompt_tokens=3, completion_tokens=1),
            )  # fmt: skip
            await run_world.fake.send(identity, ResponseType.OUTPUTS, [done])

    serving = asyncio.create_task(engine())
    from config.asgi import application

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {raw_key}".encode()),
                    (b"content-type", b"application/json")],
    }  # fmt: skip
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    end_read = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        if b"[DONE]" in message.get("body", b""):
            end_read.set()

    first = asyncio.create_task(application(scope, receive, send))
    try:
        await asyncio.wait_for(end_read.wait(), 20)
        status, _, answer = await asgi_request(
            "POST", "/v1/completions", headers=headers, body=body
        )
        assert status == 200, answer
        await asyncio.wait_for(first, 20)
    finally:
        serving.cancel()
    assert len(await run_world.records()) == 2
