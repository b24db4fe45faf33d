"""The API end to end with the official openai SDK against a live Daphne and engine."""

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from serving.services import deployment_register
from tenants import services
from tenants.models import Plan, UsageRecord
from tests.gateway.conftest import MAX_MODEL_LEN, MODEL_NAME, Daphne, Engine, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def _greedy_chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, **kwargs
    )


def test_chat_completion_with_the_sync_client(platform):
    completion = _greedy_chat(platform.client(), max_tokens=8)

    assert completion.object == "chat.completion"
    assert completion.model == MODEL_NAME
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0
    [record] = platform.records()
    assert record.request_id == completion.id
    assert (record.prompt_tokens, record.completion_tokens) == (completion.usage.prompt_tokens, 8)
    assert record.status == "ok" and record.source == "api"
    assert record.time_to_first_token_ms is not None and record.latency_ms > 0


async def test_streamed_chat_matches_the_whole_one_with_the_async_client(async_db, platform):
    client = platform.async_client()
    whole = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=12
    )
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    await client.close()

    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_with_n_and_stop(platform):
    client = platform.client()
    greedy = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=16, temperature=0
    )
    text = greedy.choices[0].text
    assert greedy.object == "text_completion" and len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]

    stopped = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=16, temperature=0, stop=[stop], n=2
    )
    assert len(stopped.choices) == 2
    for choice in stopped.choices:
        assert choice.finish_reason == "stop"
        assert stop not in choice.text and text.startswith(choice.text)

    sampled = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=6, n=3, seed=7, stream=True
    )
    by_index: dict[int, str] = {}
    for chunk in sampled:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert sorted(by_index) == [0, 1, 2]
    # the stream's record is written as the stream closes, just after [DONE]
    wait_until(lambda: len(platform.records()) == 3, 10, "the streamed request's record")
    assert platform.records()[-1].completion_tokens == 18


def test_logprobs_chat_and_completions(platform):
    client = platform.client()
    chat = _greedy_chat(client, max_tokens=6, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    # the tokens' bytes spell the content (a random model writes broken UTF-8: U+FFFD there,
    # "bytes:\\x.." in a token that holds part of a character)
    spelled = bytes(byte for entry in content for byte in entry.bytes)
    assert spelled.decode(errors="replace") == chat.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        if not entry.token.startswith("bytes:"):
            assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token

    stream = _greedy_chat(client, max_tokens=6, logprobs=True, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]

    completion = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    # the top 3 and the sampled token (greedy: among them); equal texts merge
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(completion.choices[0].text)
    whole = [token for token in logprobs.tokens if not token.startswith("bytes:")]
    assert all(token in completion.choices[0].text for token in whole)
    plain = _greedy_chat(client, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_scores_a_prompt_as_lm_evaluation_harness_asks(platform):
    """lm-evaluation-harness scores a continuation with ``echo``, ``logprobs`` and
    ``max_tokens`` 0 or 1: the prompt's tokens and their logprobs come before the completion's,
    the first with none. A token's logprob as a prompt token is its logprob when drawn."""
    client = platform.client()
    prompt = [17, 42, 99, 7, 250]
    # the token drawn is 123 (the bias); its logprob is the raw logits', as a prompt token's
    scoring = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logprobs=1,
        echo=True,
        logit_bias={"123": 100},
    )
    drawn = client.completions.create(**scoring)
    choice = drawn.choices[0]
    entries = choice.logprobs
    assert len(entries.tokens) == len(prompt) + 1
    assert entries.token_logprobs[0] is None and entries.top_logprobs[0] is None
    assert all(logprob <= 0 for logprob in entries.token_logprobs[1:])
    assert entries.text_offset == sorted(entries.text_offset) and entries.text_offset[0] == 0
    assert drawn.usage.prompt_tokens == len(prompt) and drawn.usage.completion_tokens == 1
    scored = client.completions.create(
        model=MODEL_NAME, prompt=[*prompt, 123], max_tokens=0, echo=True, logprobs=1
    )
    scored_choice = scored.choices[0]
    assert scored_choice.text == choice.text  # the prompt alone: nothing generated shown
    assert scored_choice.finish_reason == "length"
    assert scored_choice.logprobs.token_logprobs[1:] == pytest.approx(
        entries.token_logprobs[1:], abs=1e-4
    )

    text = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=3, temperature=0, echo=True
    )
    assert text.choices[0].text.startswith("hello world")
    assert text.choices[0].logprobs is None
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="hello world",
        max_tokens=3,
        temperature=0,
        echo=True,
        n=2,
        stream=True,
    )
    by_index: dict[int, str] = {}
    for chunk in stream:
        for each in chunk.choices:
            by_index[each.index] = by_index.get(each.index, "") + each.text
    assert by_index == {0: text.choices[0].text, 1: text.choices[0].text}
    streamed_logprobs = client.completions.create(**scoring, stream=True)
    tokens, token_logprobs = [], []
    for chunk in streamed_logprobs:
        for each in chunk.choices:
            if each.logprobs is not None:
                tokens += each.logprobs.tokens
                token_logprobs += each.logprobs.token_logprobs
    assert tokens == entries.tokens
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(entries.token_logprobs[1:], abs=1e-5)
    wait_until(lambda: len(platform.records()) == 5, 20, "every request's record")
    assert [r.completion_tokens for r in platform.records()] == [1, 1, 3, 6, 1]


