"""Paged attention for the GPU: one Triton launch per layer for every request of a step.

Prefill chunks (with or without cached context before them) and decodes go through the same
kernel, as in vLLM's ``triton_unified_attention``. Each program takes ``BLOCK_Q`` query tokens
of one request and the ``G`` query heads that share one KV head (``BLOCK_M = BLOCK_Q * G``
rows), walks that request's keys straight out of the paged cache through its block table in
tiles of ``TILE_SIZE`` positions, and keeps an online softmax in float32. Nothing is gathered
per step and no host value is read on the device side, so a launch can be captured in a CUDA
graph.

The grid's first axis has ``num_tokens // BLOCK_Q + num_requests`` programs: request ``r``
owns programs ``query_start_loc[r] // BLOCK_Q + r`` onwards, which is at least as many as its
query tokens need. A program finds its request by binary search over ``query_start_loc`` and
leaves at once when its query block lies past the request's tokens.

``TRITON_INTERPRET=1`` runs the kernel on CPU tensors, which is how the tests check it in CI.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MIN_DOT_SIZE = 16  # tl.dot needs every dimension of at least 16 on the GPU
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
TILE_SIZE = 32
LOG2_E = 1.4426950408889634
# Triton 3.6's interpreter multiplies 16-bit floats as raw bits: there the dots run in float32
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_requests, BLOCK_Q: tl.constexpr):
    """The last request whose first query block is at or before ``q_block``."""
    low = 0
    high = num_requests
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            low = mid + 1
        else:
            high = mid
    return low - 1


# Triton compiles a kernel per specialization of its arguments: an integer equal to 1 or
# divisible by 16, a pointer aligned to 16 bytes. The step's block tables, lengths and starts
# sit in one packed upload at offsets that move with each step's shape, and the number of
# requests and the table's width change every step: specialized on, an eager step of a new
# shape compiled the kernel anew (a second or so each, several times in a benchmark's run).
@triton.jit(
    do_not_specialize=["num_requests", "stride_block_table"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_requests,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc_ptr, q_block, num_requests, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    local_block = q_block - (query_start // BLOCK_Q + request)
    if local_block * BLOCK_Q >= query_len:
        return

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    query_in_block = rows // QUERIES_PER_KV
    query_index = local_block * BLOCK_Q + query_in_block  # within this request's new tokens
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (query_in_block < BLOCK_Q) & (query_index < query_len)
    dim_valid = dims < HEAD_DIM
    query_offsets = (query_start + query_index)[:, None] * stride_q_token
    query_offsets += head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + query_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    seq_len = tl.load(seq_lens_ptr + request)
    context_len = seq_len - query_len  # tokens cached before this step's
    # a query sees keys up to its own position: the block's last query bounds the walk
    last_key = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    query_position = context_len + query_index

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table = block_tables_ptr + request * stride_block_table
    for tile_start in range(0, last_key, TILE_SIZE):
        positions = tile_start + tl.arange(0, TILE_SIZE)
        key_valid = positions < last_key
        blocks = tl.load(block_table + positions // BLOCK_SIZE, mask=key_valid, other=0)
        slots = blocks.to(tl.int64) * stride_cache_block
        slots += (positions % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        keys = tl.load(key_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        keys = keys.to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (positions[None, :] <= query_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # every row sees position 0 in the first tile, so the running max is finite from then
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        values = tl.load(value_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None]
        acc += tl.dot(weights.to(DOT_DTYPE), values.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        running_max = new_max

    acc = acc / running_sum[:, None]
    out_offsets = (query_start + query_index)[:, None] * stride_out_token
    out_offsets += head[:, None] * stride_out_head + dims[None, :]
    out_mask = row_valid[:, None] & dim_valid[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """Attend every request of a step over its paged keys, causally, into ``out``.

    ``query``/``out`` ``[T, H, D]`` packed request after request; caches ``[num_blocks,
    block_size, KVH, D]`` already holding this step's keys; ``block_tables`` ``[R, N]`` int32;
    ``seq_lens`` ``[R]`` int32, each request's context after this step; ``query_start_loc``
    ``[R + 1]`` int32, where each request's tokens start in ``query``. ``max_query_len`` is a
    host-side bound that only picks the tile shape; it is never read on the device."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_requests = block_tables.shape[0]
    queries_per_kv = num_heads // num_kv_heads
    block_m = PREFILL_BLOCK_M if max_query_len > 1 else DECODE_BLOCK_M
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (num_tokens // block_q + num_requests, num_kv_heads)
    # float32 models attend in full float32 (no TF32), so greedy parity holds exactly
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    dot_dtype = tl.float32 if INTERPRETING else DOT_DTYPES[query.dtype]
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2_E,
        num_requests,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(triton.next_power_of_2(head_dim), MIN_DOT_SIZE),
        BLOCK_SIZE=block_size,
        TILE_SIZE=TILE_SIZE,
        DOT_PRECISION=precision,
        DOT_DTYPE=dot_dtype,
    )
