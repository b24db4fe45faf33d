"""The GPU's step, end to end through the engine: the Triton attention backend (on the CPU
through Triton's interpreter when there is no GPU) and decode steps run from the static,
padded inputs of CUDA graphs. Greedy output must equal HF's token for token, with chunked
prefill and prefix-cache hits in play."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from inference_engine import LLM, SamplingParams
from inference_engine.attention import select_backend
from inference_engine.config import EngineConfig
from inference_engine.cuda_graphs import DecodeBatch, StaticInputs, capture_sizes
from inference_engine.model_runner import default_num_kv_blocks, kv_cache_budget
from tests.inference_engine.test_parity import assert_parity, mixed_batch
from tests.inference_engine.triton_interpreter import DEVICE, TRITON_EXPECTED

needs_triton = pytest.mark.skipif(not TRITON_EXPECTED, reason="Triton ships for x86-64 only")


def triton_llm(model_dir: str, **options) -> LLM:
    return LLM(model_dir, dtype="float32", device=DEVICE, attention_backend="triton", **options)


@needs_triton
def test_triton_backend_greedy_parity_with_chunked_prefill_and_cache_hits(model_dirs, hf_models):
    llm = triton_llm(model_dirs["llama"], block_size=8, max_num_batched_tokens=24)
    prompts, max_tokens = mixed_batch(seed=2, num_prompts=5)
    assert_parity(llm, hf_models("llama"), prompts, max_tokens)
    rng = random.Random(3)
    shared = [rng.randrange(5, 384) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 384) for _ in range(n)] for n in (0, 3, 17)]
    outputs = assert_parity(llm, hf_models("llama"), prompts, [5, 7, 6])
    assert [output.num_cached_tokens for output in outputs][1:] == [40, 40]


@needs_triton
def test_triton_backend_prompt_logprobs_match_the_model(model_dirs, hf_models):
    from tests.inference_engine.test_prompt_logprobs import assert_matches, random_prompt

    llm = triton_llm(model_dirs["llama"], block_size=8, max_num_batched_tokens=24)
    prompts = [random_prompt(40, 37), random_prompt(41, 9)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    for output, prompt in zip(llm.generate(prompts, params), prompts, strict=True):
        assert_matches(output, hf_models("llama"), prompt, 2)


@needs_triton
def test_decode_steps_replayed_from_padded_static_inputs_keep_parity(model_dirs, hf_models):
    """Decode-only steps run through the graphs' static buffers, padded to a captured size
    with requests on the scratch block; the real requests' caches and tokens are untouched.
    (Without a GPU the graphs replay eagerly: everything but the capture itself.)"""
    llm = triton_llm(model_dirs["qwen2"], max_num_seqs=6, enforce_eager=True)
    runner = llm.core.runner
    assert runner.key_caches[0].shape[0] == runner.num_blocks + 1  # the scratch block
    runner.graphs = runner.decode_graphs(capture=DEVICE == "cuda")
    runner.graphs.capture()
    assert runner.graphs.sizes == [1, 2, 4, 6]
    batch_sizes = []
    run = runner.graphs.run

    logits_of_each_step = []

    def spy(batch, fill=None):
        batch_sizes.append(len(batch.token_ids))
        logits = run(batch, fill)
        logits_of_each_step.append(logits)
        return logits

    runner.graphs.run = spy
    prompts, max_tokens = mixed_batch(seed=7, num_prompts=5)
    assert_parity(llm, hf_models("qwen2"), prompts, max_tokens)
    assert {3, 5} & set(batch_sizes), batch_sizes  # padded to 4 and 6
    # every size's logits are rows of one buffer of the largest size's, not one per size
    buffer = runner.graphs.logits
    assert buffer.shape == (6, runner.vocab_size)
    assert all(logits.data_ptr() == buffer.data_ptr() for logits in logits_of_each_step)


def test_a_forward_that_cannot_be_captured_runs_decode_steps_eagerly(
    model_dirs, monkeypatch, caplog
):
    """A model whose forward reads a device value on the host fails capture: the engine
    warns and serves with eager decode steps instead of refusing to start."""
    from inference_engine import cuda_graphs

    llm = LLM(model_dirs["llama"], dtype="float32", device="cpu", enforce_eager=True)
    runner = llm.core.runner

    streams = ["serving"]

    def capture(graphs):
        # torch.cuda.graph's exit ends the capture before it restores the stream: a capture
        # that fails there leaves its side stream current
        streams.append("capture")
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[-1])
    monkeypatch.setattr(torch.cuda, "set_stream", streams.append)
    with caplog.at_level("WARNING"):
        assert runner._capture_decode_graphs() is None
    assert "capturing CUDA graphs failed; decode steps run eagerly" in caplog.text
    assert streams[-1] == "serving"  # the engine goes on serving on the stream it started on


@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_batched_tokens", "sizes"),
    [(64, 20, [1, 2, 4, 8, 16, 20]), (6, 32, [1, 2, 4, 6])],
)
def test_no_graph_is_larger_than_the_largest_decode_step(
    model_dirs, max_num_seqs, max_num_batched_tokens, sizes
):
    """A decode-only step holds at most max_num_seqs requests and max_num_batched_tokens
    tokens, one each: a larger size would be captured (start-up time, graph memory) and
    never replayed."""
    llm = LLM(
        model_dirs["llama"],
        dtype="float32",
        device="cpu",
        enforce_eager=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert llm.core.runner.decode_graphs(capture=False).sizes == sizes


def test_capture_sizes_form_a_ladder_up_to_the_largest_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(300)[-3:] == [272, 288, 300]
    assert capture_sizes(4096)[-1] == 512


def test_static_inputs_pad_a_decode_batch_onto_the_scratch_block():
    layout = StaticInputs(max_batch_size=4, max_blocks_per_seq=3)
    host = np.full(layout.size, -7, np.int64)
    batch = DecodeBatch(
        token_ids=np.array([11, 12]),
        positions=np.array([5, 16]),
        slot_mapping=np.array([21, 48]),
        seq_lens=np.array([6, 17]),
        block_table=np.array([[5, 0], [9, 12]]),
    )

    width = layout.fill(host, batch, batch_size=4, scratch_block=30, block_size=4)

    ids, positions, slots, seq_lens, starts, _ = layout.views(host)
    assert ids.tolist() == [11, 12, 0, 0]
    assert positions.tolist() == [5, 16, 0, 0]
    assert slots.tolist() == [21, 48, 120, 120]
    assert seq_lens.tolist() == [6, 17, 1, 1]
    assert starts.tolist() == [0, 1, 2, 3, 4]
    # the table is packed to the batch's width (2 of 3 blocks), and only that is copied
    assert width == 2
    assert layout.packed(host, 4, width).tolist() == [[5, 0], [9, 12], [30, 0], [30, 0]]
    assert layout.used(4, width) == 5 * 4 + 1 + 4 * 2
    with pytest.raises(ValueError, match="does not fit"):
        layout.fill(host, batch, batch_size=1, scratch_block=30, block_size=4)


def test_the_kv_cache_never_has_more_blocks_than_its_requests_can_fill():
    """On an 80 GB GPU a tiny test model's share was 9.3 million blocks (a Python object each:
    seconds and gigabytes of host memory per engine) that no step could use."""
    gib = 2**30
    sized = default_num_kv_blocks(
        70 * gib, 8 * 1024, max_num_seqs=256, max_model_len=512, block_size=16
    )
    assert sized == 256 * 32
    assert (
        default_num_kv_blocks(
            1 * gib, 512 * 1024, max_num_seqs=256, max_model_len=4096, block_size=16
        )
        == 2048
    )  # a budget that holds fewer is what it holds
    assert (
        default_num_kv_blocks(70 * gib, 8 * 1024, max_num_seqs=2, max_model_len=17, block_size=16)
        == 2 * 2
    )  # a partial block at the end counts


def test_kv_cache_budget_is_the_utilized_share_less_weights_activations_and_context():
    gib = 2**30
    assert kv_cache_budget(80 * gib, 0.9, 10 * gib, 1 * gib) == 61 * gib
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_cache_budget(16 * gib, 0.5, 7 * gib, 2 * gib)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention_backend": "paged"}, "attention_backend"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization"),
        ({"max_cudagraph_batch_size": 0}, "max_cudagraph_batch_size"),
    ],
)
def test_engine_config_refuses_bad_gpu_options(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_the_cpu_picks_torch_attention_and_refuses_flash_attn():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="flash_attn"):
        select_backend("flash_attn", cpu)
