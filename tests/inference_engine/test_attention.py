"""The paged attention's CPU paths against a float64 reference computed over each request's
own tokens: the compiled decode kernel, decode buckets (padding must weigh nothing, grouped
heads must read their own KV head, bf16 inputs must keep float32 accuracy), long decodes and
prefill chunks over cached blocks, all reading the block-major cache the ``torch`` backend
keeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_engine import cpu_kernels
from inference_engine.attention import (
    CompiledDecodes,
    DecodeBucket,
    LongDecodes,
    PagedMetadata,
    PrefillChunk,
    block_major_rows,
    kv_cache_shape,
    paged_attention_forward,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 16
CASES = [(torch.float32, 4, 4, 1e-5), (torch.float32, 6, 2, 1e-5), (torch.bfloat16, 4, 2, 1e-2)]
COMPILED_CASES = [*CASES, (torch.float16, 8, 2, 2e-3), (torch.float32, 8, 1, 1e-5)]


@pytest.fixture(scope="module")
def decode_kernel():
    try:
        return cpu_kernels.paged_decode_attention()
    except cpu_kernels.KernelUnavailable as error:
        pytest.skip(f"the compiled CPU kernel cannot be built here: {error}")


def reference(query, keys, values, num_kv_heads, causal_offset=None):
    """query ``[H, n, D]``, keys/values ``[L, KVH, D]`` -> ``[H, n, D]`` in float64; query row
    ``i`` sees keys up to ``causal_offset + i`` when given, else all of them."""
    group = query.shape[0] // num_kv_heads
    keys = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    values = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hnd,hld->hnl", query.double(), keys) * HEAD_DIM**-0.5
    if causal_offset is not None:
        rows = torch.arange(query.shape[1])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(keys.shape[1])[None, :] > rows, float("-inf"))
    return torch.einsum("hnl,hld->hnd", torch.softmax(scores, dim=-1), values)


class Cache:
    """Block-major K/V caches of one layer, with scattered blocks handed out in no order."""

    def __init__(self, dtype, num_kv_heads, generator):
        shape = kv_cache_shape("torch", NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        self.keys = torch.randn(shape, generator=generator).to(dtype)
        self.values = torch.randn(shape, generator=generator).to(dtype)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        self.num_kv_heads = num_kv_heads

    def block_table(self, context_lens):
        table = torch.zeros(len(context_lens), -(-max(context_lens) // BLOCK_SIZE), dtype=int)
        for row, context_len in enumerate(context_lens):
            for block in range(-(-context_len // BLOCK_SIZE)):
                table[row, block] = self.free_blocks.pop()
        return table

    def tokens(self, blocks, length):
        """One request's first ``length`` cached keys and values as ``[L, KVH, D]``."""

        def read(cache):
            return cache[blocks].transpose(1, 2).reshape(-1, self.num_kv_heads, HEAD_DIM)

        return read(self.keys)[:length], read(self.values)[:length]

    def metadata(self, slot_mapping, **plan):
        rows = block_major_rows(slot_mapping, BLOCK_SIZE, self.num_kv_heads)
        return PagedMetadata([self.keys], [self.values], slot_mapping, cache_rows=rows, **plan)


def slots_of(block_table, row, positions):
    positions = torch.as_tensor(positions)
    return block_table[row, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def new_qkv(num_heads, num_kv_heads, num_tokens, dtype, generator):
    return [
        torch.randn(1, heads, num_tokens, HEAD_DIM, generator=generator).to(dtype)
        for heads in (num_heads, num_kv_heads, num_kv_heads)
    ]


def attend(meta, query, new_keys, new_values):
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0), query, new_keys, new_values, None, paged_metadata=meta
    )
    assert out.shape == (1, query.shape[2], query.shape[1], HEAD_DIM)
    assert out.dtype == query.dtype
    return out[0]


