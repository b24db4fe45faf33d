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
    python bench/gpu_throughput.py --core    # the issue's done-when rows alone (~3 minutes)
    python bench/gpu_throughput.py --rest    # the rows --core leaves out
    python bench/gpu_throughput.py --smoke   # every row on a tiny model, on the CPU too

``--core`` measures what the issue's "done when" reads: the engine with CUDA graphs on the
fixed workload, its 256-decode step, a single request's TPOT, HF static batches on the first
batch of 64 alone (``--hf-batches``: a static batch's tok/s does not depend on how many follow
it), and the ceiling; it ends with a verdict on each target. ``--rest`` is every other row, for
a second call when the device time allows (``bench/gpu_session.sh``).

Prints a table and one JSON line per measurement (also to ``--out``). A row that fails is
reported with its error and the rest still run. ``--smoke`` runs the whole script in seconds
on a tiny Llama (hidden 64, 2 layers) with a few short requests, on the GPU when there is one
and else on the CPU (no CUDA graphs there: the ceiling is eager only); its figures mean
nothing, it checks the script before GPU time is spent on it
(``tests/inference_engine/test_gpu_bench_smoke.py``).
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
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 32000
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS: list[dict] = []


def sync() -> None:
    """Wait for the device's queued work (timings end here)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU"


@dataclass(frozen=True)
class Sizes:
    """How much work each row does: the spec's, ``--quick``'s or ``--smoke``'s."""

    fixed: int = 256  # requests of the fixed workload
    fixed_tokens: int = 256  # forced output tokens each
    mixed: int = 512
    max_mixed_tokens: int = 512
    latency_concurrency: tuple[int, ...] = (1, 16, 256)
    latency_tokens: int = 128
    step_batch: int = 256
    step_context: int = 512
    hf_batch: int = 64
    ceiling_batch: int = 256


# Row groups: --core measures the first, --rest the second, a plain run both.
CORE_ROWS = frozenset({"fixed", "step", "latency1", "hf", "ceiling"})
REST_ROWS = frozenset({"latency", "penalty", "mixed", "sync", "eager", "cb"})
# the groups measured on the engine as configured by default (``engine_rows``)
ENGINE_ROWS = frozenset({"fixed", "step", "latency1", "latency", "penalty", "mixed"})
# the done-when: fixed-workload tok/s, the multiple of HF static batches, the
# 256-decode step against the captured ceiling, a single request's TPOT (ms)
TARGET_TOK_S = 25_000
TARGET_VS_HF = 15.0
TARGET_STEP_VS_CEILING = 1.5
TARGET_SINGLE_TPOT_MS = 3.0

SPEC = Sizes()
QUICK = Sizes(fixed=64, mixed=64)
SMOKE = Sizes(
    fixed=8,
    fixed_tokens=8,
    mixed=6,
    max_mixed_tokens=8,
    latency_concurrency=(1, 4),
    latency_tokens=4,
    step_batch=4,
    step_context=32,
    hf_batch=4,
    ceiling_batch=8,
)


def report(out: Path | None, **fields) -> None:
    RESULTS.append(fields)
    line = json.dumps(fields)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as file:
            file.write(line + "\n")


def build_model(model_dir: str, tiny: bool = False) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64 if tiny else 2048,
        intermediate_size=128 if tiny else 8192,
        num_hidden_layers=2 if tiny else 16,
        num_attention_heads=4 if tiny else 32,
        num_key_value_heads=2 if tiny else 8,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        dtype="bfloat16",
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with DEVICE:
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    empty_cache()


def fixed_workload(num: int, new_tokens: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(2024)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(128, 512))] for _ in range(num)]
    return prompts, [new_tokens] * num


def mixed_workload(num: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 2048))] for _ in range(num)]
    return prompts, [rng.randint(min(16, max_tokens), max_tokens) for _ in range(num)]


def engine(model_dir: str, **options):
    from inference_engine import LLM

    began = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        device=DEVICE.type,
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
    empty_cache()


def bench_engine(llm, prompts, outs, **sampling) -> tuple[float, float]:
    """Output tok/s and seconds of greedy requests; ``sampling`` adds to every request's
    parameters (a penalty, say)."""
    from inference_engine import SamplingParams

    warm = min(8, len(prompts))
    llm.generate(
        prompts[:warm],
        [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **sampling)] * warm,
    )
    sync()
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **sampling) for n in outs
    ]
    began = time.perf_counter()
    results = llm.generate(prompts, params)
    sync()
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


