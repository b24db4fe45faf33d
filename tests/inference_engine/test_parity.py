"""Greedy output equals HF ``generate(do_sample=False)`` token for token, for every request of
a mixed batch, also with chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from inference_engine import SamplingParams
from inference_engine.cpu_linear import WidenedLinear


def hf_greedy(model, prompt: list[int], max_new_tokens: int, device: str = "cpu") -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, len(prompt) :].tolist()


def mixed_batch(seed: int, num_prompts: int = 6) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lengths = [1, 7, 16, 33, 90, 150][:num_prompts]
    prompts = [[rng.randrange(5, 384) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randrange(4, 24) for _ in prompts]
    return prompts, max_tokens


def assert_parity(llm, hf_model, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    for prompt, n, output in zip(prompts, max_tokens, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.finish_reason == "length"
        assert output.token_ids == hf_greedy(hf_model, prompt, n)
    return outputs


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "qwen3", "mistral"])
def test_greedy_parity_mixed_batch(family, llm_cache, hf_models):
    prompts, max_tokens = mixed_batch(seed=1)
    assert_parity(llm_cache(family), hf_models(family), prompts, max_tokens)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_parity_with_chunked_prefill(family, llm_cache, hf_models):
    llm = llm_cache(family, max_num_batched_tokens=24)
    prompts, max_tokens = mixed_batch(seed=2)
    assert_parity(llm, hf_models(family), prompts, max_tokens)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_parity_with_prefix_cache_hits(family, model_dirs, hf_models):
    from inference_engine import LLM

    llm = LLM(model_dirs[family], dtype="float32", block_size=8, max_num_batched_tokens=64)
    rng = random.Random(3)
    shared = [rng.randrange(5, 384) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 384) for _ in range(n)] for n in (0, 3, 17)]
    assert_parity(llm, hf_models(family), prompts[:1], [5])
    outputs = assert_parity(llm, hf_models(family), prompts, [9, 12, 6])
    # 40 shared tokens are 5 full blocks; the first prompt must still compute its last token
    assert [output.num_cached_tokens for output in outputs] == [32, 40, 40]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_parity_with_preemption(family, model_dirs, hf_models):
    from inference_engine import LLM

    llm = LLM(model_dirs[family], dtype="float32", block_size=4, num_kv_blocks=40)
    prompts, max_tokens = mixed_batch(seed=4, num_prompts=5)
    max_tokens = [40] * len(prompts)
    assert_parity(llm, hf_models(family), prompts, max_tokens)
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.scheduler.kv_cache.num_free_blocks == 40


def test_seeded_sampling_is_reproducible_and_batch_independent(llm_cache):
    llm = llm_cache("llama")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (5, 30)]
    batched = llm.generate([[9] * 50, [5, 6, 7], [11, 12]], [others[0], seeded, others[1]])
    assert batched[1].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    draws = {tuple(llm.generate([[5, 6, 7]], unseeded)[0].token_ids) for _ in range(3)}
    assert len(draws) > 1


@pytest.mark.parametrize("cpu_attention", ["auto", "torch"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_parity_with_long_contexts(family, cpu_attention, llm_cache, hf_models):
    """Long and short contexts in one batch: with torch ops, those past
    LONG_DECODE_MIN_CONTEXT take the one-by-one decode path, the others a bucket; the
    compiled kernel (where it builds) attends them all in one call."""
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 384) for _ in range(n)] for n in (250, 300, 420, 12)]
    llm = llm_cache(family, cpu_attention=cpu_attention)
    assert_parity(llm, hf_models(family), prompts, [12, 6, 9, 10])


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize(
    ("enforce_eager", "async_scheduling"), [(False, "on"), (True, "on"), (False, "off")]
)
def test_greedy_parity_on_cuda_in_float32(model_dirs, enforce_eager, async_scheduling):
    """The GPU's step (Triton attention, CUDA graphs unless eager, the next step launched
    before the last one's tokens are back unless async scheduling is off) against HF on the
    same device, with full float32 matmuls on both sides. A fresh engine each time: a shared
    one's prefix cache would hold KV computed in other steps' shapes."""
    from transformers import AutoModelForCausalLM

    from inference_engine import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype="float32")
    hf_model = hf_model.to("cuda").eval()
    llm = LLM(
        model_dirs["llama"],
        dtype="float32",
        device="cuda",
        max_num_batched_tokens=24,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    assert (llm.core.runner.graphs is None) == enforce_eager
    assert llm.core.async_scheduling == (async_scheduling == "on")
    prompts, max_tokens = mixed_batch(seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    for prompt, n, output in zip(prompts, max_tokens, llm.generate(prompts, params), strict=True):
        assert output.token_ids == hf_greedy(hf_model, prompt, n, device="cuda")


@needs_cuda
def test_a_long_prompt_chunked_alone_on_cuda_keeps_parity(model_dirs):
    """A prompt alone in 16-token chunks: its steps before the last sample nothing, so the host
    does not wait for the device between them while it packs the next chunk's inputs (the
    pinned buffer of a step must not be the one a queued copy still reads)."""
    from transformers import AutoModelForCausalLM

    from inference_engine import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf_model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype="float32")
    hf_model = hf_model.to("cuda").eval()
    llm = LLM(model_dirs["llama"], dtype="float32", device="cuda", max_num_batched_tokens=16)
    rng = random.Random(7)
    for _ in range(3):
        prompt = [rng.randrange(5, 384) for _ in range(300)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        [output] = llm.generate([prompt], params)
        assert output.token_ids == hf_greedy(hf_model, prompt, 8, device="cuda")


def assert_parity_up_to_near_ties(llm, hf_model, prompts, max_tokens, device: str) -> None:
    """bf16 rounds differently in every kernel: outputs agree with HF's until HF's own top two
    logits are within rounding of each other (the near-tie rule)."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params)
    for prompt, n, output in zip(prompts, max_tokens, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, n, device=device)
        agreed = next(
            (i for i, (a, b) in enumerate(zip(output.token_ids, expected, strict=True)) if a != b),
            n,
        )
        if agreed < n:
            with torch.inference_mode():
                ids = torch.tensor([prompt + expected[:agreed]], device=device)
                top2 = hf_model(ids).logits[0, -1].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin < 0.05 * top2[0].abs().item() + 0.1, (prompt, agreed, margin)


