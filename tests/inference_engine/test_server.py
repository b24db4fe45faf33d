"""The engine as a real subprocess (``python -m inference_engine``) on a tiny model, driven
through ``AsyncEngineClient`` and, for hostile input, a raw DEALER socket."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from inference_engine.client import AsyncEngineClient, EngineUnavailable
from inference_engine.protocol import (
    ControlRequest,
    ErrorCode,
    FinishReason,
    GenerateDelta,
    GenerateRequest,
    Message,
    RequestType,
    ResponseType,
    SamplingParams,
)
from tests.conftest import PYTHON, ROOT, subprocess_env
from tests.inference_engine.conftest import save_model, stop_spanning_tokens

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = [
    f"{word} {i}"
    for i, word in enumerate(
        ("the quick brown fox", "hello world", "paged attention", "one two three") * 16
    )
]
MAX_FRAME_BYTES = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    def __init__(self, model: str, folder: Path, *args: str) -> None:
        self.endpoint = f"ipc://{folder}/engine.sock"
        self.log_path = folder / "engine.log"
        self.command = [
            PYTHON,
            "-m",
            "inference_engine",
            "--model",
            model,
            "--endpoint",
            self.endpoint,
            "--dtype",
            "float32",
            *args,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> EngineProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command, env=subprocess_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running(engine: EngineProcess):
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def engine(llama_dir, tmp_path_factory, metrics_port):
    """The shared engine: default batch sizes, small frame limit, metrics on."""
    folder = tmp_path_factory.mktemp("engine")
    process = EngineProcess(
        llama_dir,
        folder,
        "--served-model-name",
        "tiny-llama",
        "--max-frame-bytes",
        str(MAX_FRAME_BYTES),
        "--metrics-port",
        str(metrics_port),
    )
    with running(process):
        yield process


@pytest.fixture(scope="module")
def small_engine(llama_dir, tmp_path_factory):
    """Two sequences at a time, two waiting at most, a second of shutdown grace."""
    folder = tmp_path_factory.mktemp("small-engine")
    process = EngineProcess(
        llama_dir,
        folder,
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "2",
        "--shutdown-grace-period",
        "1",
    )
    with running(process):
        yield process


@pytest.fixture(scope="module")
def async_engine(llama_dir, tmp_path_factory):
    """The next step scheduled while the one before runs (the default on a GPU only)."""
    folder = tmp_path_factory.mktemp("async-engine")
    with running(EngineProcess(llama_dir, folder, "--async-scheduling", "on")) as process:
        yield process


@pytest.fixture
async def client(engine):
    client = AsyncEngineClient(engine.endpoint)
    await client.wait_ready(timeout=90)
    yield client
    client.close()


async def collect(client: AsyncEngineClient, request: GenerateRequest) -> list[GenerateDelta]:
    return [delta async for delta in client.generate(request)]


def joined(deltas: list[GenerateDelta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


async def wait_for_stats(client: AsyncEngineClient, predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await client.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def test_64_concurrent_streams_match_llm_generate(client, llm_cache):
    expected = llm_cache("llama").generate(PROMPTS, GREEDY)
    results = await asyncio.gather(
        *(collect(client, GenerateRequest(prompt=p, params=GREEDY)) for p in PROMPTS)
    )
    for deltas, want in zip(results, expected, strict=True):
        last = deltas[-1]
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert joined(deltas) == (want.text, want.token_ids)
        assert str(last.finish_reason) == want.finish_reason == "length"
        assert last.usage.completion_tokens == len(want.token_ids)
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        timings = last.timings
        assert 0 < timings.arrival <= timings.first_scheduled <= timings.first_token
        assert timings.first_token <= timings.finished


async def test_chat_messages_and_logprobs_match_llm(client, llm_cache):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    [want] = llm_cache("llama").chat(messages, params)
    deltas = await collect(client, GenerateRequest(messages=messages, params=params))
    assert joined(deltas) == (want.text, want.token_ids)
    logprobs = [lp for d in deltas for lp in d.logprobs or []]
    assert [lp.top_token_ids for lp in logprobs] == [lp.top_token_ids for lp in want.logprobs]


async def test_the_first_delta_carries_the_prompt_its_text_and_logprobs(client, llm_cache):
    ids = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    [want] = llm_cache("llama").generate([ids], params)
    request = GenerateRequest(prompt_token_ids=ids, params=params, return_prompt_text=True)
    first, *rest = await collect(client, request)
    assert first.prompt_text == llm_cache("llama").tokenizer.decode(ids)
    assert [e.logprob for e in first.prompt_logprobs] == [e.logprob for e in want.prompt_logprobs]
    assert [e.token for e in first.prompt_logprobs] == [e.token for e in want.prompt_logprobs]
    assert all(d.prompt_logprobs is None and d.prompt_text is None for d in rest)
    plain = await collect(client, GenerateRequest(prompt_token_ids=ids, params=GREEDY))
    assert all(d.prompt_logprobs is None and d.prompt_text is None for d in plain)


async def test_stop_strings_are_cut_and_never_streamed(client, llm_cache):
    llm = llm_cache("llama")
    [full] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24))
    stop = full.text[6:9]
    assert len(stop) == 3 and stop in full.text
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never seen"])
    [want] = llm.generate(PROMPTS[1], params)
    deltas = await collect(client, GenerateRequest(prompt=PROMPTS[1], params=params))
    text, _ = joined(deltas)
    assert text == want.text == full.text[: full.text.index(stop)]
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert deltas[-1].usage.completion_tokens == len(joined(deltas)[1])


async def test_llm_generate_gives_exactly_what_the_server_streams(client, llm_cache):
    """``LLM`` and the server share one output processor: the same text, token ids, finish
    reason and usage for the same request, stop strings (cut or kept) included."""
    llm = llm_cache("llama")
    prompt = PROMPTS[0]
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [full] = llm.generate(prompt, base)
    spanning, _ = stop_spanning_tokens(llm.tokenizer, full.token_ids, full.text)
    variants = [
        base,
        msgspec.structs.replace(base, stop=[spanning]),
        msgspec.structs.replace(base, stop=[spanning], include_stop_str_in_output=True),
        msgspec.structs.replace(base, stop=["never seen", spanning]),
        msgspec.structs.replace(base, stop=["never seen"], include_stop_str_in_output=True),
    ]
    for params in variants:
        [want] = llm.generate(prompt, params)
        deltas = await collect(client, GenerateRequest(prompt=prompt, params=params))
        last = deltas[-1]
        assert joined(deltas) == (want.text, want.token_ids), params
        assert str(last.finish_reason) == want.finish_reason, params
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        assert last.usage.completion_tokens == len(want.token_ids)
    assert [llm.generate(prompt, p)[0].finish_reason for p in variants] == [
        "length",
        "stop",
        "stop",
        "stop",
        "length",
    ]


async def test_cancelled_stream_is_aborted_within_a_step_and_frees_blocks(client):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    request = GenerateRequest(prompt=PROMPTS[2], params=params)
    num_tokens = 0
    async with contextlib.aclosing(client.generate(request)) as stream:
        async for delta in stream:
            if num_tokens == 0:
                await client.abort(request.request_id)
            num_tokens += len(delta.token_ids)
            last = delta
    assert last.finish_reason == FinishReason.ABORT
    assert num_tokens <= 16  # one step is one token here; allows for the round trip
    assert last.usage.completion_tokens == num_tokens

    # leaving the loop early (here: cancelling the task) aborts in the engine too
    async def read_two():
        async for _ in client.generate(GenerateRequest(prompt=PROMPTS[3], params=params)):
            await asyncio.sleep(0)

    task = asyncio.create_task(read_two())
    await wait_for_stats(client, lambda s: s.num_requests_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_for_stats(
        client, lambda s: s.num_requests_running == 0 and s.kv_cache_usage == 0
    )
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    assert stats.kv_cache_usage == 0
    assert client.num_open_streams == 0


async def test_async_scheduling_streams_what_llm_gives_and_an_abort_frees_all(
    async_engine, llm_cache
):
    client = AsyncEngineClient(async_engine.endpoint)
    await client.wait_ready(timeout=90)
    try:
        expected = llm_cache("llama").generate(PROMPTS[:16], GREEDY)
        results = await asyncio.gather(
            *(collect(client, GenerateRequest(prompt=p, params=GREEDY)) for p in PROMPTS[:16])
        )
        for deltas, want in zip(results, expected, strict=True):
            assert joined(deltas) == (want.text, want.token_ids)
            assert deltas[-1].usage.completion_tokens == len(want.token_ids)

        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        request = GenerateRequest(prompt=PROMPTS[2], params=params)
        num_tokens = 0
        async for delta in client.generate(request):
            if num_tokens == 0:
                await client.abort(request.request_id)
            num_tokens += len(delta.token_ids)
            last = delta
        assert last.finish_reason == FinishReason.ABORT
        assert last.usage.completion_tokens == num_tokens < 400
        stats = await wait_for_stats(
            client, lambda s: s.num_requests_running == 0 and s.kv_cache_usage == 0
        )
        assert stats.kv_cache_usage == 0
    finally:
        client.close()


async def test_context_length_exceeded_and_invalid_requests(client):
    too_long = GenerateRequest(prompt_token_ids=[5] * 600, params=GREEDY)
    [delta] = await collect(client, too_long)
    assert delta.error == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert delta.finish_reason == FinishReason.ERROR and "512" in delta.error_message

    # as vLLM's server: a prompt and max_tokens that cannot both fit are refused, not cut short
    over = GenerateRequest(prompt_token_ids=[5] * 500, params=SamplingParams(max_tokens=13))
    [delta] = await collect(client, over)
    assert delta.error == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "513 tokens (500 in the messages, 13 in the completion)" in delta.error_message

    # the caller's own context limit (a deployment's), lower than the engine's, holds the same
    capped = GenerateRequest(prompt_token_ids=[5] * 60, params=GREEDY, max_model_len=64)
    [delta] = await collect(client, capped)
    assert (
        delta.error == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "is 64 tokens" in delta.error_message
    )
    unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    deltas = await collect(
        client, GenerateRequest(prompt_token_ids=[5] * 60, params=unbounded, max_model_len=64)
    )
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(d.token_ids) for d in deltas) == 4  # up to 64 in all, not the engine's 512

    invalid = [
        GenerateRequest(prompt="x", max_model_len=0),
        GenerateRequest(prompt="a", prompt_token_ids=[1]),
        GenerateRequest(),
        GenerateRequest(prompt=""),
        GenerateRequest(messages=[]),
        GenerateRequest(messages=[Message(role="", content="x")]),
        GenerateRequest(prompt_token_ids=[1, -2]),
        GenerateRequest(prompt_token_ids=[10_000]),
        GenerateRequest(prompt="x", cache_salt="s" * 1000),
    ]
    for request in invalid:
        [delta] = await collect(client, request)
        assert delta.error == ErrorCode.INVALID_REQUEST, request
        assert delta.error_message
    # a bound that depends on the model names the field it is about
    for request, param in (
        (GenerateRequest(prompt_token_ids=[10_000]), "prompt"),
        (GenerateRequest(prompt="x", params=SamplingParams(top_k=10**6)), "top_k"),
        (GenerateRequest(prompt="x", params=SamplingParams(logit_bias={10**6: 1.0})), "logit_bias"),
    ):
        [delta] = await collect(client, request)
        assert (delta.error, delta.error_param) == (ErrorCode.INVALID_REQUEST, param), request

    # the engine still serves
    deltas = await collect(client, GenerateRequest(prompt="hello", params=GREEDY))
    assert deltas[-1].finish_reason == FinishReason.LENGTH


async def raw_exchange(endpoint: str, frames: list[bytes], wait: float = 2.0) -> list[list[bytes]]:
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    replies = []
    try:
        await dealer.send_multipart(frames)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                replies.append(await dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
        ctx.term()
    return replies


async def test_an_oversized_request_fails_alone_and_its_links_other_streams_go_on(engine, client):
    """The transport's size limit dropped the sender's whole connection: every other stream
    of that web process failed, and their generations ran on unmetered. A tenant's tools of
    8 MB of floats encode past 16 MiB."""
    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    victim = asyncio.create_task(collect(client, GenerateRequest(prompt="hello", params=long)))
    await asyncio.sleep(0.2)  # streaming
    huge = GenerateRequest(prompt="x" * (MAX_FRAME_BYTES + 1), params=GREEDY)
    [refused] = await collect(client, huge)

    assert refused.error == ErrorCode.INVALID_REQUEST and "--max-frame-bytes" in (
        refused.error_message or ""
    )
    deltas = await victim
    assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].error is None
    assert sum(len(d.token_ids) for d in deltas) == 48


async def test_garbage_and_oversized_frames_do_not_hurt_the_engine(engine, client):
    decoder = msgspec.msgpack.Decoder(list[GenerateDelta])
    bad_params = msgspec.msgpack.encode(["hi", None, None, [-1.0], "rid-7"])
    # a tool nested past the decoder's stack: RecursionError, which got no reply (its id is
    # past reading too, as the payload's is when it is garbage). 100,000 levels: Python 3.12's
    # C stack limit let msgspec read 5,000 (the id came back), 3.11's stopped at 1,000
    marker = msgspec.msgpack.encode("@@")
    tools = [{"a": "@@"}]
    nested = msgspec.msgpack.encode(["hi", None, None, GREEDY, "rid-8", "", 0, None, 1.0, tools])
    nested = nested.replace(marker, b"\x91" * 100_000 + b"\x01")
    cases = [
        ([RequestType.GENERATE.value, nested], ""),
        ([RequestType.GENERATE.value, b"\xc1garbage"], ""),
        ([RequestType.GENERATE.value, bad_params], "rid-7"),
        ([RequestType.GENERATE.value, msgspec.msgpack.encode({"prompt": "x"})], ""),
        ([RequestType.ABORT.value, b"\x93\x01\x02"], ""),
        ([b"\x07", b""], ""),
        ([b"only one frame"], ""),
        ([RequestType.STATS.value, b"", b"extra"], ""),
    ]
    for frames, request_id in cases:
        [reply] = await raw_exchange(engine.endpoint, frames)
        assert reply[0] == ResponseType.OUTPUTS.value
        [delta] = decoder.decode(reply[1])
        assert (delta.request_id, delta.error) == (request_id, ErrorCode.INVALID_REQUEST)

    huge = GenerateRequest(prompt="x" * (MAX_FRAME_BYTES + 1), request_id="huge")
    frames = [RequestType.GENERATE.value, msgspec.msgpack.encode(huge)]
    [reply] = await raw_exchange(engine.endpoint, frames, wait=30.0)
    [delta] = decoder.decode(reply[1])
    assert (delta.request_id, delta.error) == ("huge", ErrorCode.INVALID_REQUEST)
    assert "--max-frame-bytes" in delta.error_message

    stats = await client.stats()
    assert stats.ready and engine.proc.poll() is None
    deltas = await collect(client, GenerateRequest(prompt="hello", params=GREEDY))
    assert deltas[-1].finish_reason == FinishReason.LENGTH


async def test_stats_metrics_and_control(client, metrics_port):
    await collect(client, GenerateRequest(prompt=PROMPTS[0], params=GREEDY, tenant_id="acme"))
    stats = await client.stats()
    assert (stats.model, stats.max_model_len, stats.ready) == ("tiny-llama", 512, True)
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    assert 0 <= stats.kv_cache_usage <= 1
    assert stats.generation_tokens_total >= 10 and stats.prompt_tokens_total > 0
    # the same prompt again is served from the prefix cache where blocks are full
    long_prompt = " ".join(PROMPTS[:8])
    for _ in range(2):
        await collect(client, GenerateRequest(prompt=long_prompt, params=GREEDY))
    assert (await client.stats()).prefix_cache_hits > stats.prefix_cache_hits

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_sum",
    ):
        assert re.search(rf'^engine:{name}{{[^}}]*model_name="tiny-llama"', text, re.M), name
    for name in ("tenant_tokens_total", "tenant_request_queue_time_seconds_count"):
        assert re.search(rf'^engine:{name}{{[^}}]*tenant="acme"', text, re.M), name
    assert "# TYPE engine:tenant_requests_waiting gauge" in text

    reply = await client.control(ControlRequest("load", model="other"))
    assert not reply.ok and "no Hugging Face model directory" in reply.message
    reply = await client.control(ControlRequest("reboot"))
    assert not reply.ok and "unknown action" in reply.message


async def test_overloaded_past_max_queued_requests(small_engine):
    client = AsyncEngineClient(small_engine.endpoint)
    try:
        await client.wait_ready(timeout=90)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        # one tenant each, so no tenant reaches its share before the queue is full
        results = await asyncio.gather(
            *(
                collect(client, GenerateRequest(prompt=p, params=params, tenant_id=f"t{i}"))
                for i, p in enumerate(PROMPTS[:8])
            )
        )
        errors = [deltas[-1].error for deltas in results]
        assert ErrorCode.OVERLOADED in errors
        # a burst fills the two waiting places before a step runs; the rest are refused at once
        assert errors.count(None) >= 2
        for deltas in results:
            if deltas[-1].error == ErrorCode.OVERLOADED:
                assert len(deltas) == 1 and "queue is full" in deltas[-1].error_message
            else:
                assert deltas[-1].finish_reason == FinishReason.LENGTH
    finally:
        client.close()


async def test_a_tenant_over_its_share_of_the_queue_is_refused_alone(small_engine):
    """Two waiting places, half for any one tenant: a flood from one tenant is refused past
    its share while another tenant's request still gets in."""
    client = AsyncEngineClient(small_engine.endpoint)
    try:
        await client.wait_ready(timeout=90)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        flood = [
            collect(client, GenerateRequest(prompt=p, params=params, tenant_id="a"))
            for p in PROMPTS[:5]
        ]
        other = collect(client, GenerateRequest(prompt=PROMPTS[6], params=params, tenant_id="b"))
        # in one burst, the other tenant's last: without shares the flood would fill the queue
        *flooded, other = await asyncio.gather(*flood, other)
        refusals = [d[-1].error_message for d in flooded if d[-1].error == ErrorCode.OVERLOADED]
        assert refusals and all("tenant's share" in message for message in refusals)
        assert other[-1].finish_reason == FinishReason.LENGTH
    finally:
        client.close()