def decode_step_time(llm, batch: int, context: int, steps: int = 20) -> float:
    """Seconds per step of ``batch`` decodes at ``context`` tokens each, in steady state."""
    from inference_engine import SamplingParams

    rng = random.Random(11)
    core = llm.core
    # the first admitted have decoded all through the others' prefill (16 steps of 8,192 tokens
    # at 256 x 512): enough tokens left that none ends within the timed steps
    params = SamplingParams(temperature=0.0, max_tokens=steps + 100, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"step-{i}", [rng.randrange(3, VOCAB) for _ in range(context)], params)
    while any(request.num_output_tokens < 5 for request in core.scheduler.running) or (
        core.scheduler.num_waiting
    ):
        core.step()
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync()
    seconds = (time.perf_counter() - began) / steps
    assert len(core.scheduler.running) == batch, "a request ended within the timed steps"
    while core.has_unfinished_requests():
        core.step()
    return seconds


def bench_hf_static(model_dir: str, prompts, outs, batch: int, batches: int | None = None) -> float:
    """HF ``generate`` on static batches of ``batch`` prompts (the first ``batches`` of them,
    or all): output tok/s."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model = model.to(DEVICE).eval()

    def run(batch_prompts, new_tokens):
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros((len(batch_prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(batch_prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                ids.to(DEVICE),
                attention_mask=mask.to(DEVICE),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    run(prompts[:4], 8)
    sync()
    starts = list(range(0, len(prompts), batch))[:batches]
    began = time.perf_counter()
    for i in starts:
        run(prompts[i : i + batch], max(outs[i : i + batch]))
    sync()
    return sum(sum(outs[i : i + batch]) for i in starts) / (time.perf_counter() - began)


def bench_hf_continuous(model_dir: str, prompts, outs, limit_s: float = 300) -> float | None:
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    )
    model = model.to(DEVICE).eval()
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
    empty_cache()
    return sum(outs) / seconds if done == len(prompts) else None


def ceiling_step(model_dir: str, batch: int) -> tuple[float, float | None]:
    """The bare decode forward at ``batch`` (one token each, no KV context): eager and
    captured in a CUDA graph (None on the CPU). Seconds per step."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    ids = torch.randint(3, VOCAB, (batch, 1), device=DEVICE)
    positions = torch.zeros((batch, 1), dtype=torch.long, device=DEVICE)

    def forward():
        return model(ids, position_ids=positions, use_cache=False, logits_to_keep=1)

    def timed(fn, n=30):
        for _ in range(3):
            fn()
        sync()
        began = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - began) / n

    with torch.inference_mode():
        eager = timed(forward)
        if DEVICE.type != "cuda":
            return eager, None
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


