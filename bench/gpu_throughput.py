"""The engine on a GPU against Hugging Face peers and the hardware's ceiling, in one run.

Model: a Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP
8192, vocab 32000), random bf16 weights, built at ``--model-dir`` on first use.

Rows, all on the same model and requests:
  fixed     256 prompts of 128-512 random tokens x 256 forced new tokens, greedy:
            this engine with CUDA graphs (and async scheduling, the default on a GPU), the
            same without async scheduling (its step time too), this engine eager
            (``enforce_eager``), HF ``generate`` on static batches of 64 (eager, SDPA),
            transformers' continuous batching
            (``paged|sdpa``), and the ceiling: the bare decode forward at batch 256 (no
            attention context) captured in a CUDA graph; and this engine with a frequency
            penalty on every request (the penalties count the token in flight on the device)
  mixed     512 requests, prompts 16-2048, outputs 16-512 (this engine)
  latency   TTFT and TPOT p50 at 1, 16 and 256 concurrent requests (closed loop: a finished
            request is replaced at once), prompts 128-512, 128 output tokens
  step      the engine's 256-decode step (contexts ~512) against the ceiling's step

    python bench/gpu_throughput.py [--quick] [--skip hf,cb,sync,eager,penalty] [--out results.jsonl]

Prints a table and one JSON line per measurement (also to ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 32000
RESULTS: list[dict] = []


def report(out: Path | None, **fields) -> None:
    RESULTS.append(fields)
    line = json.dumps(fields)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as file:
            file.write(line + "\n")


def build_model(model_dir: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        dtype="bfloat16",
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()


def fixed_workload(num: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(2024)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(128, 512))] for _ in range(num)]
    return prompts, [256] * num


def mixed_workload(num: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 2048))] for _ in range(num)]
    return prompts, [rng.randint(16, 512) for _ in range(num)]


def engine(model_dir: str, **options):
    from inference_engine import LLM

    began = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        **options,
    )
    return llm, time.perf_counter() - began


def release(llm) -> None:
    """Give the engine's device memory back before the next row loads its model."""
    llm.close()
    gc.collect()
    torch.cuda.empty_cache()


def bench_engine(llm, prompts, outs, **sampling) -> tuple[float, float]:
    """Output tok/s and seconds of greedy requests; ``sampling`` adds to every request's
    parameters (a penalty, say)."""
    from inference_engine import SamplingParams

    warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **sampling)] * 8
    llm.generate(prompts[:8], warm)
    torch.cuda.synchronize()
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **sampling) for n in outs
    ]
    began = time.perf_counter()
    results = llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    tokens = sum(len(result.token_ids) for result in results)
    assert tokens == sum(outs), (tokens, sum(outs))
    return tokens / seconds, seconds


def closed_loop_latency(llm, prompts, concurrency: int, num_requests: int, out_tokens: int):
    """TTFT and TPOT p50 (ms) with ``concurrency`` requests in flight, each finished one
    replaced at once, driving the engine core as the server's busy loop does."""
    from inference_engine import SamplingParams

    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    next_prompt = iter(range(num_requests))
    ttfts, tpots = [], []

    def submit() -> None:
        index = next(next_prompt, None)
        if index is not None:
            core.add_request(f"lat-{concurrency}-{index}", prompts[index % len(prompts)], params)

    for _ in range(min(concurrency, num_requests)):
        submit()
    while core.has_unfinished_requests():
        for output in core.step():
            if not output.is_finished:
                continue
            timings = output.timings
            ttfts.append(timings.first_token - timings.arrival)
            tpots.append((timings.finished - timings.first_token) / (out_tokens - 1))
            submit()
    return statistics.median(ttfts) * 1e3, statistics.median(tpots) * 1e3


def decode_step_time(llm, batch: int = 256, context: int = 512, steps: int = 20) -> float:
    """Seconds per step of ``batch`` decodes at ``context`` tokens each, in steady state."""
    from inference_engine import SamplingParams

    rng = random.Random(11)
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"step-{i}", [rng.randrange(3, VOCAB) for _ in range(context)], params)
    while any(request.num_output_tokens < 5 for request in core.scheduler.running) or (
        core.scheduler.num_waiting
    ):
        core.step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - began) / steps
    while core.has_unfinished_requests():
        core.step()
    return seconds