async def test_sigterm_finishes_short_requests_and_fails_the_rest(small_engine, llama_dir):
    """SIGTERM: intake stops, a short request finishes; the long one is failed when the grace
    period ends or, as here to keep the test fast, at a second SIGTERM."""
    client = AsyncEngineClient(small_engine.endpoint)
    try:
        await client.wait_ready(timeout=90)
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=6)
        long_stream = client.generate(GenerateRequest(prompt="a", params=long))
        short_stream = client.generate(GenerateRequest(prompt="b", params=short))
        long_deltas = [await anext(long_stream)]
        short_deltas = [await anext(short_stream)]
        small_engine.signal(signal.SIGTERM)
        await wait_for_stats(client, lambda s: not s.ready)
        [refused] = await collect(client, GenerateRequest(prompt="c", params=short))
        short_deltas += [delta async for delta in short_stream]
        small_engine.signal(signal.SIGTERM)
        long_deltas += [delta async for delta in long_stream]

        assert refused.error == ErrorCode.OVERLOADED and "shutting down" in refused.error_message
        assert short_deltas[-1].finish_reason == FinishReason.LENGTH
        last = long_deltas[-1]
        assert last.error == ErrorCode.ENGINE_ERROR and "shut down" in last.error_message
        assert last.usage.completion_tokens < 500
        assert await asyncio.to_thread(small_engine.proc.wait, 30) == 0
    finally:
        client.close()
    assert "engine stopped" in small_engine.log()