def test_block_major_rows_write_each_token_to_its_slot():
    num_kv_heads = 2
    cache = torch.zeros(kv_cache_shape("torch", 3, BLOCK_SIZE, num_kv_heads, HEAD_DIM))
    slots = torch.tensor([5, 0, 11])
    tokens = torch.randn(len(slots), num_kv_heads, HEAD_DIM)
    rows = block_major_rows(slots, BLOCK_SIZE, num_kv_heads)
    cache.view(-1, HEAD_DIM).index_copy_(0, rows, tokens.view(-1, HEAD_DIM))
    for slot, token in zip(slots.tolist(), tokens, strict=True):
        assert torch.equal(cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE], token)
    assert cache.count_nonzero() == tokens.count_nonzero()


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "tolerance"), COMPILED_CASES)
def test_compiled_decodes_match_attention_over_each_requests_own_tokens(
    decode_kernel, dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(3)
    cache = Cache(dtype, num_kv_heads, generator)
    # inside, at and across block boundaries, one token, and one long beside short ones
    context_lens = [1, 3, 4, 5, 9, 16, 61]
    block_table = cache.block_table(context_lens)  # padded with block 0, which others use
    # request i is packed at row rows[i], not in order
    rows = torch.tensor([6, 0, 5, 1, 3, 4, 2])
    num_tokens = len(rows)
    slot_mapping = torch.zeros(num_tokens, dtype=torch.long)
    for i, row in enumerate(rows.tolist()):
        slot_mapping[row] = slots_of(block_table, i, context_lens[i] - 1)
    decodes = CompiledDecodes(rows, block_table, torch.tensor(context_lens), decode_kernel)
    query, new_keys, new_values = new_qkv(num_heads, num_kv_heads, num_tokens, dtype, generator)

    meta = cache.metadata(slot_mapping, compiled_decodes=decodes)
    out = attend(meta, query, new_keys, new_values)

    for i, (row, context_len) in enumerate(zip(rows.tolist(), context_lens, strict=True)):
        keys, values = cache.tokens(block_table[i, : -(-context_len // BLOCK_SIZE)], context_len)
        assert torch.equal(keys[-1], new_keys[0, :, row])
        expected = reference(query[0, :, row : row + 1], keys, values, num_kv_heads)
        error = (out[row].double() - expected[:, 0]).abs().max().item()
        assert error < tolerance, (row, context_len, error)


def test_compiled_kernel_refuses_mismatched_inputs(decode_kernel):
    cache = Cache(torch.float32, 2, torch.Generator().manual_seed(4))
    query = torch.randn(1, 4, HEAD_DIM)
    table, lens = torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        decode_kernel(query.bfloat16(), cache.keys, cache.values, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        decode_kernel(query, cache.keys, cache.values, table.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        decode_kernel(torch.randn(1, 3, HEAD_DIM), cache.keys, cache.values, table, lens, 1.0)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "tolerance"), CASES)
def test_decode_bucket_matches_attention_over_each_requests_own_tokens(
    dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(0)
    cache = Cache(dtype, num_kv_heads, generator)
    context_lens = [1, 3, 4, 5, 9, 16]  # inside, at and across block boundaries
    block_table = cache.block_table(context_lens)
    slot_mapping = torch.stack(
        [slots_of(block_table, row, n - 1) for row, n in enumerate(context_lens)]
    )
    max_len = block_table.shape[1] * BLOCK_SIZE
    padding = torch.arange(max_len)[None, :] >= torch.tensor(context_lens)[:, None]
    bucket = DecodeBucket(
        query_index=torch.arange(len(context_lens)),
        block_table=block_table,
        padding=padding[:, None, None, :],
    )
    num_tokens = len(context_lens)
    query, new_keys, new_values = new_qkv(num_heads, num_kv_heads, num_tokens, dtype, generator)

    out = attend(cache.metadata(slot_mapping, decode_buckets=[bucket]), query, new_keys, new_values)

    for row, context_len in enumerate(context_lens):
        blocks = block_table[row, : -(-context_len // BLOCK_SIZE)]
        keys, values = cache.tokens(blocks, context_len)
        # the step's own token was written to the cache before attending
        assert torch.equal(keys[-1], new_keys[0, :, row])
        assert torch.equal(values[-1], new_values[0, :, row])
        expected = reference(query[0, :, row : row + 1], keys, values, num_kv_heads)
        error = (out[row].double() - expected[:, 0]).abs().max().item()
        assert error < tolerance, (row, context_len, error)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "tolerance"), CASES)
def test_long_decodes_attend_each_request_over_exactly_its_tokens(
    dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(1)
    cache = Cache(dtype, num_kv_heads, generator)
    context_lens = [13, 8, 21]  # ending inside and at a block's end
    block_table = cache.block_table(context_lens)
    num_blocks = [-(-n // BLOCK_SIZE) for n in context_lens]
    block_offsets = [sum(num_blocks[:i]) for i in range(len(num_blocks))]
    decodes = LongDecodes(
        rows=[1, 0, 2],
        context_lens=context_lens,
        token_offsets=[offset * BLOCK_SIZE for offset in block_offsets],
        block_ids=torch.cat([block_table[i, :n] for i, n in enumerate(num_blocks)]),
    )
    # request i is packed at row decodes.rows[i]
    slot_mapping = torch.zeros(len(context_lens), dtype=torch.long)
    for i, row in enumerate(decodes.rows):
        slot_mapping[row] = slots_of(block_table, i, context_lens[i] - 1)
    num_tokens = len(context_lens)
    query, new_keys, new_values = new_qkv(num_heads, num_kv_heads, num_tokens, dtype, generator)

    out = attend(cache.metadata(slot_mapping, long_decodes=decodes), query, new_keys, new_values)

    for i, (row, context_len) in enumerate(zip(decodes.rows, context_lens, strict=True)):
        keys, values = cache.tokens(block_table[i, : num_blocks[i]], context_len)
        assert torch.equal(keys[-1], new_keys[0, :, row])
        expected = reference(query[0, :, row : row + 1], keys, values, num_kv_heads)
        error = (out[row].double() - expected[:, 0]).abs().max().item()
        assert error < tolerance, (row, context_len, error)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "tolerance"), CASES)
def test_prefill_chunk_after_a_cached_prefix_attends_causally_over_its_blocks(
    dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(2)
    cache = Cache(dtype, num_kv_heads, generator)
    cached, num_new = 6, 5  # a prefix-cache hit ending inside a block, then a chunk
    context_len = cached + num_new
    block_table = cache.block_table([context_len])
    block_ids = block_table[0, : -(-context_len // BLOCK_SIZE)]
    mask = torch.arange(context_len)[None, :] <= torch.arange(cached, context_len)[:, None]
    chunk = PrefillChunk(0, num_new, context_len, block_ids, mask)
    slot_mapping = slots_of(block_table, 0, torch.arange(cached, context_len))
    query, new_keys, new_values = new_qkv(num_heads, num_kv_heads, num_new, dtype, generator)

    out = attend(cache.metadata(slot_mapping, prefill_chunks=[chunk]), query, new_keys, new_values)

    keys, values = cache.tokens(block_ids, context_len)
    assert torch.equal(keys[cached:], new_keys[0].transpose(0, 1))
    expected = reference(query[0], keys, values, num_kv_heads, causal_offset=cached)
    error = (out.transpose(0, 1).double() - expected).abs().max().item()
    assert error < tolerance, error