@pytest.mark.parametrize(("logprobs", "temperature"), [(0, 0.0), (1, 2.0)])
def test_completions_top_logprobs_hold_the_sampled_token(platform, logprobs, temperature):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; a hot sample often picks a token outside the top one."""
    completion = platform.client().completions.create(
        model=MODEL_NAME,
        prompt="hello world",
        max_tokens=24,
        temperature=temperature,
        seed=7,
        logprobs=logprobs,
    )
    entries = completion.choices[0].logprobs
    positions = zip(entries.tokens, entries.token_logprobs, entries.top_logprobs, strict=True)
    assert entries.tokens
    for token, logprob, top in positions:
        assert top[token] == logprob and 1 <= len(top) <= logprobs + 1


def test_completions_without_max_tokens_stop_at_16_and_a_chat_at_the_context(platform):
    """OpenAI's legacy Completions API and vLLM default max_tokens to 16; a chat goes on to
    the context."""
    client = platform.client()
    completion = client.completions.create(
        model=MODEL_NAME, prompt="hello world", extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"
    chat = _greedy_chat(client, extra_body={"ignore_eos": True})
    assert chat.usage.total_tokens == MAX_MODEL_LEN


def test_an_array_of_token_arrays_is_one_prompt_each(platform):
    completion = platform.client().completions.create(
        model=MODEL_NAME, prompt=[[10, 11, 12], [20, 21]], max_tokens=2, temperature=0, n=2
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    alone = platform.client().completions.create(
        model=MODEL_NAME, prompt=[20, 21], max_tokens=2, temperature=0
    )
    assert completion.choices[2].text == alone.choices[0].text
    assert completion.usage.prompt_tokens == 3 + 2  # each prompt once, whatever n


def test_models_are_listed_per_plan(platform):
    models = platform.client().models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert platform.client().models.retrieve(MODEL_NAME).id == MODEL_NAME

    closed = Plan.objects.create(slug="closed", name="Closed", allowed_models=["other"])
    other = services.tenant_create(slug="globex", plan=closed)
    _, other_key = services.api_key_create(tenant=other, name="k")
    assert platform.client(other_key).models.list().data == []
    with pytest.raises(openai.NotFoundError):
        platform.client(other_key).models.retrieve(MODEL_NAME)
    with pytest.raises(openai.NotFoundError) as refused:
        _greedy_chat(platform.client(other_key), max_tokens=2)
    assert refused.value.code == "model_not_found"


def test_errors_arrive_as_the_sdks_exceptions(platform):
    with pytest.raises(openai.AuthenticationError):
        _greedy_chat(platform.client("sk-" + "x" * 48), max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        platform.client().chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as bad:
        _greedy_chat(platform.client(), max_tokens=2, top_p=7)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as too_long:
        platform.client().completions.create(
            model=MODEL_NAME, prompt=list(range(1, MAX_MODEL_LEN + 10)), max_tokens=2
        )
    assert too_long.value.code == "context_length_exceeded"

    api_key, _ = services.api_key_create(tenant=platform.tenant, name="x")
    services.api_key_revoke(api_key=api_key)
    platform.tenant.is_active = False
    platform.tenant.save()
    with pytest.raises(openai.PermissionDeniedError):
        _greedy_chat(platform.client(), max_tokens=2)


def test_a_prompt_and_max_tokens_that_cannot_both_fit_are_refused_not_cut_short(platform):
    """As OpenAI and vLLM answer: 400 context_length_exceeded, saying how many of each. They
    were served and cut short at the context with finish_reason "length"."""
    client = platform.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=list(range(10, 210)), max_tokens=100)
    assert refused.value.code == "context_length_exceeded"
    assert "300 tokens (200 in the messages, 100 in the completion)" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        _greedy_chat(client, max_tokens=MAX_MODEL_LEN - 2)
    assert refused.value.code == "context_length_exceeded"
    assert platform.records() == [] or {r.status for r in platform.records()} == {"rejected"}


def test_a_deployments_own_context_length_holds_as_the_engines_does(platform):
    """``max_context`` (what /v1/models says) bounds the prompt and the completion together:
    a longer prompt was served, and a completion without max_tokens ran to the engine's 256."""
    deployment_register(name=MODEL_NAME, endpoints=[platform.engine.endpoint], max_context=64)
    client = platform.client()
    assert client.models.retrieve(MODEL_NAME).model_extra["max_model_len"] == 64
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=list(range(10, 110)), max_tokens=4)
    assert refused.value.code == "context_length_exceeded" and "is 64 tokens" in str(refused.value)
    unbounded = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert unbounded.usage.total_tokens == 64


