"""CONTROL on a real engine process: load another model while serving, a failed load that
leaves the current model serving, unload and load again."""

import json

import pytest

from inference_engine.client import AsyncEngineClient
from inference_engine.protocol import ControlRequest, ErrorCode, GenerateRequest, SamplingParams
from tests.inference_engine.test_server import EngineProcess, collect, running, wait_for_stats

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "the quick brown fox"


async def _text(client: AsyncEngineClient) -> str:
    deltas = await collect(client, GenerateRequest(prompt=PROMPT, params=GREEDY))
    assert deltas[-1].error is None, deltas[-1].error_message
    return "".join(delta.text for delta in deltas)


@pytest.fixture
async def client_and_dirs(model_dirs, tmp_path):
    process = EngineProcess(model_dirs["llama"], tmp_path, "--served-model-name", "switchable")
    with running(process):
        client = AsyncEngineClient(process.endpoint)
        await client.wait_ready(timeout=90)
        yield client, model_dirs
        client.close()


async def test_load_switches_models_after_running_requests_finish(client_and_dirs, llm_cache):
    client, dirs = client_and_dirs
    assert await _text(client) == llm_cache("llama").generate([PROMPT], GREEDY)[0].text

    long_request = GenerateRequest(
        prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    )
    stream = client.generate(long_request)
    first = await anext(stream)
    assert first.token_ids

    reply = await client.control(ControlRequest("load", model=dirs["qwen2"]))
    assert reply.ok, reply.message
    refused = await collect(client, GenerateRequest(prompt=PROMPT, params=GREEDY))
    assert refused[-1].error == ErrorCode.MODEL_LOADING
    stats = await client.stats()
    assert stats.state == "loading" and not stats.ready
    busy = await client.control(ControlRequest("unload"))
    assert not busy.ok and "busy" in busy.message

    rest = [delta async for delta in stream]  # the old model finishes what it started
    assert rest[-1].finish_reason is not None and rest[-1].error is None
    assert sum(len(d.token_ids) for d in [first, *rest]) == 300

    stats = await wait_for_stats(client, lambda s: s.state == "ready", timeout=60)
    assert stats.ready and stats.model_path == dirs["qwen2"]
    assert await _text(client) == llm_cache("qwen2").generate([PROMPT], GREEDY)[0].text


async def test_a_failed_load_leaves_the_model_serving(client_and_dirs, tmp_path):
    client, dirs = client_and_dirs
    before = await _text(client)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))

    assert (await client.control(ControlRequest("load", model=str(broken)))).ok
    stats = await wait_for_stats(client, lambda s: s.state == "ready", timeout=60)
    assert "failed" in stats.state_detail and stats.model_path == dirs["llama"]
    assert await _text(client) == before


async def test_unload_then_load_again(client_and_dirs):
    client, dirs = client_and_dirs
    before = await _text(client)
    assert (await client.control(ControlRequest("unload"))).ok
    stats = await wait_for_stats(client, lambda s: s.state == "unloaded", timeout=30)
    assert not stats.ready and stats.max_model_len == 0 and stats.model_path == ""
    refused = await collect(client, GenerateRequest(prompt=PROMPT, params=GREEDY))
    assert refused[-1].error == ErrorCode.MODEL_NOT_LOADED

    assert (await client.control(ControlRequest("load", model=dirs["llama"]))).ok
    await wait_for_stats(client, lambda s: s.state == "ready", timeout=60)
    assert await _text(client) == before


async def test_replace_unloads_first_and_reloads_the_old_model_when_the_new_one_fails(
    model_dirs, tmp_path, llm_cache
):
    """``--model-swap replace`` (a GPU's way: one model's KV cache fills the device): the
    serving model finishes its requests and is unloaded before the next one is built; a load
    that fails brings the previous model back."""
    process = EngineProcess(model_dirs["llama"], tmp_path, "--model-swap", "replace")
    with running(process):
        client = AsyncEngineClient(process.endpoint)
        try:
            await client.wait_ready(timeout=90)
            before = await _text(client)
            broken = tmp_path / "broken"
            broken.mkdir()
            (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))

            reply = await client.control(ControlRequest("load", model=str(broken)))
            assert reply.ok and "unloaded" in reply.message, reply.message
            stats = await wait_for_stats(client, lambda s: s.state == "ready", timeout=90)
            assert stats.model_path == model_dirs["llama"]
            assert "failed" in stats.state_detail and "again" in stats.state_detail
            assert await _text(client) == before

            long_request = GenerateRequest(
                prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            )
            stream = client.generate(long_request)
            first = await anext(stream)
            assert (await client.control(ControlRequest("load", model=model_dirs["qwen2"]))).ok
            rest = [delta async for delta in stream]  # finished before the unload
            assert rest[-1].error is None and sum(len(d.token_ids) for d in [first, *rest]) == 200
            stats = await wait_for_stats(client, lambda s: s.state == "ready", timeout=90)
            assert stats.model_path == model_dirs["qwen2"] and stats.state_detail == ""
            assert await _text(client) == llm_cache("qwen2").generate([PROMPT], GREEDY)[0].text
        finally:
            client.close()
