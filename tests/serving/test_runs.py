"""``Run`` against a fake engine, the real database and quota counters: every way a run ends
settles it exactly once (one usage record with the right status, the admission released)."""

import asyncio

import pytest
from django.db import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

from inference_engine.protocol import (
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    ResponseType,
    SamplingParams,
    Usage,
)
from serving import runs
from serving.budget import PromptTokens
from serving.runs import ENGINE_FAILED, Run, RunError, RunSpec
from tenants import quotas
from tenants.models import UsageRecord
from tests.serving.fake_runs import run_world  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def spec(request_id: str = "run-1", n: int = 1, **params) -> RunSpec:
    return RunSpec(
        request_id=request_id,
        requests=[
            GenerateRequest(
                prompt="hi", params=SamplingParams(**params), request_id=f"{request_id}-{i}"
            )
            for i in range(n)
        ],
        prompt_tokens=PromptTokens(1, 4),
        choices_per_prompt=n,
    )


async def started(run_world, run: Run) -> bytes:  # noqa: F811
    """Start ``run``, answer its first token from the fake engine; the socket identity."""
    starting = asyncio.create_task(run.start())
    identity, request = await run_world.fake.generates.get()
    first = GenerateDelta(request.request_id, "a", [1], usage=Usage(prompt_tokens=3))
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [first])
    await starting
    return identity


async def record_of(run_world, request_id: str = "run-1") -> UsageRecord:  # noqa: F811
    records = await run_world.records()
    assert [r.request_id for r in records] == [request_id]  # exactly one
    return records[0]


async def assert_released(run_world) -> None:  # noqa: F811
    """A tenant limited to one concurrent request can run again: the slot was given back."""
    run = Run(spec("run-next"), run_world.caller())
    identity = await started(run_world, run)
    done = GenerateDelta("run-next-0", "", [], finish_reason=FinishReason.STOP)
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [done])
    async for _ in run.deltas():
        pass
    await run.aclose()


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_a_finished_run_is_metered_ok_once(run_world):  # noqa: F811
    run = Run(spec(), run_world.caller())
    identity = await started(run_world, run)
    last = GenerateDelta("run-1-0", "b", [2], finish_reason=FinishReason.STOP)
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [last])
    texts = [delta.text async for _, delta in run.deltas()]
    await run.aclose()
    await run.aclose()  # only the first counts

    assert texts == ["a", "b"]
    record = await record_of(run_world)
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("ok", 3, 2)
    await assert_released(run_world)


@pytest.mark.tenant_limits(requests_per_minute=1)
async def test_a_refusal_records_nothing_and_says_when_to_retry(run_world):  # noqa: F811
    await assert_released(run_world)  # the minute's one request
    run = Run(spec("run-2"), run_world.caller())
    with pytest.raises(RunError) as refused:
        await run.start()
    await run.aclose(refused.value)

    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after >= 1
    assert refused.value.windows["requests"].remaining == 0
    assert refused.value.request_id is None  # not admitted, so no record to name
    assert [r.request_id for r in await run_world.records()] == ["run-next"]


@pytest.mark.tenant_limits(requests_per_minute=0, tokens_per_minute=1000)
async def test_a_requests_limit_of_zero_is_named_as_such(run_world):  # noqa: F811
    """It was reported as a request too large "on tokens per min (TPM)"."""
    run = Run(spec(max_tokens=5), run_world.caller())
    with pytest.raises(RunError) as refused:
        await run.start()
    await run.aclose(refused.value)

    assert refused.value.code == "rate_limit_exceeded" and refused.value.retry_after is None
    assert "requests per minute: the limit is 0" in refused.value.message
    assert "TPM" not in refused.value.message
    assert await run_world.records() == []


async def test_max_tokens_over_the_context_is_refused_before_admission(run_world):  # noqa: F811
    run = Run(spec(max_tokens=257), run_world.caller())  # the fake engine serves 256
    with pytest.raises(RunError) as refused:
        await run.start()

    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "max_tokens")
    assert "maximum context length is 256 tokens" in refused.value.message
    assert await run_world.records() == []
    assert run_world.fake.generates.empty()


