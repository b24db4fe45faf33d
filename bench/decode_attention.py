"""A step's decode attention on the CPU: the compiled kernel the engine uses against the two
torch-op paths it falls back to (a padded bucket of batched matmuls; one SDPA call per
request, which the fallback takes for contexts of 256 tokens or more), in the same run.

    .venv/bin/python bench/decode_attention.py [--batch 64] [--context 160] [--kv-heads 4]
                                               [--dtype bfloat16] [--threads 1] [--repeat 5]

All three read the same block-major paged cache, for ``--batch`` decodes of contexts from half
``--context`` to ``--context`` in scattered 16-token blocks, 4 query heads of 64; each prints
its best and median ms per call over ``--repeat`` rounds, and the largest difference from the
kernel's output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inference_engine.attention import (
    DecodeBucket,
    LongDecodes,
    _attend_decode_bucket,
    _attend_long_decodes,
)
from inference_engine.cpu_kernels import paged_decode_attention
from inference_engine.model_runner import keep_freed_memory

BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 16, 4, 64


def time_ms(fn, repeat: int) -> tuple[float, float]:
    rounds = []
    for _ in range(repeat):
        fn()
        began = time.perf_counter()
        for _ in range(10):
            fn()
        rounds.append((time.perf_counter() - began) / 10 * 1e3)
    return min(rounds), statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    keep_freed_memory()  # as the engine runs: no fresh mmap per temporary
    kernel = paged_decode_attention()
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    num_blocks = -(-args.context // BLOCK_SIZE)
    num_cache_blocks = 4 * args.batch * num_blocks
    shape = (num_cache_blocks, args.kv_heads, BLOCK_SIZE, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    table = torch.randperm(num_cache_blocks, generator=generator)[: args.batch * num_blocks]
    table = table.view(args.batch, num_blocks)
    lens = torch.randint(
        args.context // 2 + 1, args.context + 1, (args.batch,), generator=generator
    )
    padding = torch.arange(num_blocks * BLOCK_SIZE)[None, :] >= lens[:, None]
    rows = torch.arange(args.batch)
    bucket = DecodeBucket(rows, table, padding[:, None, None, :])
    used = (-(-lens // BLOCK_SIZE)).tolist()
    long_decodes = LongDecodes(
        rows.tolist(),
        lens.tolist(),
        [sum(used[:i]) * BLOCK_SIZE for i in range(args.batch)],
        torch.cat([table[i, :n] for i, n in enumerate(used)]),
    )
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    scale = HEAD_DIM**-0.5
    outputs = {name: torch.empty_like(q) for name in ("bucket", "long")}

    def run_kernel():
        outputs["kernel"] = kernel(q, key_cache, value_cache, table, lens, scale)

    def run_bucket():
        _attend_decode_bucket(outputs["bucket"], q, key_cache, value_cache, bucket, scale)

    def run_long():
        _attend_long_decodes(outputs["long"], q, key_cache, value_cache, long_decodes, scale)

    runs = {"kernel": run_kernel, "bucket": run_bucket, "long": run_long}
    for run in runs.values():
        run()
    timings = {name: time_ms(run, args.repeat) for name, run in runs.items()}
    print(
        f"batch {args.batch}, contexts {args.context // 2 + 1}-{args.context}, "
        f"{args.kv_heads} KV heads, {args.dtype}, {args.threads} thread(s)"
    )
    labels = {
        "bucket": "torch ops, one padded bucket",
        "long": "torch ops, SDPA per request",
        "kernel": "compiled kernel (engine)",
    }
    for name, label in labels.items():
        best, median = timings[name]
        error = (outputs[name].float() - outputs["kernel"].float()).abs().max().item()
        print(f"{label:30s} best {best:7.2f} ms  median {median:7.2f} ms  diff {error:.1e}")
    fallback = min(timings["bucket"][0], timings["long"][0])
    print(f"ratio (best torch ops / kernel) {fallback / timings['kernel'][0]:.2f}x")


if __name__ == "__main__":
    main()