@pytest.mark.parametrize(
    "content_type", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded"]
)
def test_a_body_that_claims_to_be_a_form_gets_the_apis_error(platform, content_type):
    """The server hands every body to the application untouched (Twisted's own form parsing
    is off): a body that is not the form it claims to be gets OpenAI's error object, not a
    bare 400 and a dropped connection."""
    headers = {"Authorization": f"Bearer {platform.key}", "Content-Type": content_type}
    with httpx.Client(base_url=platform.base, timeout=30) as http:
        response = http.post("/v1/chat/completions", content=b"--y\r\nnot a form", headers=headers)
        assert response.status_code == 415
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and error["type"]


def test_rate_limit_arrives_as_rate_limit_error_with_headers(platform):
    platform.tenant.requests_per_minute = 1
    platform.tenant.save()
    client = platform.client(max_retries=0)
    _greedy_chat(client, max_tokens=2)

    with pytest.raises(openai.RateLimitError) as refused:
        _greedy_chat(client, max_tokens=2)
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert len(platform.records()) == 1


@pytest.mark.parametrize("limit", ["tokens_per_minute", "monthly_token_budget"])
@pytest.mark.parametrize("tokens", [MAX_MODEL_LEN - 56, MAX_MODEL_LEN + 44])
def test_chats_without_max_tokens_are_served_under_a_limit_below_the_context(
    platform, limit, tokens
):
    """A chat without max_tokens may run to the context (256 here). It was counted as the
    whole context: refused for good under a limit of 200 ("Requested 256"), and under 300
    refused (429) after any other request of the minute, as it held the whole limit. The
    monthly budget held it whole until later still: refused "until next month" with nothing
    used."""
    setattr(platform.tenant, limit, tokens)
    platform.tenant.save()
    client = platform.client(max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages)
    assert first.usage.completion_tokens == 4 and second.usage.completion_tokens > 0
    assert len(platform.records()) == 2


def test_a_client_disconnect_aborts_the_engine_and_is_metered_once(platform):
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": MAX_MODEL_LEN - 40,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {platform.key}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST", f"{platform.base}/v1/chat/completions", json=body, headers=headers
        ) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 3:
                break

    wait_until(lambda: len(platform.records()) == 1, 30, "the usage record")
    [record] = platform.records()
    assert record.status == "cancelled"
    assert 0 < record.completion_tokens < MAX_MODEL_LEN - 40
    assert record.prompt_tokens > 0  # the first delta already carried the prompt's count
    wait_until(lambda: platform.engine.wait_ready().num_requests_running == 0, 30, "an abort")
    time.sleep(0.5)
    assert len(platform.records()) == 1