async def test_silent_engine_fails_streams_and_client_reconnects(llama_dir, tmp_path, llm_cache):
    [want] = llm_cache("llama").generate("b", GREEDY)
    engine = EngineProcess(llama_dir, tmp_path, "--no-async-output")
    client = AsyncEngineClient(engine.endpoint, heartbeat_interval=0.2, heartbeat_timeout=1.5)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        engine.start()
        await client.wait_ready(timeout=90)
        stream = client.generate(GenerateRequest(prompt="a", params=params))
        await anext(stream)
        engine.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5
        engine.signal(signal.SIGCONT)
        await client.wait_ready(timeout=30)
        deltas = await collect(client, GenerateRequest(prompt="b", params=GREEDY))
        assert joined(deltas) == (want.text, want.token_ids)

        engine.proc.kill()
        engine.proc.wait()
        with pytest.raises(EngineUnavailable):
            await collect(client, GenerateRequest(prompt="c", params=GREEDY))
        engine.start()
        await client.wait_ready(timeout=90)
        deltas = await collect(client, GenerateRequest(prompt="b", params=GREEDY))
        assert joined(deltas) == (want.text, want.token_ids)
    finally:
        client.close()
        engine.stop()


# a web process's engine client with long streams open, that prints once they stream
STREAMING_CLIENT = """
import asyncio, sys
from inference_engine.client import AsyncEngineClient
from inference_engine.protocol import GenerateRequest, SamplingParams

async def main(endpoint, num_streams, max_tokens):
    client = AsyncEngineClient(endpoint)
    await client.wait_ready(timeout=120)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    streams = [
        client.generate(GenerateRequest(prompt="hello", request_id=f"long-{i}", params=params))
        for i in range(num_streams)
    ]
    await asyncio.gather(*(anext(stream) for stream in streams))
    print("streaming", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def test_the_requests_of_a_killed_client_are_aborted(tmp_path):
    """kill -9 of a web process mid-stream: its heartbeats stop, and the engine aborts its
    requests instead of generating every token they asked for (it ran them to the context
    length, 35 s of work for nobody)."""
    model = save_model(tmp_path / "llama", "llama", max_position_embeddings=8192)
    num_streams, max_tokens = 4, 8000
    engine = EngineProcess(
        model,
        tmp_path,
        "--client-timeout",
        "3",
        "--max-model-len",
        "8192",
        "--num-kv-blocks",
        "2100",
    )
    with running(engine):
        watcher = AsyncEngineClient(engine.endpoint)
        try:
            await watcher.wait_ready(timeout=90)
            client = subprocess.Popen(
                [
                    PYTHON,
                    "-c",
                    STREAMING_CLIENT,
                    engine.endpoint,
                    str(num_streams),
                    str(max_tokens),
                ],
                env=subprocess_env(),
                cwd=ROOT,
                stdout=subprocess.PIPE,
            )
            try:
                assert await asyncio.to_thread(client.stdout.readline) == b"streaming\n"
                assert (await watcher.stats()).num_requests_running == num_streams
            finally:
                client.kill()
                client.wait()
            stats = await wait_for_stats(watcher, lambda s: s.num_requests_running == 0, 60)
        finally:
            watcher.close()
    assert stats.num_requests_running == 0, engine.log()[-2000:]
    assert stats.generation_tokens_total < num_streams * max_tokens
    assert "aborting 4 requests of 1 clients silent" in engine.log()


def test_help_lists_every_option():
    result = subprocess.run(
        [PYTHON, "-m", "inference_engine", "--help"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for option in (
        "--model",
        "--endpoint",
        "--served-model-name",
        "--dtype",
        "--device",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--num-kv-blocks",
        "--kv-cache-memory",
        "--max-model-len",
        "--max-queued-requests",
        "--tenant-queue-share",
        "--scheduling-policy",
        "--metrics-port",
        "--no-async-output",
        "--threads",
    ):
        assert option in result.stdout


HANGING_STEP = """
import sys, threading
from inference_engine import core
from inference_engine.__main__ import main

