"""The offline API end to end on a tiny llama: order, text, chat, stop strings, bad input."""

from __future__ import annotations

import msgspec
import pytest

from inference_engine import LLM, SamplingParams
from inference_engine.config import EngineConfig
from inference_engine.core import EngineCore
from inference_engine.protocol import ErrorCode, FinishReason
from tests.inference_engine.conftest import stop_spanning_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_outputs_come_back_in_input_order_with_text(llm_cache, tokenizer):
    llm = llm_cache("llama")
    prompts = ["the quick brown fox", [5, 6, 7], "hello world"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [3, 9, 5]
    assert outputs[0].prompt_token_ids == tokenizer("the quick brown fox")["input_ids"]
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    for output in outputs:
        assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)
        assert output.finish_reason == "length"
    single = llm.generate("hello world", params[2])
    assert single[0].token_ids == outputs[2].token_ids


def test_options_are_engine_config_fields_with_its_defaults(llm_cache, llama_dir):
    assert llm_cache("llama").core.config == EngineConfig(model=llama_dir, dtype="float32")
    with pytest.raises(TypeError, match=r"unknown options \['max_seqs'\]"):
        LLM(llama_dir, max_seqs=4)


def test_chat_uses_the_template(llm_cache, tokenizer):
    llm = llm_cache("llama")
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    [output] = llm.chat([conversation], GREEDY)
    rendered = "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert output.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert llm.chat(conversation, GREEDY)[0].token_ids == output.token_ids


def test_stop_strings_trim_the_text_and_stop_the_request(llm_cache):
    llm = llm_cache("llama")
    [full] = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    assert len(full.text) > 6
    stop = full.text[4:6]
    [stopped] = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )
    cut = full.text.find(stop)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert not llm.core.has_unfinished_requests()
    assert llm.core.scheduler.kv_cache.usage == 0.0
    [kept] = llm.generate(
        [[5, 6, 7]],
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )
    assert kept.finish_reason == "stop" and kept.text == full.text[: cut + len(stop)]


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_spanning_tokens_ends_the_text_inside_a_token(llm_cache, include_stop):
    llm = llm_cache("llama")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [full] = llm.generate([[5, 6, 7]], params)
    stop, num_tokens = stop_spanning_tokens(llm.tokenizer, full.token_ids, full.text)
    [stopped] = llm.generate(
        [[5, 6, 7]],
        msgspec.structs.replace(params, stop=[stop], include_stop_str_in_output=include_stop),
    )
    cut = full.text.index(stop) + (len(stop) if include_stop else 0)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    # the token that completes the stop string is the last one reported
    assert stopped.token_ids == full.token_ids[:num_tokens]
    assert not llm.core.has_unfinished_requests()


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("longer_first", [False, True])
def test_of_stop_strings_completed_by_one_token_the_first_completed_ends_the_text(
    llm_cache, include_stop, longer_first
):
    """A stop string and its own prefix, both completed by one token: the prefix was
    complete first (its last character comes first), so it ends the text, whichever of
    them is listed first. With the longer one first, its text was kept whole."""
    llm = llm_cache("llama")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [full] = llm.generate([[5, 6, 7]], params)
    longer, _ = stop_spanning_tokens(llm.tokenizer, full.token_ids, full.text)
    shorter = longer[:3]  # its last character is the completing token's first
    stop = [longer, shorter] if longer_first else [shorter, longer]
    [stopped] = llm.generate(
        [[5, 6, 7]],
        msgspec.structs.replace(params, stop=stop, include_stop_str_in_output=include_stop),
    )
    cut = full.text.index(shorter) + (len(shorter) if include_stop else 0)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:cut]


