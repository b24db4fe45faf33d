"""The paged attention's decode buckets against a float64 reference computed over each
request's own tokens: padding must weigh nothing, grouped heads must read their own KV head,
and bf16 inputs must keep float32 accuracy inside the bucket."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_engine.attention import DecodeBucket, PagedMetadata, paged_attention_forward

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 16


def reference(query, keys, values, num_kv_heads):
    """query ``[H, D]``, keys/values ``[L, KVH, D]`` -> ``[H, D]`` in float64."""
    group = query.shape[0] // num_kv_heads
    keys = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    values = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hld->hl", query.double(), keys) * HEAD_DIM**-0.5
    return torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), values)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "tolerance"),
    [(torch.float32, 4, 4, 1e-5), (torch.float32, 6, 2, 1e-5), (torch.bfloat16, 4, 2, 1e-2)],
)
def test_decode_bucket_matches_attention_over_each_requests_own_tokens(
    dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(0)
    context_lens = [1, 3, 4, 5, 9, 16]  # inside, at and across block boundaries
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    # each request owns scattered blocks, in no particular order
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    max_blocks = -(-max(context_lens) // BLOCK_SIZE)
    block_table = torch.zeros(len(context_lens), max_blocks, dtype=torch.long)
    for row, context_len in enumerate(context_lens):
        for block in range(-(-context_len // BLOCK_SIZE)):
            block_table[row, block] = free_blocks.pop()
    last_positions = torch.tensor(context_lens) - 1
    slot_mapping = (
        block_table[torch.arange(len(context_lens)), last_positions // BLOCK_SIZE] * BLOCK_SIZE
        + last_positions % BLOCK_SIZE
    )
    padding = torch.arange(max_blocks * BLOCK_SIZE)[None, :] >= torch.tensor(context_lens)[:, None]
    bucket = DecodeBucket(
        query_index=torch.arange(len(context_lens)),
        block_table=block_table,
        padding=padding[:, None, None, :],
    )
    meta = PagedMetadata([key_cache], [value_cache], slot_mapping, decode_buckets=[bucket])
    num_tokens = len(context_lens)
    query = torch.randn(1, num_heads, num_tokens, HEAD_DIM, generator=generator).to(dtype)
    new_keys = torch.randn(1, num_kv_heads, num_tokens, HEAD_DIM, generator=generator).to(dtype)
    new_values = torch.randn(1, num_kv_heads, num_tokens, HEAD_DIM, generator=generator).to(dtype)

    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0), query, new_keys, new_values, None, paged_metadata=meta
    )

    assert out.shape == (1, num_tokens, num_heads, HEAD_DIM) and out.dtype == dtype
    for row, context_len in enumerate(context_lens):
        blocks = block_table[row, : -(-context_len // BLOCK_SIZE)]
        keys = key_cache[blocks].reshape(-1, num_kv_heads, HEAD_DIM)[:context_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, HEAD_DIM)[:context_len]
        # the step's own token was written to the cache before attending
        assert torch.equal(keys[-1], new_keys[0, :, row])
        expected = reference(query[0, :, row], keys, values, num_kv_heads)
        error = (out[0, row].double() - expected).abs().max().item()
        assert error < tolerance, (row, context_len, error)