async def test_unset_max_tokens_reaches_the_engine_as_up_to_the_context(run_world):  # noqa: F811
    run = Run(spec(max_tokens=None), run_world.caller())
    starting = asyncio.create_task(run.start())
    identity, request = await run_world.fake.generates.get()
    assert request.params.max_tokens is None
    done = GenerateDelta(request.request_id, "", [], finish_reason=FinishReason.LENGTH)
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [done])
    await starting
    await run.aclose()
    assert (await record_of(run_world)).status == "ok"


@pytest.mark.parametrize(
    ("asked", "tier", "expected"),
    [(None, 1, 1), (5, 1, 5), (0, 1, 1), (-100, 2, 2), (7, 0, 7)],
)
async def test_a_caller_may_lower_its_priority_but_never_raise_it(
    run_world,  # noqa: F811
    asked,
    tier,
    expected,
):
    run_spec = spec(n=2)
    run_spec.priority = asked
    run = Run(run_spec, run_world.caller(priority=tier, tenant_weight=2.5, cache_salt="s"))
    starting = asyncio.create_task(run.start())
    sent = [await run_world.fake.generates.get() for _ in range(2)]
    tenant_id = str(run_world.tenant.pk)
    assert {(r.priority, r.tenant_weight, r.tenant_id, r.cache_salt) for _, r in sent} == {
        (expected, 2.5, tenant_id, "s")
    }
    for identity, request in sent:
        done = GenerateDelta(request.request_id, "", [], finish_reason=FinishReason.STOP)
        await run_world.fake.send(identity, ResponseType.OUTPUTS, [done])
    await starting
    await run.aclose()


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_cancelled_before_the_first_token(run_world, monkeypatch):  # noqa: F811
    monkeypatch.setattr(runs, "FINAL_USAGE_TIMEOUT_SECONDS", 0.2)  # the fake never answers
    run = Run(spec(), run_world.caller())
    starting = asyncio.create_task(run.start())
    await run_world.fake.generates.get()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting

    record = await record_of(run_world)
    assert (record.status, record.error_code, record.completion_tokens) == (
        "cancelled",
        "cancelled",
        0,
    )
    assert "run-1-0" in run_world.fake.aborted()
    await assert_released(run_world)


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_cancelled_mid_stream_meters_what_the_engine_computed(run_world):  # noqa: F811
    run = Run(spec(), run_world.caller())
    identity = await started(run_world, run)
    deltas = run.deltas()
    await anext(deltas)
    reading = asyncio.create_task(anext(deltas))
    await asyncio.sleep(0.05)
    reading.cancel()

    async def answer_the_abort() -> None:
        while "run-1-0" not in run_world.fake.aborted():
            await asyncio.sleep(0.01)
        final = GenerateDelta(
            "run-1-0",
            "",
            [],
            finish_reason=FinishReason.ABORT,
            usage=Usage(prompt_tokens=3, completion_tokens=7),
        )
        await run_world.fake.send(identity, ResponseType.OUTPUTS, [final])

    answering = asyncio.create_task(answer_the_abort())
    try:
        await reading
    except asyncio.CancelledError as exc:
        await run.aclose(exc)
    await answering

    record = await record_of(run_world)
    # 7 tokens: one streamed, six the client never read
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("cancelled", 3, 7)
    await assert_released(run_world)