def test_operations_endpoints(platform):
    ready = httpx.get(f"{platform.base}/health/ready", timeout=30)
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"]["models"].startswith("ok")
    assert MODEL_NAME not in ready.text  # anybody may ask: no model is named
    assert httpx.get(f"{platform.base}/health/live").json() == {"status": "ok"}

    _greedy_chat(platform.client(), max_tokens=2)
    metrics = httpx.get(f"{platform.base}/metrics").text
    # the live server is in production mode (it is given a DATABASE_URL) with no metrics
    # token: the tenant label is summed away
    assert 'llm_gateway_requests_total{model="tiny-llama",status="ok"}' in metrics
    assert 'tenant="' not in metrics
    assert "llm_gateway_time_to_first_token_seconds_bucket" in metrics

    spec = httpx.get(f"{platform.base}/v1/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    assert {"/chat/completions", "/completions", "/models"} <= set(spec["paths"])
    assert "max_completion_tokens" in json.dumps(spec["components"]["schemas"])


def test_usage_timestamps_are_recent(platform):
    _greedy_chat(platform.client(), max_tokens=2)
    [record] = platform.records()
    assert timezone.now() - record.finished_at < timezone.timedelta(minutes=1)


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL to share counters")
async def test_two_servers_sharing_redis_admit_exactly_the_limit(async_db, platform, tmp_path):
    await _set_rpm(platform.tenant, 20)
    second = await asyncio.to_thread(Daphne, tmp_path)
    try:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
        headers = {"Authorization": f"Bearer {platform.key}"}
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            responses = await asyncio.gather(
                *(
                    http.post(f"{base}/v1/completions", json=body, headers=headers)
                    for base in [platform.base, second.base] * 100
                )
            )
    finally:
        await asyncio.to_thread(second.stop)
    statuses = sorted(response.status_code for response in responses)
    assert statuses.count(200) == 20 and statuses.count(429) == 180


@sync_to_async
def _set_rpm(tenant, rpm: int) -> None:
    tenant.requests_per_minute = rpm
    tenant.save()


def test_a_finished_stream_frees_its_slot_before_the_client_sees_the_end(platform):
    platform.tenant.max_concurrent_requests = 1
    platform.tenant.save()
    client = platform.client(max_retries=0)
    for _ in range(5):  # each request starts the moment the previous stream ended
        stream = _greedy_chat(client, max_tokens=3, stream=True)
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
    # all five recorded, once each
    wait_until(lambda: len(platform.records()) == 5, 10, "the five records")
    assert all(record.completion_tokens == 3 for record in platform.records())


def test_one_tenant_cannot_spend_or_see_anothers(platform):
    other = services.tenant_create(slug="globex", plan=platform.tenant.plan, requests_per_minute=1)
    _, other_key = services.api_key_create(tenant=other, name="theirs")
    other_client = platform.client(other_key, max_retries=0)
    _greedy_chat(other_client, max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        _greedy_chat(other_client, max_tokens=2)

    # acme is untouched by globex's exhausted limit, and each sees only its own usage
    for _ in range(3):
        _greedy_chat(platform.client(), max_tokens=2)
    assert len(platform.records()) == 3
    assert UsageRecord.objects.filter(tenant=other).count() == 1


def test_an_engine_dying_mid_stream_ends_it_with_an_error_event(platform, tmp_path):
    doomed = Engine(platform.engine.model_dir, f"ipc://{tmp_path}/doomed.sock", tmp_path / "log")
    doomed.start()
    try:
        doomed.wait_ready()
        deployment_register(name="doomed", endpoints=[doomed.endpoint])
        body = {
            "model": "doomed",
            "prompt": "hello",
            "max_tokens": MAX_MODEL_LEN - 20,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {platform.key}"}
        events = []
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{platform.base}/v1/completions", json=body, headers=headers) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        doomed.stop(signal.SIGKILL)
    finally:
        doomed.stop(signal.SIGKILL)

    last = json.loads(events[-1])
    assert last["error"]["code"] == "engine_unavailable"
    assert "[DONE]" not in events
    wait_until(lambda: len(platform.records()) == 1, 30, "the usage record")
    [record] = platform.records()
    assert record.status == "error" and record.completion_tokens > 0