step, steps = core.EngineCore.step, []

def hanging(self):
    steps.append(1)
    if len(steps) == 3:  # a kernel that never returns
        threading.Event().wait()
    return step(self)

core.EngineCore.step = hanging
main(sys.argv[1:])
"""


async def test_a_hung_step_makes_the_engine_exit_and_its_streams_fail(llama_dir, tmp_path):
    """A step that never returned left every stream open for ever: the I/O thread answered
    the heartbeats, so the clients waited, and the replica kept saying ready."""
    from inference_engine.server import HUNG_EXIT_CODE

    process = EngineProcess(llama_dir, tmp_path, "--step-timeout", "3")
    process.command = [PYTHON, "-c", HANGING_STEP, *process.command[3:]]
    with running(process):
        client = AsyncEngineClient(process.endpoint, heartbeat_timeout=60)
        try:
            await client.wait_ready(timeout=90)
            assert (await client.stats()).step_seconds == 0.0  # between steps
            long = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            started = time.monotonic()
            stream = asyncio.ensure_future(collect(client, GenerateRequest("hi", params=long)))
            # until it exits, the stall shows in STATS: the pools route around it
            stalled = await wait_for_stats(client, lambda stats: stats.step_seconds > 1.0, 10)
            assert 1.0 < stalled.step_seconds < 3.0 and stalled.ready
            with pytest.raises(EngineUnavailable):
                await asyncio.wait_for(stream, 60)
            assert time.monotonic() - started < 30
        finally:
            client.close()
        assert process.proc.wait(30) == HUNG_EXIT_CODE
        assert "--step-timeout" in process.log()