@pytest.mark.parametrize(
    ("error", "code", "status", "retry_after"),
    [
        (ErrorCode.ENGINE_ERROR, "engine_error", "error", None),
        (ErrorCode.OVERLOADED, "engine_overloaded", "rejected", 1),
        (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "context_length_exceeded", "rejected", None),
    ],
)
@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_an_engine_error_before_the_first_token(
    run_world,  # noqa: F811
    error,
    code,
    status,
    retry_after,
):
    run = Run(spec(), run_world.caller())
    starting = asyncio.create_task(run.start())
    identity, _ = await run_world.fake.generates.get()
    refusal = GenerateDelta(
        "run-1-0", "", [], finish_reason=FinishReason.ERROR, error=error, error_message="no"
    )
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [refusal])
    with pytest.raises(RunError) as raised:
        await starting

    # an engine's own failure is the engine's business (it may name files, hosts, exception
    # text): the caller gets a fixed message; its refusals speak to the caller, as they are
    message = ENGINE_FAILED if status == "error" else "no"
    assert (raised.value.code, raised.value.message, raised.value.retry_after) == (
        code,
        message,
        retry_after,
    )
    assert raised.value.request_id == "run-1"  # admitted: its record is filed under it
    record = await record_of(run_world)
    assert (record.status, record.error_code) == (status, str(error))
    await assert_released(run_world)


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_a_full_queue_to_the_engine_is_overloaded_not_unavailable(
    run_world,  # noqa: F811
    monkeypatch,
):
    """A burst that fills the queue to a live engine (EngineOverloaded) was reported as
    "no engine connected" (engine_unavailable, 503 for 5 s): it is overloaded, retry in 1 s."""
    from inference_engine.client import AsyncEngineClient, EngineOverloaded

    async def full(self, request):
        raise EngineOverloaded(f"the queue to the engine at {self.endpoint} stayed full")
        yield  # an async generator, as generate() is

    monkeypatch.setattr(AsyncEngineClient, "generate", full)
    with pytest.raises(RunError) as raised:
        await Run(spec(), run_world.caller()).start()
    assert (raised.value.code, raised.value.retry_after) == ("engine_overloaded", 1)
    # the engine's internal address is the platform's, not the tenant's to know
    assert run_world.deployment.endpoints[0] not in raised.value.message
    assert raised.value.request_id == "run-1"
    record = await record_of(run_world)
    assert (record.status, record.error_code) == ("rejected", "overloaded")
    monkeypatch.undo()
    await assert_released(run_world)


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_an_engine_error_mid_stream(run_world):  # noqa: F811
    run = Run(spec(), run_world.caller())
    identity = await started(run_world, run)
    failure = GenerateDelta(
        "run-1-0",
        "",
        [],
        finish_reason=FinishReason.ERROR,
        error=ErrorCode.ENGINE_ERROR,
        error_message="output processing failed: KeyError: '/srv/engine/tokenizer.json'",
    )
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [failure])
    texts = []
    with pytest.raises(RunError) as raised:
        async for _, delta in run.deltas():
            texts.append(delta.text)
    await run.aclose(raised.value)

    assert texts == ["a"] and raised.value.code == "engine_error"
    assert raised.value.message == ENGINE_FAILED  # the engine's text goes to the log
    assert raised.value.request_id == "run-1"  # the answer names the record it is under
    record = await record_of(run_world)
    assert (record.status, record.completion_tokens) == ("error", 1)
    await assert_released(run_world)


@pytest.mark.tenant_limits(requests_per_minute=60, tokens_per_minute=10_000)
async def test_a_run_that_fails_after_admission_says_where_the_limits_stand(run_world):  # noqa: F811
    """A successful answer carries the ``x-ratelimit-*`` headers; a failed one after its
    admission (counted in the window as much) carried none."""
    from gateway.errors import from_run_error

    run = Run(spec(), run_world.caller())
    identity = await started(run_world, run)
    failure = GenerateDelta(
        "run-1-0", "", [], finish_reason=FinishReason.ERROR, error=ErrorCode.ENGINE_ERROR
    )
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [failure])
    with pytest.raises(RunError) as raised:
        async for _ in run.deltas():
            pass
    await run.aclose(raised.value)

    response = from_run_error(raised.value).response()
    assert response["x-ratelimit-limit-requests"] == "60"
    assert response["x-ratelimit-remaining-requests"] == "59"
    assert response["x-ratelimit-limit-tokens"] == "10000"
    assert response["x-request-id"] == "run-1"


@pytest.mark.tenant_limits(max_concurrent_requests=1)
async def test_the_engine_lost_mid_stream(run_world, monkeypatch):  # noqa: F811
    monkeypatch.setattr(runs, "FINAL_USAGE_TIMEOUT_SECONDS", 0.2)
    run = Run(spec(), run_world.caller())
    await started(run_world, run)
    deltas = run.deltas()
    await anext(deltas)
    run_world.fake.close()  # the engine dies
    with pytest.raises(RunError) as raised:
        await asyncio.wait_for(anext(deltas), timeout=20)
    await run.aclose(raised.value)

    assert (raised.value.code, raised.value.retry_after) == ("engine_unavailable", 5)
    assert run_world.deployment.endpoints[0] not in raised.value.message
    assert raised.value.request_id == "run-1"
    record = await record_of(run_world)
    assert (record.status, record.error_code, record.completion_tokens) == (
        "error",
        "engine_unavailable",
        1,
    )


