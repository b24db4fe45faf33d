"""The paged attention's CPU paths against a float64 reference computed over each request's
own tokens: the compiled kernel (decodes, and chunks that extend a cached context), decode
buckets (padding must weigh nothing, grouped heads must read their own KV head, bf16 inputs
must keep float32 accuracy), long decodes and prefill chunks over cached blocks, all reading
the block-major cache the ``torch`` backend keeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_engine import cpu_kernels
from inference_engine.attention import (
    CompiledAttention,
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
def attention_kernel():
    try:
        return cpu_kernels.paged_attention()
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
def test_compiled_kernel_attends_decodes_and_chunks_over_each_requests_own_tokens(
    attention_kernel, dtype, num_heads, num_kv_heads, tolerance
):
    generator = torch.Generator().manual_seed(3)
    cache = Cache(dtype, num_kv_heads, generator)
    # decodes inside, at and across block boundaries, one token, one long beside short ones;
    # chunks after a cached prefix (ending inside a block), a whole prompt, and a chunk longer
    # than the kernel's 16-token tiles
    context_lens = [1, 3, 4, 5, 9, 16, 61, 11, 7, 40]
    query_lens = [1, 1, 1, 1, 1, 1, 1, 5, 7, 21]
    block_table = cache.block_table(context_lens)  # padded with block 0, which others use
    # the requests are packed in another order than theirs
    order = [6, 0, 8, 5, 1, 9, 3, 4, 2, 7]
    query_starts = [0] * len(order)
    row = 0
    for i in order:
        query_starts[i] = row
        row += query_lens[i]
    num_tokens = row
    slot_mapping = torch.zeros(num_tokens, dtype=torch.long)
    for i, (start, count) in enumerate(zip(query_starts, query_lens, strict=True)):
        positions = torch.arange(context_lens[i] - count, context_lens[i])
        slot_mapping[start : start + count] = slots_of(block_table, i, positions)
    compiled = CompiledAttention(
        block_table,
        torch.tensor(context_lens),
        torch.tensor(query_starts),
        torch.tensor(query_lens),
        attention_kernel,
    )
    query, new_keys, new_values = new_qkv(num_heads, num_kv_heads, num_tokens, dtype, generator)

    out = attend(cache.metadata(slot_mapping, compiled=compiled), query, new_keys, new_values)

    for i, (start, count) in enumerate(zip(query_starts, query_lens, strict=True)):
        context_len, rows = context_lens[i], slice(start, start + count)
        keys, values = cache.tokens(block_table[i, : -(-context_len // BLOCK_SIZE)], context_len)
        # the step's own tokens were written to the cache before attending
        assert torch.equal(keys[-count:], new_keys[0, :, rows].transpose(0, 1))
        expected = reference(
            query[0, :, rows], keys, values, num_kv_heads, causal_offset=context_len - count
        )
        error = (out[rows].transpose(0, 1).double() - expected).abs().max().item()
        assert error < tolerance, (i, context_len, count, error)


@pytest.mark.parametrize("head_dim", [12, 16, 48, 80, 128, 144])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_kernel_holds_for_any_head_dim_and_block_size(
    attention_kernel, head_dim, block_size, dtype
):
    """Head dims that are multiples of 16 take the vectorised path where the CPU has AVX2,
    the others (12) the portable one; both must give float64's answer."""
    generator = torch.Generator().manual_seed(head_dim + block_size)
    num_heads, num_kv_heads, num_blocks = 6, 2, 40
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    context_lens, query_lens, query_starts = [1, 9, 70, 33], [1, 1, 3, 18], [22, 0, 1, 4]
    width = -(-max(context_lens) // block_size)
    table = torch.randint(0, num_blocks, (len(context_lens), width), generator=generator)
    query = torch.randn(1, num_heads, 23, head_dim, generator=generator).to(dtype)
    out = torch.zeros(23, num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5

    q = query[0].transpose(0, 1)  # [T, H, D] with the engine's strides
    attention_kernel(
        out,
        q,
        keys,
        values,
        table,
        torch.tensor(context_lens),
        torch.tensor(query_starts),
        torch.tensor(query_lens),
        scale,
    )

    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    for i, (start, count) in enumerate(zip(query_starts, query_lens, strict=True)):
        context_len, rows = context_lens[i], slice(start, start + count)
        blocks = table[i, : -(-context_len // block_size)]

        def tokens(cache, blocks=blocks, context_len=context_len):
            return cache[blocks].transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:context_len]

        group = num_heads // num_kv_heads
        k = tokens(keys).double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = tokens(values).double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hnd,hld->hnl", q[rows].transpose(0, 1).double(), k) * scale
        visible = (
            torch.arange(context_len)[None, :]
            <= torch.arange(context_len - count, context_len)[:, None]
        )
        expected = torch.einsum(
            "hnl,hld->hnd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v
        )
        error = (out[rows].transpose(0, 1).double() - expected).abs().max().item()
        assert error < tolerance, (i, error)


def test_compiled_kernel_refuses_inputs_it_would_read_out_of_bounds(attention_kernel):
    cache = Cache(torch.float32, 2, torch.Generator().manual_seed(4))
    query = torch.randn(3, 4, HEAD_DIM)
    out = torch.empty_like(query)
    table, lens, starts, counts = (
        torch.tensor([[0, 1]]),
        torch.tensor([6]),
        torch.tensor([0]),
        torch.tensor([3]),
    )

    def call(**changed):
        args = {"out": out, "query": query, "table": table, "lens": lens, "starts": starts}
        args.update(changed)
        attention_kernel(
            args["out"],
            args["query"],
            cache.keys,
            cache.values,
            args["table"],
            args["lens"],
            args["starts"],
            changed.get("counts", counts),
            1.0,
        )

    call()  # the inputs as they are are fine
    with pytest.raises(RuntimeError, match="dtypes differ"):
        call(query=query.bfloat16())
    with pytest.raises(RuntimeError, match="int64"):
        call(table=table.int())
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        call(query=torch.randn(3, 3, HEAD_DIM), out=torch.empty(3, 3, HEAD_DIM))
    with pytest.raises(RuntimeError, match="outside the cache's 64 blocks"):
        call(table=torch.tensor([[0, NUM_BLOCKS]]))
    with pytest.raises(RuntimeError, match="does not hold"):
        call(lens=torch.tensor([2 * BLOCK_SIZE + 1]))  # past the table's two blocks
    with pytest.raises(RuntimeError, match="does not hold"):
        call(counts=torch.tensor([7]))  # more queries than context
    with pytest.raises(RuntimeError, match="outside \\[0, 3\\)"):
        call(starts=torch.tensor([1]))  # rows 1-3 of a 3-row query


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
