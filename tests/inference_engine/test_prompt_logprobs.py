"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the ones
before it, checked against the Hugging Face model's own logits, across prefill chunks, a
prefix cache that holds the prompt, preemptions and a batch of requests that did not ask."""

from __future__ import annotations

import random

import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.protocol import InvalidParam
from inference_engine.tokenization import TokenBytes, token_text


def reference(hf_model, prompt: list[int], num_top: int) -> list[tuple[float, list[int]]]:
    """Per prompt token after the first: its logprob and the top ``num_top`` ids there."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    logprobs = logits.log_softmax(dim=-1)
    return [
        (
            logprobs[p, prompt[p + 1]].item(),
            logprobs[p].topk(num_top).indices.tolist() if num_top else [],
        )
        for p in range(len(prompt) - 1)
    ]


def assert_matches(output, hf_model, prompt: list[int], num_top: int) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0].top_token_ids == [] and entries[0].token  # its text alone
    for entry, (logprob, top_ids) in zip(
        entries[1:], reference(hf_model, prompt, num_top), strict=True
    ):
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert entry.top_token_ids == top_ids
        assert len(entry.top_logprobs) == num_top
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 384) for _ in range(length)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prompt_logprobs_match_the_model_across_prefill_chunks(family, llm_cache, hf_models):
    llm = llm_cache(family, max_num_batched_tokens=24)
    prompts = [random_prompt(1, 61), random_prompt(2, 7), [9]]
    params = [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=n, ignore_eos=True)
        for n in (2, 0, 5)
    ]
    outputs = llm.generate(prompts, params)
    for output, prompt, request_params in zip(outputs, prompts, params, strict=True):
        assert_matches(output, hf_models(family), prompt, request_params.prompt_logprobs)
        assert len(output.token_ids) == 3


def test_a_request_with_prompt_logprobs_reads_nothing_from_the_prefix_cache(model_dirs, hf_models):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64)
    prompt = random_prompt(3, 40)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [first] = llm.generate([prompt], greedy)
    [again] = llm.generate([prompt], greedy)
    assert again.num_cached_tokens == 32  # the prompt's blocks are in the cache
    asking = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    [output] = llm.generate([prompt], asking)
    assert output.num_cached_tokens == 0
    assert output.token_ids == first.token_ids
    assert_matches(output, hf_models("llama"), prompt, 1)
    # a request that did not ask still reads the blocks the asking one wrote
    [after] = llm.generate([prompt], greedy)
    assert after.num_cached_tokens == 32 and after.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption(model_dirs, hf_models):
    llm = LLM(
        model_dirs["llama"],
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
    )
    prompts = [random_prompt(10 + i, 30) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params)
    assert llm.core.scheduler.num_preemptions > 0
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_matches(output, hf_models("llama"), prompt, 3)
        assert len(output.token_ids) == 40
    assert llm.core.scheduler.kv_cache.num_free_blocks == 40


def test_prompt_logprobs_with_async_scheduling(model_dirs, hf_models):
    llm = LLM(
        model_dirs["llama"], dtype="float32", async_scheduling="on", max_num_batched_tokens=16
    )
    prompts = [random_prompt(30, 45), random_prompt(31, 5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    for output, prompt in zip(llm.generate(prompts, params), prompts, strict=True):
        assert_matches(output, hf_models("llama"), prompt, 1)
        assert len(output.token_ids) == 8


def test_prompt_logprobs_carry_each_token_text(llm_cache, tokenizer):
    llm = llm_cache("llama")
    text = "the quick brown fox"
    [output] = llm.generate(
        text, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, ignore_eos=True)
    )
    ids = output.prompt_token_ids
    assert [entry.token_bytes for entry in output.prompt_logprobs] == [
        tokenizer.decode([token_id]).encode() for token_id in ids
    ]
    assert b"".join(entry.token_bytes for entry in output.prompt_logprobs).decode() == (
        tokenizer.decode(ids)
    )
    token_bytes = TokenBytes(tokenizer)
    for entry in output.prompt_logprobs[1:]:
        assert len(entry.top_tokens) == 2
        assert entry.top_tokens == [token_text(token_bytes(i)) for i in entry.top_token_ids]


def test_requests_that_did_not_ask_get_none_and_the_same_tokens(llm_cache):
    llm = llm_cache("llama", max_num_batched_tokens=24)
    prompts = [random_prompt(20, 33), random_prompt(21, 12)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompts, greedy)
    asking = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    mixed = llm.generate(prompts, [greedy, asking])
    assert mixed[0].prompt_logprobs is None
    assert len(mixed[1].prompt_logprobs) == 12
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_are_refused(value):
    with pytest.raises(InvalidParam) as raised:
        SamplingParams(prompt_logprobs=value)
    assert raised.value.field == "prompt_logprobs"


def test_a_step_keeps_no_more_prompt_rows_than_the_memory_profile_sized(model_dirs, hf_models):
    """A step kept a logits row for every prompt position of its chunks, up to
    max_num_batched_tokens of them, while the memory profile sized a step's logits for
    max_num_seqs rows: on a GPU, an out-of-memory step failed every request in it."""
    llm = LLM(model_dirs["llama"], dtype="float32", max_num_seqs=3, max_num_batched_tokens=64)
    scheduler = llm.core.scheduler
    assert scheduler.max_prompt_logprob_rows == 6
    schedule, rows_per_step = scheduler.schedule, []

    def spy():
        output = schedule()
        rows_per_step.append(
            sum(item.num_new_tokens for item in output.scheduled if item.request.reads_whole_prompt)
        )
        return output

    scheduler.schedule = spy
    prompts = [random_prompt(50, 30), random_prompt(51, 20)]
    asking = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([*prompts, random_prompt(52, 40)], [asking, asking, plain])
    # a chunk is never cut to nothing: the other asking request gets its one row
    assert max(rows_per_step) <= 6 + 1 and len(rows_per_step) > 50 // 7
    for output, prompt in zip(outputs[:2], prompts, strict=True):
        assert_matches(output, hf_models("llama"), prompt, 1)
    assert outputs[2].num_cached_tokens == 0 and len(outputs[2].token_ids) == 3