def bench_hf_static(model_dir: str, prompts, outs, batch: int) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model = model.cuda().eval()

    def run(batch_prompts, new_tokens):
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros((len(batch_prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(batch_prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    run(prompts[:4], 8)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run(prompts[i : i + batch], max(outs[i : i + batch]))
    torch.cuda.synchronize()
    return sum(outs) / (time.perf_counter() - began)


def bench_hf_continuous(model_dir: str, prompts, outs, limit_s: float = 300) -> float | None:
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    )
    model = model.cuda().eval()
    config = GenerationConfig(
        max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5
    ) as manager:
        manager.add_request(prompts[0][:16], request_id="warm", max_new_tokens=4, eos_token_id=-1)
        warm_deadline = time.perf_counter() + 120  # its thread may die without a result
        while (result := manager.get_result(timeout=5)) is None or not result.is_finished():
            if time.perf_counter() > warm_deadline:
                raise TimeoutError("transformers' continuous batching did not warm up in 120 s")
        began = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, outs, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        done = 0
        while done < len(prompts) and time.perf_counter() - began < limit_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
        seconds = time.perf_counter() - began
    del model
    torch.cuda.empty_cache()
    return sum(outs) / seconds if done == len(prompts) else None


def ceiling_step(model_dir: str, batch: int) -> tuple[float, float]:
    """The bare decode forward at ``batch`` (one token each, no KV context): eager and
    captured in a CUDA graph. Seconds per step."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, VOCAB, (batch, 1), device="cuda")
    positions = torch.zeros((batch, 1), dtype=torch.long, device="cuda")

    def forward():
        return model(ids, position_ids=positions, use_cache=False, logits_to_keep=1)

    def timed(fn, n=30):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - began) / n

    with torch.inference_mode():
        eager = timed(forward)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        captured = timed(graph.replay)
    return eager, captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256/512")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: hf, cb, sync, eager, mixed, latency, penalty",
    )
    parser.add_argument("--model-dir", default="/tmp/gpu-bench-llama1b")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = args.out
    build_model(args.model_dir)
    import transformers

    report(
        out,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
    )
    num = 64 if args.quick else 256
    prompts, outs = fixed_workload(num)

    llm, load_s = engine(args.model_dir)
    num_graphs = len(llm.core.runner.graphs.sizes)
    report(out, row="engine load", seconds=round(load_s, 1), graph_sizes=num_graphs)
    ours, seconds = bench_engine(llm, prompts, outs)
    report(out, row="fixed: engine, CUDA graphs", tok_s=round(ours), seconds=round(seconds, 2))
    step = decode_step_time(llm)
    report(out, row="step: 256 decodes at ~512 context", step_ms=round(step * 1e3, 2))
    if "penalty" not in skip:
        # penalties count the outputs, the token in flight included, on the device
        penalised, seconds = bench_engine(llm, prompts, outs, frequency_penalty=0.2)
        report(
            out,
            row="fixed: engine, CUDA graphs, every request with a frequency penalty",
            tok_s=round(penalised),
            seconds=round(seconds, 2),
        )
    if "latency" not in skip:
        for concurrency in (1, 16, 256):
            num_requests = max(4, 2 * concurrency) if not args.quick else max(2, concurrency)
            ttft, tpot = closed_loop_latency(llm, prompts, concurrency, num_requests, 128)
            report(
                out,
                row=f"latency at {concurrency} concurrent",
                ttft_p50_ms=round(ttft, 1),
                tpot_p50_ms=round(tpot, 2),
            )
    if "mixed" not in skip:
        mixed_prompts, mixed_outs = mixed_workload(64 if args.quick else 512)
        mixed, seconds = bench_engine(llm, mixed_prompts, mixed_outs)
        report(out, row="mixed: engine, CUDA graphs", tok_s=round(mixed), seconds=round(seconds, 2))
    release(llm)
    del llm

    # a row that fails is reported and the rest still run
    if "sync" not in skip:
        sync_row = "fixed: engine, CUDA graphs, no async scheduling"
        try:
            llm, _ = engine(args.model_dir, async_scheduling="off")
            sync, seconds = bench_engine(llm, prompts, outs)
            sync_step = decode_step_time(llm)
            release(llm)
            del llm
        except Exception as exc:  # noqa: BLE001
            report(out, row=sync_row, error=repr(exc)[:300])
        else:
            report(
                out,
                row=sync_row,
                tok_s=round(sync),
                seconds=round(seconds, 2),
                step_ms=round(sync_step * 1e3, 2),
            )
    if "eager" not in skip:
        try:
            llm, _ = engine(args.model_dir, enforce_eager=True)
            eager, seconds = bench_engine(llm, prompts, outs)
            release(llm)
            del llm
        except Exception as exc:  # noqa: BLE001
            report(out, row="fixed: engine, eager", error=repr(exc)[:300])
        else:
            report(out, row="fixed: engine, eager", tok_s=round(eager), seconds=round(seconds, 2))
    hf = None
    if "hf" not in skip:
        try:
            hf = bench_hf_static(args.model_dir, prompts, outs, batch=64)
        except Exception as exc:  # noqa: BLE001
            report(out, row="fixed: HF generate, static batches of 64", error=repr(exc)[:300])
        else:
            report(out, row="fixed: HF generate, static batches of 64", tok_s=round(hf))
        gc.collect()
        torch.cuda.empty_cache()
    if "cb" not in skip:
        try:
            cb = bench_hf_continuous(args.model_dir, prompts, outs)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            report(out, row="fixed: transformers continuous batching", error=repr(exc)[:300])
        else:
            report(out, row="fixed: transformers continuous batching (paged|sdpa)", tok_s=cb)
    torch.cuda.empty_cache()
    eager_ceiling, graph_ceiling = ceiling_step(args.model_dir, 256)
    report(
        out,
        row="ceiling: bare decode forward at 256",
        eager_ms=round(eager_ceiling * 1e3, 2),
        graph_ms=round(graph_ceiling * 1e3, 2),
        graph_tok_s=round(256 / graph_ceiling),
    )

    print()
    print(f"fixed workload, {num} requests x 256 tokens, {torch.cuda.get_device_name()}")
    print(f"  this engine, CUDA graphs     {ours:10.0f} tok/s")
    if hf:
        print(f"  HF static batches of 64      {hf:10.0f} tok/s   ratio {ours / hf:.1f}x")
    print(f"  ceiling (graph, batch 256)   {256 / graph_ceiling:10.0f} tok/s")
    print(
        f"  256-decode step              {step * 1e3:10.2f} ms vs ceiling "
        f"{graph_ceiling * 1e3:.2f} ms: {step / graph_ceiling:.2f}x"
    )


if __name__ == "__main__":
    main()