async def test_no_ready_replica_is_refused_with_nothing_recorded(run_world):  # noqa: F811
    run_world.fake.is_answering = False  # STATS go unanswered
    run = Run(spec(), run_world.caller())
    with pytest.raises(RunError) as refused:
        await run.start()
    assert (refused.value.code, refused.value.retry_after) == ("engine_unavailable", 5)
    assert refused.value.request_id is None
    assert await run_world.records() == []


@pytest.mark.parametrize(
    "failure",
    [
        RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        OperationalError("connection to server at 127.0.0.1, port 5432 failed"),
    ],
)
async def test_an_admission_the_cache_or_database_cannot_make_is_a_503_to_retry(
    run_world,  # noqa: F811
    monkeypatch,
    failure,
):
    """Redis (or PostgreSQL) unreachable as a request is admitted: it was a 500
    server_error, naming nothing, with no word on when to try again."""

    def unreachable(**kwargs):
        raise failure

    monkeypatch.setattr(quotas, "admission_acquire", unreachable)
    run = Run(spec(), run_world.caller())
    with pytest.raises(RunError) as refused:
        await run.start()
    assert (refused.value.code, refused.value.retry_after) == ("service_unavailable", 5)
    assert "6379" not in refused.value.message and "5432" not in refused.value.message
    assert refused.value.request_id is None
    assert await run_world.records() == []


@pytest.mark.tenant_limits(max_concurrent_requests=4)
async def test_a_fanned_out_run_counts_each_sequence_against_concurrency(run_world):  # noqa: F811
    with pytest.raises(RunError) as refused:
        await Run(spec("run-5", n=5), run_world.caller()).start()
    assert refused.value.code == "request_too_large"
    assert "Limit 4, Requested 5 sequences" in refused.value.message

    four = Run(spec("run-4", n=4), run_world.caller())
    starting = asyncio.create_task(four.start())
    sent = [await run_world.fake.generates.get() for _ in range(4)]
    for identity, request in sent:
        done = GenerateDelta(request.request_id, "", [], finish_reason=FinishReason.STOP)
        await run_world.fake.send(identity, ResponseType.OUTPUTS, [done])
    await starting
    with pytest.raises(RunError) as refused:
        await Run(spec("run-1"), run_world.caller()).start()
    assert refused.value.code == "rate_limit_exceeded"

    await four.aclose()
    await assert_released(run_world)


async def _answer_aborts(run_world, identity: bytes, completion_tokens: dict[str, int]) -> None:  # noqa: F811
    """The engine's answer to each abort: the request's last delta, with what it computed."""
    answered: set[str] = set()
    while True:
        for request_id in run_world.fake.aborted():
            if request_id not in answered:
                answered.add(request_id)
                usage = Usage(prompt_tokens=3, completion_tokens=completion_tokens[request_id])
                final = GenerateDelta(
                    request_id, "", [], finish_reason=FinishReason.ABORT, usage=usage
                )
                await run_world.fake.send(identity, ResponseType.OUTPUTS, [final])
        await asyncio.sleep(0.01)


@pytest.mark.tenant_limits(max_concurrent_requests=2)
async def test_a_run_cut_while_waiting_for_its_choices_meters_a_choice_already_finished(
    run_world,  # noqa: F811
):
    """n=2: choice 0 ends on its first token (max_tokens=1), choice 1 waits in the engine's
    queue, and the client leaves before the response starts. Choice 0's token and the prompt
    were taken from the engine and thrown away, unmetered."""
    run = Run(spec(n=2, max_tokens=1), run_world.caller())
    starting = asyncio.create_task(run.start())
    (identity, first), _ = [await run_world.fake.generates.get() for _ in range(2)]
    only = GenerateDelta(
        first.request_id,
        "x",
        [5],
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=3, completion_tokens=1),
    )
    await run_world.fake.send(identity, ResponseType.OUTPUTS, [only])
    await asyncio.sleep(0.1)
    answering = asyncio.create_task(_answer_aborts(run_world, identity, {"run-1-1": 0}))
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    answering.cancel()

    record = await record_of(run_world)
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("cancelled", 3, 1)
    assert run_world.fake.aborted() == ["run-1-1"]