def test_eos_stops_unless_ignored(eos_llama_dir):
    llm = LLM(eos_llama_dir, dtype="float32")
    prompts = [[i, i + 1, i + 2] for i in range(5, 200, 3)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert stopped, "some greedy continuation should reach EOS (token 0)"
    for output in stopped:
        assert output.token_ids[-1] == 0 and 0 not in output.token_ids[:-1]
    output = llm.generate(
        stopped[0].prompt_token_ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 40


def test_bad_prompts_raise_before_anything_runs(llm_cache):
    llm = llm_cache("llama", max_model_len=64)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["hello", ""], GREEDY)
    with pytest.raises(ValueError, match="prompt 0: .*max_model_len=64"):
        llm.generate([[5] * 65], GREEDY)
    assert not llm.core.has_unfinished_requests()
    assert llm.generate([[5] * 60], GREEDY)[0].finish_reason == "length"


def test_logprobs_are_returned_per_token(llm_cache):
    llm = llm_cache("llama")
    [output] = llm.generate(
        [[5, 6]], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    )
    assert len(output.logprobs) == 4
    for token_id, logprobs in zip(output.token_ids, output.logprobs, strict=True):
        assert logprobs.top_token_ids[0] == token_id
        assert logprobs.logprob == pytest.approx(logprobs.top_logprobs[0])


def run_core(core: EngineCore) -> dict:
    outputs: dict = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs.setdefault(delta.req_id, []).append(delta)
    return outputs


def test_core_reports_errors_per_request_and_keeps_serving(llm_cache):
    core = llm_cache("llama", max_model_len=64, num_kv_blocks=3, block_size=16).core
    core.add_request("empty", [], GREEDY)
    core.add_request("long", [5] * 65, GREEDY)
    core.add_request("huge", [5] * 40, SamplingParams(max_tokens=20))  # needs 4 blocks
    core.add_request("vocab", [10_000], GREEDY)
    core.add_request("top_k", [5], SamplingParams(top_k=10**6))
    core.add_request("stop_id", [5], SamplingParams(stop_token_ids=[10**6]))
    core.add_request("ok", [5, 6, 7], GREEDY)
    core.add_request("ok", [5, 6, 7], GREEDY)
    outputs = run_core(core)
    errors = {
        delta.req_id: delta.error_code
        for deltas in outputs.values()
        for delta in deltas
        if delta.finish_reason == FinishReason.ERROR
    }
    assert errors.pop("empty") == ErrorCode.INVALID_REQUEST
    assert errors.pop("long") == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert errors.pop("huge") == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert errors.pop("vocab") == ErrorCode.INVALID_REQUEST
    assert errors.pop("top_k") == errors.pop("stop_id") == ErrorCode.INVALID_REQUEST
    assert errors.pop("ok") == ErrorCode.INVALID_REQUEST  # the duplicate id
    finished = outputs["ok"][-1]
    assert finished.finish_reason == FinishReason.LENGTH
    assert sum(len(d.new_token_ids) for d in outputs["ok"]) == 12 == finished.num_output_tokens
    assert finished.num_prompt_tokens == 3
    timings = finished.timings
    assert timings.arrival <= timings.first_scheduled <= timings.first_token <= timings.finished


def test_an_aborted_requests_usage_is_what_the_engine_computed(llm_cache):
    """Metering bills an abort by its last output: prompt tokens once prefilled (none while
    waiting, the computed part of a chunked prefill), every token generated."""
    # step by step as the synchronous engine runs (on a GPU, async scheduling's aborts in
    # flight are metered as delivered: test_async_scheduling)
    core = llm_cache(
        "llama", max_num_batched_tokens=32, max_model_len=256, async_scheduling="off"
    ).core
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    core.add_request("waiting", list(range(5, 25)), params)
    core.abort_requests(["waiting"])
    [aborted] = run_core(core)["waiting"]
    assert (aborted.num_prompt_tokens, aborted.num_output_tokens) == (0, 0)

    budget = 32
    prompt = [5 + i % 50 for i in range(budget + 10)]
    core.add_request("chunked", prompt, params)
    core.step()  # prefills one budget's worth of the prompt, samples nothing
    core.abort_requests(["chunked"])
    [aborted] = run_core(core)["chunked"]
    assert (aborted.num_prompt_tokens, aborted.num_output_tokens) == (budget, 0)

    core.add_request("decoding", [5, 6, 7], params)
    core.step()
    core.step()
    core.abort_requests(["decoding"])
    last = run_core(core)["decoding"][-1]
    assert (last.num_prompt_tokens, last.num_output_tokens) == (3, 2)


def test_core_abort_reports_and_frees(llm_cache):
    core = llm_cache("llama", async_scheduling="off").core  # the first step's tokens at once
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    core.add_request("b", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    first = core.step()
    assert {d.req_id for d in first} == {"a", "b"}
    core.abort_requests(["a", "missing"])
    outputs = run_core(core)
    assert outputs["a"][-1].finish_reason == FinishReason.ABORT
    assert outputs["b"][-1].finish_reason == FinishReason.LENGTH
    assert core.scheduler.kv_cache.usage == 0.0
    assert core.scheduler.num_running == 0


def test_close_gives_the_models_memory_back(model_dirs):
    import gc
    import weakref

    llm = LLM(model_dirs["llama"], dtype="float32", device="cpu")
    runner = llm.core.runner
    model = weakref.ref(runner.model)
    cache = weakref.ref(runner.key_caches[0])
    llm.close()
    gc.collect()
    assert model() is None and cache() is None
    assert runner.graphs is None and runner.key_caches == []


def test_special_tokens_the_model_writes_are_text_when_not_skipped(llm_cache, tokenizer):
    """``skip_special_tokens`` reaches the detokenizer: a model made to write a special
    token shows it only where asked (as a tool call's tag must show to be read)."""
    llm = llm_cache("llama")
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    forced = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={user: 100.0})
    kept, skipped = llm.generate(
        ["hello", "hello"],
        [SamplingParams(**forced, skip_special_tokens=False), SamplingParams(**forced)],
    )
    assert kept.token_ids == skipped.token_ids == [user, user]
    assert (kept.text, skipped.text) == ("<|user|><|user|>", "")
