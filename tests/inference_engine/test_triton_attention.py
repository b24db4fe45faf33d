"""The GPU's paged-attention kernel, run on the CPU by Triton's interpreter, against a float64
reference computed over each request's own tokens: prefill chunks with and without cached
context, decodes, grouped heads (also a group that is not a power of two), keys across block
boundaries, blocks scattered in the cache, and padded slots in the block tables."""

from __future__ import annotations

import pytest
import torch

from tests.inference_engine.triton_interpreter import DEVICE, TRITON_EXPECTED

if not TRITON_EXPECTED:
    pytest.skip("Triton ships wheels for x86-64 Linux only", allow_module_level=True)

from inference_engine.triton_attention import paged_attention  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 96


def reference(query, keys, values, num_kv_heads, scale):
    """query ``[n, H, D]`` (the request's last ``n`` tokens), keys/values ``[L, KVH, D]`` ->
    ``[n, H, D]`` in float64, causal: query ``i`` sees keys ``0 .. L - n + i``."""
    num_new, num_heads, _ = query.shape
    group = num_heads // num_kv_heads
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), keys) * scale
    context = keys.shape[0] - num_new
    visible = torch.arange(keys.shape[0])[None, :] <= (context + torch.arange(num_new))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def build_step(requests, num_heads, num_kv_heads, head_dim, dtype, generator):
    """``requests``: (cached tokens, new tokens) each. Returns the step's tensors with the
    caches already holding every request's keys, as the attention function leaves them."""
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    seq_lens = [cached + new for cached, new in requests]
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE) + 2  # wider than any request needs
    # unused entries point at a real block: only seq_lens may bound what is read
    block_tables = torch.full((len(requests), max_blocks), free_blocks.pop(), dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens):
        for block in range(-(-seq_len // BLOCK_SIZE)):
            block_tables[row, block] = free_blocks.pop()
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor([new for _, new in requests]).cumsum(0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    tensors = query, key_cache, value_cache, block_tables, torch.tensor(seq_lens), query_start_loc
    return tuple(tensor.to(DEVICE) for tensor in tensors)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "tolerance"),
    [
        (torch.float32, 4, 4, 16, 1e-5),
        (torch.float32, 4, 2, 16, 1e-5),
        (torch.float32, 6, 2, 24, 1e-5),  # a group of 3 and a head size padded to 32
        (torch.bfloat16, 8, 2, 16, 2e-2),
    ],
)
def test_mixed_step_matches_attention_over_each_requests_own_tokens(
    dtype, num_heads, num_kv_heads, head_dim, tolerance
):
    generator = torch.Generator().manual_seed(0)
    requests = [
        (0, 7),  # a prefill with nothing cached
        (5, 1),  # decodes inside, at and across block boundaries
        (3, 1),
        (0, 1),
        (8, 9),  # a chunk after a cached prefix that ends on a block boundary
        (6, 21),  # a chunk longer than one query block, after a prefix inside a block
        (39, 1),  # a decode longer than one key tile
    ]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = build_step(
        requests, num_heads, num_kv_heads, head_dim, dtype, generator
    )
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens.to(torch.int32),
        query_start_loc,
        max_query_len=max(new for _, new in requests),
        scale=scale,
    )

    query, key_cache, value_cache, block_tables, out = (
        tensor.cpu() for tensor in (query, key_cache, value_cache, block_tables, out)
    )
    for row, (cached, new) in enumerate(requests):
        seq_len = cached + new
        blocks = block_tables[row, : -(-seq_len // BLOCK_SIZE)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        tokens = slice(int(query_start_loc[row]), int(query_start_loc[row + 1]))
        expected = reference(query[tokens], keys, values, num_kv_heads, scale)
        error = (out[tokens].double() - expected).abs().max().item()
        assert error < tolerance, (row, cached, new, error)


def test_a_decode_only_step_reads_its_query_through_strides():
    """The model hands the attention a transposed view (``[T, H, D]`` out of ``[H, T, D]``);
    the kernel must read it through its strides, not as if it were contiguous."""
    generator = torch.Generator().manual_seed(1)
    requests = [(11, 1), (2, 1), (17, 1), (30, 1)]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = build_step(
        requests, 4, 2, 16, torch.float32, generator
    )
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = torch.empty_like(query)

    paged_attention(
        out,
        strided,
        key_cache,
        value_cache,
        block_tables,
        seq_lens.to(torch.int32),
        query_start_loc,
        max_query_len=1,
        scale=0.25,
    )

    query, key_cache, value_cache, block_tables, out = (
        tensor.cpu() for tensor in (query, key_cache, value_cache, block_tables, out)
    )
    for row, (cached, new) in enumerate(requests):
        seq_len = cached + new
        blocks = block_tables[row, : -(-seq_len // BLOCK_SIZE)].long()
        keys = key_cache[blocks].reshape(-1, 2, 16)[:seq_len]
        values = value_cache[blocks].reshape(-1, 2, 16)[:seq_len]
        expected = reference(query[row : row + 1], keys, values, 2, 0.25)
        assert (out[row : row + 1].double() - expected).abs().max().item() < 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter compiles nothing")
def test_steps_of_new_shapes_reuse_the_compiled_kernel():
    """Triton compiles per specialization (an integer equal to 1 or divisible by 16, a pointer
    16-byte aligned): a step's metadata, packed into one upload at offsets that move with its
    shape, and its number of requests made eager steps of new shapes compile the kernel again
    (a second or so each) in the middle of serving."""
    from inference_engine.triton_attention import _paged_attention_kernel

    def compiled() -> int:
        return sum(len(caches[0]) for caches in _paged_attention_kernel.device_caches.values())

    generator = torch.Generator().manual_seed(2)
    for step, num_requests in enumerate((3, 1, 16, 5, 32, 7)):
        # contexts of 3 to 8 tokens (two blocks at most), moving with the step
        requests = [(2 + (step + row) % 6, 1) for row in range(num_requests)]
        query, key_cache, value_cache, block_tables, seq_lens, starts = build_step(
            requests, 4, 2, 16, torch.float32, generator
        )
        # packed as HostStaging packs a step: one int64 buffer, each part where the last ends
        parts = [torch.zeros(step + 1, device=DEVICE), block_tables, seq_lens, starts]
        packed = torch.cat([part.flatten().to(torch.int64) for part in parts])
        offset = step + 1
        table_end = offset + block_tables.numel()
        packed_tables = packed[offset:table_end].view(block_tables.shape)
        packed_lens = packed[table_end : table_end + num_requests]
        packed_starts = packed[table_end + num_requests :]
        paged_attention(
            torch.empty_like(query),
            query,
            key_cache,
            value_cache,
            packed_tables,
            packed_lens,
            packed_starts,
            max_query_len=1,
            scale=0.25,
        )
        if step == 0:
            first = compiled()
    torch.cuda.synchronize()
    assert compiled() == first
