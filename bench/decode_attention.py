"""One decode bucket's attention on the CPU: the engine's block-major path against the
heads-first gather it replaced (kept here as the peer), measured in the same run.

    .venv/bin/python bench/decode_attention.py [--batch 64] [--context 160] [--kv-heads 4]
                                               [--dtype bfloat16] [--threads 1] [--repeat 5]

Both read the same K/V (the peer a token-major copy of the engine's block-major cache), for
``--batch`` decodes of contexts from half ``--context`` to ``--context`` in scattered 16-token
blocks, 4 query heads of 64; each prints its median ms per call of the best of ``--repeat``
rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inference_engine.attention import DecodeBucket, _attend_decode_bucket
from inference_engine.model_runner import keep_freed_memory

BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 16, 4, 64


def heads_first_bucket(out, q, key_cache, value_cache, bucket, scale):
    """The previous formulation: token-major cache, one gather, one transpose-and-widen copy
    into float32 ``[B, KVH, L, D]``, two matmuls over it."""

    def gather(cache):
        batch, num_blocks = bucket.block_table.shape
        tokens = cache.flatten(1).index_select(0, bucket.block_table.view(-1))
        tokens = tokens.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])
        heads_first = torch.empty(tokens.transpose(1, 2).shape, dtype=torch.float32)
        return heads_first.copy_(tokens.transpose(1, 2))

    keys, values = gather(key_cache), gather(value_cache)
    batch, num_kv_heads = keys.shape[:2]
    queries = q.index_select(0, bucket.query_index).view(batch, num_kv_heads, -1, HEAD_DIM)
    scores = torch.matmul(queries.float(), keys.transpose(-1, -2))
    scores.mul_(scale).masked_fill_(bucket.padding, float("-inf"))
    result = torch.matmul(torch.softmax(scores, dim=-1), values)
    out.index_copy_(0, bucket.query_index, result.view(batch, -1, HEAD_DIM).to(out.dtype))


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
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    num_blocks = -(-args.context // BLOCK_SIZE)
    num_cache_blocks = 4 * args.batch * num_blocks
    shape = (num_cache_blocks, args.kv_heads, BLOCK_SIZE, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    token_major = key_cache.transpose(1, 2).contiguous(), value_cache.transpose(1, 2).contiguous()
    table = torch.randperm(num_cache_blocks, generator=generator)[: args.batch * num_blocks]
    lens = torch.randint(
        args.context // 2 + 1, args.context + 1, (args.batch,), generator=generator
    )
    padding = torch.arange(num_blocks * BLOCK_SIZE)[None, :] >= lens[:, None]
    bucket = DecodeBucket(
        torch.arange(args.batch), table.view(args.batch, num_blocks), padding[:, None, None, :]
    )
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    scale = HEAD_DIM**-0.5
    ours, peer = torch.empty_like(q), torch.empty_like(q)

    def run_ours():
        _attend_decode_bucket(ours, q, key_cache, value_cache, bucket, scale)

    def run_peer():
        heads_first_bucket(peer, q, *token_major, bucket, scale)

    run_ours(), run_peer()
    error = (ours.float() - peer.float()).abs().max().item()
    peer_ms, ours_ms = time_ms(run_peer, args.repeat), time_ms(run_ours, args.repeat)
    print(
        f"batch {args.batch}, contexts {args.context // 2 + 1}-{args.context}, "
        f"{args.kv_heads} KV heads, {args.dtype}, {args.threads} thread(s); "
        f"max difference {error:.1e}"
    )
    print(f"heads-first gather (before)  best {peer_ms[0]:6.2f} ms  median {peer_ms[1]:6.2f} ms")
    print(f"block-major blocks (engine)  best {ours_ms[0]:6.2f} ms  median {ours_ms[1]:6.2f} ms")
    print(f"ratio (before / engine)      best {peer_ms[0] / ours_ms[0]:.2f}x")


if __name__ == "__main__":
    main()
