"""A step's attention on the CPU: the compiled kernel the engine uses against the torch-op
paths it falls back to, in the same run. For decodes: a padded bucket of batched matmuls, and
one SDPA call per request (which the fallback takes for contexts of 256 tokens or more). For
``--chunk`` query tokens per request after a cached context (a prefix-cache hit, a resumed
request): the context gathered from its blocks and one masked SDPA call per request.

    .venv/bin/python bench/decode_attention.py [--batch 64] [--context 160] [--kv-heads 4]
                                               [--shared-prefix 0] [--chunk 1]
                                               [--dtype bfloat16] [--threads 1] [--repeat 5]

All read the same block-major paged cache, for ``--batch`` requests of contexts from half
``--context`` to ``--context`` in scattered 16-token blocks (the first ``--shared-prefix``
tokens in blocks all of them share, as the prefix cache shares them), 4 query heads of 64;
each prints its best and median ms per call over ``--repeat`` rounds, and the largest
difference from the kernel's output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from inference_engine.attention import (
    DecodeBucket,
    LongDecodes,
    _attend_decode_bucket,
    _attend_long_decodes,
    _gather,
)
from inference_engine.cpu_kernels import paged_attention
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
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens, in whole blocks")
    parser.add_argument("--chunk", type=int, default=1, help="query tokens per request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    keep_freed_memory()  # as the engine runs: no fresh mmap per temporary
    kernel = paged_attention()
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    num_blocks = -(-args.context // BLOCK_SIZE)
    num_cache_blocks = 4 * args.batch * num_blocks
    shape = (num_cache_blocks, args.kv_heads, BLOCK_SIZE, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    table = torch.randperm(num_cache_blocks, generator=generator)[: args.batch * num_blocks]
    table = table.view(args.batch, num_blocks).clone()
    table[:, : args.shared_prefix // BLOCK_SIZE] = table[0, : args.shared_prefix // BLOCK_SIZE]
    lens = torch.randint(
        max(args.context // 2, args.chunk) + 1, args.context + 1, (args.batch,), generator=generator
    )
    scale = HEAD_DIM**-0.5
    chunk = args.chunk
    q = torch.randn(args.batch * chunk, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    outputs = {name: torch.empty_like(q) for name in ("kernel", "bucket", "long", "sdpa")}
    starts, counts = torch.arange(args.batch) * chunk, torch.full((args.batch,), chunk)

    def run_kernel():
        kernel(outputs["kernel"], q, key_cache, value_cache, table, lens, starts, counts, scale)

    if chunk == 1:
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

        def run_bucket():
            _attend_decode_bucket(outputs["bucket"], q, key_cache, value_cache, bucket, scale)

        def run_long():
            _attend_long_decodes(outputs["long"], q, key_cache, value_cache, long_decodes, scale)

        runs = {"kernel": run_kernel, "bucket": run_bucket, "long": run_long}
    else:
        masks = [
            torch.arange(n)[None, :] <= torch.arange(n - chunk, n)[:, None] for n in lens.tolist()
        ]

        def run_sdpa():
            # the engine's PrefillChunk path: gather the context, one masked SDPA a request
            for i, n in enumerate(lens.tolist()):
                blocks = table[i, : -(-n // BLOCK_SIZE)]
                rows = slice(i * chunk, (i + 1) * chunk)
                result = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0),
                    _gather(key_cache, blocks, n).unsqueeze(0),
                    _gather(value_cache, blocks, n).unsqueeze(0),
                    attn_mask=masks[i],
                    scale=scale,
                )
                outputs["sdpa"][rows] = result[0].transpose(0, 1)

        runs = {"kernel": run_kernel, "sdpa": run_sdpa}
    for run in runs.values():
        run()
    timings = {name: time_ms(run, args.repeat) for name, run in runs.items()}
    print(
        f"batch {args.batch} x {chunk} query token(s), contexts up to {args.context} "
        f"({args.shared_prefix} shared), {args.kv_heads} KV heads, {args.dtype}, "
        f"{args.threads} thread(s)"
    )
    labels = {
        "bucket": "torch ops, one padded bucket",
        "long": "torch ops, SDPA per request",
        "sdpa": "torch ops, masked SDPA per request",
        "kernel": "compiled kernel (engine)",
    }
    for name, label in labels.items():
        if name not in timings:
            continue
        best, median = timings[name]
        error = (outputs[name].float() - outputs["kernel"].float()).abs().max().item()
        print(f"{label:30s} best {best:7.2f} ms  median {median:7.2f} ms  diff {error:.1e}")
    fallback = min(best for name, (best, _) in timings.items() if name != "kernel")
    print(f"ratio (best torch ops / kernel) {fallback / timings['kernel'][0]:.2f}x")


if __name__ == "__main__":
    main()