@pytest.mark.tenant_limits(max_concurrent_requests=2)
async def test_a_stream_of_choices_cut_meters_the_deltas_it_received_and_did_not_read(
    run_world,  # noqa: F811
):
    """n=2: the engine's frame with choice 1's next token and choice 0's last arrives as the
    client leaves. Choice 0's last delta was received and waiting to be read, its stream
    done: its token was never metered."""
    run = Run(spec(n=2), run_world.caller())
    starting = asyncio.create_task(run.start())
    (identity, _), _ = [await run_world.fake.generates.get() for _ in range(2)]
    firsts = [GenerateDelta(f"run-1-{i}", "a", [1], usage=Usage(prompt_tokens=3)) for i in range(2)]
    await run_world.fake.send(identity, ResponseType.OUTPUTS, firsts)
    await starting
    deltas = run.deltas()
    assert [(await anext(deltas))[1].token_ids for _ in range(2)] == [[1], [1]]
    reading = asyncio.create_task(anext(deltas))
    await asyncio.sleep(0.05)
    last = GenerateDelta("run-1-0", "c", [2], finish_reason=FinishReason.LENGTH)
    await run_world.fake.send(
        identity, ResponseType.OUTPUTS, [GenerateDelta("run-1-1", "b", [2]), last]
    )
    choice, delta = await reading  # choice 1's token; choice 0's last waits behind it
    assert (choice.index, delta.token_ids) == (1, [2])
    await asyncio.sleep(0.05)
    answering = asyncio.create_task(_answer_aborts(run_world, identity, {"run-1-1": 2}))
    await deltas.aclose()
    await run.aclose(asyncio.CancelledError())
    answering.cancel()

    record = await record_of(run_world)
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("cancelled", 3, 4)
    assert run_world.fake.aborted() == ["run-1-1"]


@pytest.mark.tenant_limits(max_concurrent_requests=2)
async def test_an_engine_error_on_one_choice_aborts_the_others_and_meters_what_they_made(
    run_world,  # noqa: F811
):
    """n=2: choice 0 fails in the engine while choice 1 generates. The merge of their streams
    was left open as the error went up: its pumps kept reading choice 1, whose stream then
    could not be closed, so no ABORT went out and choice 1's tokens went unmetered (until the
    garbage collector happened to close it)."""
    run = Run(spec(n=2, max_tokens=100), run_world.caller())
    starting = asyncio.create_task(run.start())
    (identity, _), _ = [await run_world.fake.generates.get() for _ in range(2)]
    firsts = [GenerateDelta(f"run-1-{i}", "a", [1], usage=Usage(prompt_tokens=3)) for i in range(2)]
    await run_world.fake.send(identity, ResponseType.OUTPUTS, firsts)
    await starting
    failed = GenerateDelta(
        "run-1-0", "", [], finish_reason=FinishReason.ERROR, error=ErrorCode.ENGINE_ERROR
    )
    await run_world.fake.send(
        identity, ResponseType.OUTPUTS, [GenerateDelta("run-1-1", "b", [2]), failed]
    )
    answering = asyncio.create_task(_answer_aborts(run_world, identity, {"run-1-1": 50}))
    caught = None
    try:
        async for _ in run.deltas():
            pass
    except RunError as exc:
        caught = exc
        held = exc  # the caller holds the error (as the gateway's answer does) as it closes
        await run.aclose(held)
    answering.cancel()
    assert caught is not None and caught.code == "engine_error"
    assert run_world.fake.aborted() == ["run-1-1"]
    record = await record_of(run_world)
    assert (record.status, record.prompt_tokens, record.completion_tokens) == ("error", 3, 51)