@needs_cuda
def test_greedy_parity_on_cuda_in_bfloat16_up_to_near_ties(model_dirs):
    from transformers import AutoModelForCausalLM

    from inference_engine import LLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype="bfloat16")
    hf_model = hf_model.to("cuda").eval()
    llm = LLM(model_dirs["llama"], dtype="bfloat16", device="cuda", max_num_batched_tokens=24)
    prompts, max_tokens = mixed_batch(seed=6)
    assert_parity_up_to_near_ties(llm, hf_model, prompts, max_tokens, device="cuda")


@pytest.mark.parametrize("cpu_gemm", ["native", "widened"])
def test_greedy_parity_on_cpu_in_bfloat16_up_to_near_ties(model_dirs, cpu_gemm):
    """Widened linears (float32 products of bf16 values, rounded to bf16) follow HF's bf16
    model as closely as torch's own bf16 kernels do."""
    from transformers import AutoModelForCausalLM

    from inference_engine import LLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype="bfloat16").eval()
    llm = LLM(model_dirs["llama"], dtype="bfloat16", device="cpu", cpu_gemm=cpu_gemm)
    widened = [m for m in llm.core.runner.model.modules() if type(m) is WidenedLinear]
    assert bool(widened) == (cpu_gemm == "widened")
    prompts, max_tokens = mixed_batch(seed=6)
    assert_parity_up_to_near_ties(llm, hf_model, prompts, max_tokens, device="cpu")