def attempt(out: Path | None, row: str, measure):
    """``measure()``'s result, or None with the row reported as failed: a row that fails does
    not cost the rest of the run."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported, and the next rows still run
        report(out, row=row, error=repr(exc)[:300])
        return None


def engine_rows(
    args, sizes: Sizes, rows: set[str], prompts, outs
) -> tuple[float | None, float | None, float | None]:
    """The rows of the engine as it is configured by default (CUDA graphs and async
    scheduling on a GPU): (fixed workload tok/s, 256-decode step seconds, TPOT ms at one
    request), each None where not measured."""
    out = args.out
    ours = step = single_tpot = None
    llm, load_s = engine(args.model_dir)
    try:
        graphs = llm.core.runner.graphs
        report(
            out,
            row="engine load",
            seconds=round(load_s, 1),
            graph_sizes=len(graphs.sizes) if graphs is not None else 0,
        )
        if "fixed" in rows:
            ours, seconds = bench_engine(llm, prompts, outs)
            report(
                out, row="fixed: engine, CUDA graphs", tok_s=round(ours), seconds=round(seconds, 2)
            )
        if "step" in rows:
            row = f"step: {sizes.step_batch} decodes at ~{sizes.step_context} context"
            step = attempt(
                out, row, lambda: decode_step_time(llm, sizes.step_batch, sizes.step_context)
            )
            if step is not None:
                report(out, row=row, step_ms=round(step * 1e3, 2))
        if "penalty" in rows:
            # penalties count the outputs, the token in flight included, on the device
            row = "fixed: engine, CUDA graphs, every request with a frequency penalty"
            measured = attempt(
                out, row, lambda: bench_engine(llm, prompts, outs, frequency_penalty=0.2)
            )
            if measured is not None:
                report(out, row=row, tok_s=round(measured[0]), seconds=round(measured[1], 2))
        for concurrency in sizes.latency_concurrency:
            if ("latency1" if concurrency == 1 else "latency") not in rows:
                continue
            row = f"latency at {concurrency} concurrent"
            num_requests = max(4, 2 * concurrency) if not args.quick else max(2, concurrency)
            measured = attempt(
                out,
                row,
                lambda c=concurrency, n=num_requests: closed_loop_latency(
                    llm, prompts, c, n, sizes.latency_tokens
                ),
            )
            if measured is not None:
                ttft, tpot = measured
                report(out, row=row, ttft_p50_ms=round(ttft, 1), tpot_p50_ms=round(tpot, 2))
                if concurrency == 1:
                    single_tpot = tpot
        if "mixed" in rows:
            row = "mixed: engine, CUDA graphs"
            mixed_prompts, mixed_outs = mixed_workload(sizes.mixed, sizes.max_mixed_tokens)
            measured = attempt(out, row, lambda: bench_engine(llm, mixed_prompts, mixed_outs))
            if measured is not None:
                report(out, row=row, tok_s=round(measured[0]), seconds=round(measured[1], 2))
    finally:
        release(llm)
    return ours, step, single_tpot


def other_engine_row(args, sizes: Sizes, row: str, prompts, outs, **options) -> None:
    """The fixed workload (and the step time) on the engine with ``options``."""
    llm, _ = engine(args.model_dir, **options)
    try:
        tok_s, seconds = bench_engine(llm, prompts, outs)
        step = decode_step_time(llm, sizes.step_batch, sizes.step_context)
    finally:
        release(llm)
    report(
        args.out,
        row=row,
        tok_s=round(tok_s),
        seconds=round(seconds, 2),
        step_ms=round(step * 1e3, 2),
    )


def select_rows(args) -> set[str]:
    """The row groups this run measures: ``--core``, ``--rest`` or all, less ``--skip``
    (whose ``latency`` also drops the single request's)."""
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - CORE_ROWS - REST_ROWS
    if unknown:
        raise SystemExit(f"--skip: no such rows: {', '.join(sorted(unknown))}")
    if "latency" in skip:
        skip.add("latency1")
    rows = set(CORE_ROWS if args.core else REST_ROWS if args.rest else CORE_ROWS | REST_ROWS)
    return rows - skip


def verdicts(ours, hf, step, ceiling, single_tpot, step_batch: int) -> list[str]:
    """One line per done-when target this run measured: the figure, the target, met or not."""
    lines = []

    def judge(name: str, figure: str, met: bool, target: str) -> None:
        lines.append(f"  {'MET ' if met else 'MISS'}  {name}: {figure} (target {target})")

    if ours is not None:
        judge("fixed workload", f"{ours:,.0f} tok/s", ours >= TARGET_TOK_S, f">= {TARGET_TOK_S:,}")
        if hf:
            judge(
                "vs HF static",
                f"{ours / hf:.1f}x",
                ours / hf >= TARGET_VS_HF,
                f">= {TARGET_VS_HF}x",
            )
    if step is not None and ceiling:
        ratio = step / ceiling
        judge(
            f"{step_batch}-decode step vs ceiling",
            f"{step * 1e3:.2f} ms / {ceiling * 1e3:.2f} ms = {ratio:.2f}x",
            ratio <= TARGET_STEP_VS_CEILING,
            f"<= {TARGET_STEP_VS_CEILING}x",
        )
    if single_tpot is not None:
        judge(
            "single request TPOT",
            f"{single_tpot:.2f} ms",
            single_tpot <= TARGET_SINGLE_TPOT_MS,
            f"<= {TARGET_SINGLE_TPOT_MS} ms",
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256/512")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model and a few requests, on the CPU too"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--core", action="store_true", help="the done-when rows alone")
    group.add_argument("--rest", action="store_true", help="the rows --core leaves out")
    parser.add_argument(
        "--skip",
        default="",
        help=f"comma-separated, of: {', '.join(sorted(CORE_ROWS | REST_ROWS))}",
    )
    parser.add_argument(
        "--hf-batches",
        type=int,
        help="time HF generate on this many static batches (default: all; 1 with --core)",
    )
    parser.add_argument("--model-dir", help="default: /tmp/gpu-bench-llama1b (or -tiny)")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    if DEVICE.type != "cuda" and not args.smoke:
        parser.error("this benchmark needs a CUDA GPU (--smoke runs it on the CPU)")
    sizes = SMOKE if args.smoke else QUICK if args.quick else SPEC
    args.model_dir = args.model_dir or (
        "/tmp/gpu-bench-llama-tiny" if args.smoke else "/tmp/gpu-bench-llama1b"
    )
    rows = select_rows(args)
    hf_batches = args.hf_batches or (1 if args.core else None)
    out = args.out
    build_model(args.model_dir, tiny=args.smoke)
    import transformers

    report(
        out,
        gpu=device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        rows=sorted(rows),
    )
    prompts, outs = fixed_workload(sizes.fixed, sizes.fixed_tokens)

    ours = step = single_tpot = None
    if rows & ENGINE_ROWS:
        ours, step, single_tpot = attempt(
            out, "fixed: engine, CUDA graphs", lambda: engine_rows(args, sizes, rows, prompts, outs)
        ) or (None, None, None)
    if "sync" in rows:
        row = "fixed: engine, CUDA graphs, no async scheduling"
        attempt(
            out,
            row,
            lambda: other_engine_row(args, sizes, row, prompts, outs, async_scheduling="off"),
        )
    if "eager" in rows:
        row = "fixed: engine, eager"
        attempt(
            out, row, lambda: other_engine_row(args, sizes, row, prompts, outs, enforce_eager=True)
        )
    hf = None
    if "hf" in rows:
        total = -(-len(prompts) // sizes.hf_batch)
        timed = min(hf_batches or total, total)
        row = f"fixed: HF generate, static batches of {sizes.hf_batch}"
        if timed < total:
            row += f" ({timed} of {total} timed)"
        hf = attempt(
            out,
            row,
            lambda: bench_hf_static(args.model_dir, prompts, outs, sizes.hf_batch, timed),
        )
        if hf is not None:
            report(out, row=row, tok_s=round(hf))
        gc.collect()
        empty_cache()
    if "cb" in rows:
        row = "fixed: transformers continuous batching (paged|sdpa)"
        cb = attempt(out, row, lambda: bench_hf_continuous(args.model_dir, prompts, outs))
        if cb is not None:
            report(out, row=row, tok_s=round(cb))
        empty_cache()
    graph_ceiling = None
    if "ceiling" in rows:
        batch = sizes.ceiling_batch
        eager_ceiling, graph_ceiling = attempt(
            out, "ceiling", lambda: ceiling_step(args.model_dir, batch)
        ) or (None, None)
        if eager_ceiling is not None:
            report(
                out,
                row=f"ceiling: bare decode forward at {batch}",
                eager_ms=round(eager_ceiling * 1e3, 2),
                graph_ms=round(graph_ceiling * 1e3, 2) if graph_ceiling else None,
                graph_tok_s=round(batch / graph_ceiling) if graph_ceiling else None,
            )

    print()
    print(f"fixed workload, {sizes.fixed} requests x {sizes.fixed_tokens} tokens, {device_name()}")
    if ours is None and "fixed" in rows:
        print("  this engine failed: see its row above")
    # every row on the fixed workload that this run measured (--rest's too), each as a
    # multiple of HF static batches where those were measured
    for result in RESULTS:
        label = str(result.get("row", ""))
        if not (label.startswith("fixed: ") and "tok_s" in result):
            continue
        is_hf = label.startswith("fixed: HF generate")
        ratio = f"   ratio {result['tok_s'] / hf:.1f}x" if hf and not is_hf else ""
        print(f"  {label.removeprefix('fixed: '):<66} {result['tok_s']:8.0f} tok/s{ratio}")
    if graph_ceiling:
        batch = sizes.ceiling_batch
        print(f"  ceiling (graph, batch {batch})   {batch / graph_ceiling:10.0f} tok/s")
    lines = verdicts(ours, hf, step, graph_ceiling, single_tpot, sizes.step_batch)
    if lines:
        print("done when (issue 15):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
