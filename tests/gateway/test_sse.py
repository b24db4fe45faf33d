"""Server-sent events of one run against a fake engine: what goes out in which write, and
what a whole response and its stream say for the same engine output."""

import asyncio
import json

import msgspec
import pytest

from gateway import schemas
from gateway.errors import ApiError
from gateway.responses import Responder
from gateway.validation import plan_chat, plan_completion
from inference_engine.protocol import (
    FinishReason,
    GenerateDelta,
    ResponseType,
    TokenLogprobs,
    Usage,
)
from serving import runs, settlement
from serving.runs import Run, RunSpec
from tests.serving.fake_runs import run_world  # noqa: F401  (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def _responder(kind: str, plan, world, response_id: str) -> Responder:
    """The responder of a run of model "m" for ``plan``, one engine request per choice."""
    spec = RunSpec(
        request_id=response_id,
        requests=plan.engine_requests(response_id),
        prompt_tokens=plan.prompt_tokens,
        choices_per_prompt=plan.n,
    )
    return Responder(kind=kind, plan=plan, run=Run(spec, world.caller()), model="m")


async def _started_chat(world, response_id: str, **delta) -> Responder:
    """A streamed chat's responder, its run started on a first delta of "hi" (with the
    fields ``delta`` adds to it)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    responder = _responder("chat", plan_chat(json.dumps(body).encode()), world, response_id)
    request_id = responder.run.spec.requests[0].request_id
    starting = asyncio.create_task(responder.run.start())
    identity, _ = await world.fake.generates.get()
    first = GenerateDelta(request_id, "hi", [1], usage=Usage(prompt_tokens=3), **delta)
    await world.fake.send(identity, ResponseType.OUTPUTS, [first])
    await starting
    return responder


def _events(write: bytes) -> list:
    assert write.endswith(b"\n\n")
    return [
        event[6:] if event == b"data: [DONE]" else json.loads(event[6:])
        for event in write.split(b"\n\n")[:-1]
    ]


async def test_ready_events_share_a_write(run_world):  # noqa: F811
    fake = run_world.fake
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plan = plan_chat(json.dumps(body).encode())
    responder = _responder("chat", plan, run_world, "chatcmpl-1")
    requests = responder.run.spec.requests
    request_id = requests[0].request_id
    starting = asyncio.create_task(responder.run.start())
    identity, _ = await fake.generates.get()
    usage = Usage(prompt_tokens=3)
    await fake.send(
        identity, ResponseType.OUTPUTS, [GenerateDelta(request_id, "Hel", [1], usage=usage)]
    )
    await starting
    writes = responder.sse()

    # the role chunk goes out with the first token
    first = _events(await anext(writes))
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
    ]

    # tokens that queued up while nobody read go out together, each its own event
    frame = [GenerateDelta(request_id, text, [i]) for i, text in enumerate("lo!", start=2)]
    await fake.send(identity, ResponseType.OUTPUTS, frame)
    while responder.run.num_ready() < 3:  # all three arrive before the next read
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
    await responder.run.aclose()


async def test_a_stream_whose_settlement_fails_still_ends(run_world, monkeypatch):  # noqa: F811
    """The usage record could not be written (the database refused it): the stream raised
    from its last step, after [DONE], and the response was never ended, so the client hung.
    The failure goes to the log; the stream ends."""
    from gateway.handling import GenerationStreamResponse

    responder = await _started_chat(run_world, "chatcmpl-9", finish_reason=FinishReason.STOP)

    async def refused(group):
        raise RuntimeError("the database refused the record")

    monkeypatch.setattr(settlement, "_settle_group", refused)
    writes = [write async for write in GenerationStreamResponse(responder)._events()]
    assert _events(writes[-1])[-1] == b"[DONE]"


async def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event(
    run_world,  # noqa: F811
    monkeypatch,
):
    """An exception other than the run's own raised out of the events after the response
    had started: the server could no longer answer 500, and the response never ended."""
    from gateway.handling import GenerationStreamResponse

    responder = await _started_chat(run_world, "chatcmpl-8")

    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(responder, "_text_event", broken)
    monkeypatch.setattr(runs, "FINAL_USAGE_TIMEOUT_SECONDS", 0.2)  # the fake answers no abort
    writes = [write async for write in GenerationStreamResponse(responder)._events()]

    error = _events(writes[-1])[-1]
    assert error["error"]["type"] == "server_error"
    assert "recursion" not in json.dumps(error)  # what failed is the log's, not the client's
    [record] = await run_world.records()
    assert (record.status, record.error_code) == ("error", "internal_error")


# quotes, escapes, control characters, non-ASCII, the templates' own placeholder character
AWKWARD_TEXTS = ['say "hi"', "back\\slash", "line\nbreak\t", "\x00\x1f", "héllo 世界 🙂", "\ue000"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_text_events_are_exactly_the_encoded_response_objects(
    run_world,  # noqa: F811
    kind,
    monkeypatch,
):
    """Plain text events are cut from a template (the response's fixed fields encoded
    once): each must be byte for byte the encoding of the whole chunk object."""
    monkeypatch.setattr(runs, "FINAL_USAGE_TIMEOUT_SECONDS", 0.2)  # left open: nobody answers
    fake = run_world.fake
    body = {"model": "m", "stream": True, "n": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        plan = plan_chat(json.dumps(body).encode())
    else:
        body["prompt"] = "hi"
        plan = plan_completion(json.dumps(body).encode())
    responder = _responder(kind, plan, run_world, "resp-1")
    requests = responder.run.spec.requests
    starting = asyncio.create_task(responder.run.start())
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
    writes = responder.sse()
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
                created=responder.created,
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
                created=responder.created,
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
    await writes.aclose()
    await responder.run.aclose()


async def _started(
    kind: str, body: dict, world, delta: GenerateDelta, *, stream: bool
) -> Responder:
    """The responder to ``body``, its run started on the fake engine's answer to its one
    request: ``delta`` (its last)."""
    parse = plan_chat if kind == "chat" else plan_completion
    plan = parse(json.dumps({"model": "m", **body, "stream": stream}).encode())
    responder = _responder(kind, plan, world, "resp-1")
    starting = asyncio.create_task(responder.run.start())
    identity, request = await world.fake.generates.get()
    delta.request_id = request.request_id
    await world.fake.send(identity, ResponseType.OUTPUTS, [delta])
    await starting
    return responder


async def _answer(kind: str, body: dict, world, delta: GenerateDelta, *, stream: bool) -> list:
    """The choices of the response to ``body`` when the fake engine answers its one request
    with ``delta`` (its last): the whole response's, or the choices of every streamed event."""
    responder = await _started(kind, body, world, delta, stream=stream)
    try:
        if not stream:
            return json.loads(msgspec.json.encode(await responder.complete()))["choices"]
        events = _events(b"".join([write async for write in responder.sse()]))
        return [choice for event in events[:-1] for choice in event["choices"]]
    finally:
        await responder.run.aclose()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tool_choice", "text", "finish"),
    [
        # vLLM and OpenAI: "tool_calls" for auto or required calls, "stop" for a named one
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}', "stop"),
        ("required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "tool_calls"),
    ],
)
async def test_a_named_tool_call_finishes_with_stop(
    run_world,  # noqa: F811
    tool_choice,
    text,
    finish,
    stream,
):
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": tool_choice,
    }
    delta = GenerateDelta(
        "", text, [1, 2], finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=3)
    )
    choices = await _answer("chat", body, run_world, delta, stream=stream)
    if stream:
        calls = [c for choice in choices for c in choice["delta"].get("tool_calls", [])]
    else:
        calls = choices[0]["message"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather"  # the call was read
    assert choices[-1]["finish_reason"] == finish


@pytest.mark.parametrize(
    ("text", "first_delta"),
    [
        # OpenAI's: a call's first chunk has no content, and carries the call's opening
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            {"role": "assistant", "tool_calls": [{"index": 0, "type": "function"}]},
        ),
        ("Sunny.", {"role": "assistant", "content": ""}),  # text: its first chunk as ever
        ("", {"role": "assistant", "content": ""}),
    ],
)
async def test_an_auto_mode_stream_opens_with_content_only_where_it_is_text(
    run_world,  # noqa: F811
    monkeypatch,
    text,
    first_delta,
):
    """The role chunk went out before the reader knew what the reply was: a call opened with
    ``content: ""``, which the SDK's accumulated message kept (unstreamed: null)."""
    from serving.pool import EnginePool

    async def hermes(self, endpoints):
        return "hermes"

    monkeypatch.setattr(EnginePool, "tool_call_parser", hermes)
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL]}
    delta = GenerateDelta(
        "", text, [1, 2], finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=3)
    )
    choices = await _answer("chat", body, run_world, delta, stream=True)

    first = choices[0]["delta"]
    assert {k: v for k, v in first.items() if k != "tool_calls"} == {
        k: v for k, v in first_delta.items() if k != "tool_calls"
    }
    if "tool_calls" in first_delta:
        [call] = first["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert sum("role" in choice["delta"] for choice in choices) == 1
    assert all("content" not in c["delta"] for c in choices) == ("tool_calls" in first_delta)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("logprobs", "entries", "top_logprobs"),
    [
        (
            0,
            [TokenLogprobs(-0.7, token=" a"), TokenLogprobs(-1.5, token=" b")],
            [{" a": -0.7}, {" b": -1.5}],
        ),
        (
            1,
            [
                # sampled outside the top 1, among it, and a token of another id that
                # decodes to the same text as the top one
                TokenLogprobs(-3.0, [7], [-0.5], token=" a", top_tokens=[" x"]),
                TokenLogprobs(-0.2, [8], [-0.2], token=" b", top_tokens=[" b"]),
                TokenLogprobs(-2.0, [9], [-0.1], token=" c", top_tokens=[" c"]),
            ],
            [{" a": -3.0, " x": -0.5}, {" b": -0.2}, {" c": -2.0}],
        ),
    ],
)
async def test_a_completions_top_logprobs_always_hold_the_sampled_token(
    run_world,  # noqa: F811
    logprobs,
    entries,
    top_logprobs,
    stream,
):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; vLLM does the same."""
    text = "".join(entry.token for entry in entries)
    token_ids = list(range(1, len(entries) + 1))
    delta = GenerateDelta(
        "",
        text,
        token_ids,
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=3),
        logprobs=entries,
    )
    body = {"prompt": "hi", "logprobs": logprobs}
    choices = await _answer("completion", body, run_world, delta, stream=stream)
    tops = [
        top
        for choice in choices
        if choice["logprobs"]
        for top in choice["logprobs"]["top_logprobs"]
    ]
    assert tops == top_logprobs


async def test_a_whole_answer_whose_settlement_fails_is_still_given(run_world, monkeypatch):  # noqa: F811
    """The usage record could not be written after the engine had answered in full: the
    client got a 500 for an answer that was there (the stream's path gives it)."""
    from asgiref.sync import sync_to_async

    from tenants import services as tenant_services
    from tests.asgi_client import asgi_request
    from tests.gateway.test_metering_status import _answering

    _, raw_key = await sync_to_async(tenant_services.api_key_create)(
        tenant=run_world.tenant, name="http"
    )

    async def refused(group):
        raise RuntimeError("the database refused the record")

    monkeypatch.setattr(settlement, "_settle_group", refused)

    answering = asyncio.create_task(_answering(run_world.fake))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, headers, content = await asgi_request(
        "POST",
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {raw_key}", "content-type": "application/json"},
        body=json.dumps(body).encode(),
    )
    answering.cancel()

    assert status == 200, content
    assert json.loads(content)["choices"][0]["message"]["content"] == "a"


def _prompt_entries(tokens: list[str]) -> list[TokenLogprobs]:
    """An engine's prompt logprobs: the first token's entry its text alone."""
    return [TokenLogprobs(0.0, token=tokens[0], token_bytes=tokens[0].encode())] + [
        TokenLogprobs(-1.0 - i, [7], [-0.5], token=t, top_tokens=["x"], token_bytes=t.encode())
        for i, t in enumerate(tokens[1:])
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_echos_choices_share_the_prompt_the_first_choice_asked_for(
    run_world,  # noqa: F811
    stream,
):
    """Every choice of a prompt asked the engine for its logprobs, and each computed the
    whole prompt again (no prefix cache for them): n times the work for one answer."""
    body = {"model": "m", "prompt": [5, 6, 7], "echo": True, "logprobs": 1, "n": 2}
    plan = plan_completion(json.dumps({**body, "stream": stream}).encode())
    responder = _responder("completion", plan, run_world, f"cmpl-echo-{stream}")
    starting = asyncio.create_task(responder.run.start())
    received = [await run_world.fake.generates.get() for _ in range(2)]
    asked = sorted(received, key=lambda item: item[1].request_id)
    assert [r.params.prompt_logprobs for _, r in asked] == [1, None]
    assert [r.return_prompt_text for _, r in asked] == [True, False]
    for index, (identity, request) in enumerate(asked):
        extra = (
            {"prompt_text": "a b c", "prompt_logprobs": _prompt_entries(["a", " b", " c"])}
            if index == 0
            else {}
        )
        entry = TokenLogprobs(-0.25, [9], [-0.25], token="!", top_tokens=["!"], token_bytes=b"!")
        delta = GenerateDelta(
            request.request_id,
            "!",
            [9],
            finish_reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=3, completion_tokens=1),
            logprobs=[entry],
            **extra,
        )
        await run_world.fake.send(identity, ResponseType.OUTPUTS, [delta])
    await starting
    try:
        if stream:
            events = _events(b"".join([write async for write in responder.sse()]))
            choices = [c for event in events[:-1] for c in event["choices"]]
        else:
            choices = json.loads(msgspec.json.encode(await responder.complete()))["choices"]
    finally:
        await responder.run.aclose()
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["text"] for c in mine) == "a b c!"
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        logprobs = [x for c in mine if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        offsets = [x for c in mine if c["logprobs"] for x in c["logprobs"]["text_offset"]]
        assert tokens == ["a", " b", " c", "!"]
        assert logprobs == [None, -1.0, -2.0, -0.25]
        assert offsets == [0, 1, 3, 5]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_that_ignores_an_echos_prompt_logprobs_is_an_error_not_a_wrong_answer(
    run_world,  # noqa: F811
    stream,
):
    """An engine older than the web tier drops the fields it does not know: the echo came
    back without the prompt's logprobs, and evaluation harnesses scored the wrong tokens."""
    delta = GenerateDelta(
        "", "!", [9], finish_reason=FinishReason.LENGTH, usage=Usage(prompt_tokens=3)
    )
    body = {"prompt": "a b c", "echo": True, "logprobs": 1}
    if not stream:
        with pytest.raises(ApiError) as raised:
            await _answer("completion", body, run_world, delta, stream=False)
        assert raised.value.status == 501 and raised.value.param == "echo"
        return
    responder = await _started("completion", body, run_world, delta, stream=True)
    try:
        events = _events(b"".join([write async for write in responder.sse()]))
    finally:
        await responder.run.aclose()
    assert [event["error"]["code"] for event in events] == ["echo_unsupported"]
    assert responder.run.meter.error_code == "echo_unsupported"
