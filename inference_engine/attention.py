"""Paged attention registered with transformers' ``AttentionInterface`` as ``"paged_engine"``.

The model runs one packed row per step (``[1, T]``) with ``attention_mask=None``. The runner
passes a ``PagedMetadata`` as the ``paged_metadata`` forward kwarg; transformers forwards it to
every attention call. This function writes the step's K/V into the paged cache of
``module.layer_idx`` and attends each request over its own blocks, causally:

- short decodes (one new token) are batched in buckets of similar context length: one gather
  of their blocks into a float32 ``[B, KVH, L, D]`` copy, then two batched matmuls and a
  masked softmax per bucket (on the CPU this is about twice as fast as a masked bf16 SDPA
  call, and it accumulates in float32 throughout); long decodes run one unmasked SDPA call
  each over exactly their tokens, which is faster than padding buckets at that size;
- prefill chunks run one SDPA call each, over the step's own K/V when nothing precedes them,
  else over their gathered blocks with an offset causal mask;
- on a GPU (the ``triton`` backend) every request of the step, prefill chunk or decode, goes
  through one Triton kernel launch that reads K/V straight from the paged cache through the
  block tables (``triton_attention.py``); no Python loop over requests, no per-step gather, and
  nothing read back to the host, so decode steps can be replayed from CUDA graphs;
- with the ``flash_attn`` backend, every request goes through one varlen call over a gather of
  its context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "paged_engine"


@dataclass
class DecodeBucket:
    query_index: torch.Tensor  # [B] rows of the packed step
    block_table: torch.Tensor  # [B, max_blocks] padded with 0
    padding: torch.Tensor  # [B, 1, 1, max_blocks * block_size] True past each one's context


@dataclass
class LongDecodes:
    """Decodes with long contexts: their blocks are gathered together, then each is attended
    alone over exactly its tokens without a mask (faster than masking padded buckets)."""

    rows: list[int]  # their rows in the packed step
    context_lens: list[int]
    token_offsets: list[int]  # where each one's tokens start in the gathered blocks
    block_ids: torch.Tensor  # [sum of their block counts]


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the packed step
    num_tokens: int
    context_len: int  # tokens with KV after this chunk (cached prefix + chunk)
    block_ids: torch.Tensor | None  # [num_blocks] when context precedes the chunk
    mask: torch.Tensor | None  # [num_tokens, context_len] causal with offset


@dataclass
class VarlenMetadata:
    cu_seqlens_q: torch.Tensor  # [R + 1] int32
    cu_seqlens_k: torch.Tensor  # [R + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    key_slots: torch.Tensor  # [sum(context_len)] cache slots in request order


@dataclass
class UnifiedMetadata:
    """Every request of the step for the Triton kernel, in the step's packing order."""

    block_tables: torch.Tensor  # [R, max_blocks] int64
    seq_lens: torch.Tensor  # [R] context after this step
    query_start_loc: torch.Tensor  # [R + 1] first row of each request in the packed step
    max_query_len: int  # host-side bound: picks the kernel's tile shape, never read on device


@dataclass
class PagedMetadata:
    """One step's paged layout, built once by the runner and shared by every layer."""

    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    long_decodes: LongDecodes | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    varlen: VarlenMetadata | None = None
    unified: UnifiedMetadata | None = None


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


flash_attn_varlen_func = _flash_attn_varlen() if torch.cuda.is_available() else None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(requested: str, device: torch.device) -> str:
    """The attention backend for ``device``: ``auto`` is Triton's kernel on a GPU, torch's
    vectorised ops on the CPU (where they are faster than anything Triton runs)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if requested == "flash_attn" and (device.type != "cuda" or flash_attn_varlen_func is None):
        raise ValueError("the flash_attn attention backend needs CUDA and flash-attn installed")
    if requested == "triton":
        if not triton_available():
            raise ValueError("the triton attention backend needs Triton installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs CUDA (or TRITON_INTERPRET=1)")
    return requested


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_metadata: PagedMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query ``[1, H, T, D]``, key/value ``[1, KVH, T, D]`` -> output ``[1, T, H, D]``."""
    if paged_metadata is None:
        raise RuntimeError("paged_engine attention needs the paged_metadata forward kwarg")
    meta = paged_metadata
    key_cache = meta.key_caches[module.layer_idx]
    value_cache = meta.value_caches[module.layer_idx]
    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = key.shape[1]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    flat_shape = (-1, num_kv_heads, head_dim)
    key_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
    value_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, v.to(value_cache.dtype))

    if meta.unified is not None:
        from inference_engine.triton_attention import paged_attention

        out = torch.empty_like(q)
        unified = meta.unified
        paged_attention(
            out,
            q,
            key_cache,
            value_cache,
            unified.block_tables,
            unified.seq_lens,
            unified.query_start_loc,
            unified.max_query_len,
            head_dim**-0.5 if scaling is None else scaling,
        )
        return out.unsqueeze(0), None

    if meta.varlen is not None and flash_attn_varlen_func is not None:
        varlen = meta.varlen
        out = flash_attn_varlen_func(
            q,
            key_cache.view(flat_shape)[varlen.key_slots],
            value_cache.view(flat_shape)[varlen.key_slots],
            varlen.cu_seqlens_q,
            varlen.cu_seqlens_k,
            varlen.max_seqlen_q,
            varlen.max_seqlen_k,
            softmax_scale=scaling,
            causal=True,
        )
        return out.unsqueeze(0), None

    gqa = num_heads != num_kv_heads
    out = torch.empty_like(q)
    for chunk in meta.prefill_chunks:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        chunk_q = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.block_ids is None:
            chunk_k = k[rows].transpose(0, 1).unsqueeze(0)
            chunk_v = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            chunk_k = _gather(key_cache, chunk.block_ids, chunk.context_len)
            chunk_v = _gather(value_cache, chunk.block_ids, chunk.context_len)
        result = F.scaled_dot_product_attention(
            chunk_q,
            chunk_k.to(q.dtype),
            chunk_v.to(q.dtype),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scaling,
            enable_gqa=gqa,
        )
        out[rows] = result[0].transpose(0, 1)
    if meta.long_decodes is not None:
        _attend_long_decodes(out, q, key_cache, value_cache, meta.long_decodes, scaling)
    for bucket in meta.decode_buckets:
        _attend_decode_bucket(out, q, key_cache, value_cache, bucket, scaling)
    return out.unsqueeze(0), None


def _attend_decode_bucket(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    bucket: DecodeBucket,
    scaling: float | None,
) -> None:
    """One query token per request over its padded blocks: ``softmax(q K^T) V`` in float32.

    The heads that share a KV head are its query rows (``[B, KVH, G, D]``), so GQA needs no
    K/V expansion. Padded key positions get ``-inf`` before the softmax, so they weigh 0."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    batch = bucket.block_table.shape[0]
    scale = head_dim**-0.5 if scaling is None else scaling
    keys = _gather_heads_first(key_cache, bucket.block_table)
    values = _gather_heads_first(value_cache, bucket.block_table)
    queries = q.index_select(0, bucket.query_index).view(batch, num_kv_heads, -1, head_dim)
    scores = torch.matmul(queries.float(), keys.transpose(-1, -2))  # [B, KVH, G, L]
    scores.mul_(scale).masked_fill_(bucket.padding, float("-inf"))
    result = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, KVH, G, D]
    out.index_copy_(0, bucket.query_index, result.view(batch, num_heads, head_dim).to(out.dtype))


def _gather_heads_first(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The blocks of ``block_table`` (``[B, N]``) as one contiguous float32 ``[B, KVH, N *
    block_size, D]``: one gather, then one copy that transposes and widens. Batched matmuls
    over this layout run far faster on the CPU than over the strided bf16 view."""
    batch, num_blocks = block_table.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    tokens = cache.flatten(1).index_select(0, block_table.view(-1))
    tokens = tokens.view(batch, num_blocks * block_size, num_kv_heads, head_dim)
    shape = (batch, num_kv_heads, num_blocks * block_size, head_dim)
    heads_first = torch.empty(shape, dtype=torch.float32, device=cache.device)
    return heads_first.copy_(tokens.transpose(1, 2))


def _attend_long_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decodes: LongDecodes,
    scaling: float | None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    keys = key_cache.flatten(1).index_select(0, decodes.block_ids).view(-1, num_kv_heads, head_dim)
    values = value_cache.flatten(1).index_select(0, decodes.block_ids)
    values = values.view(-1, num_kv_heads, head_dim)
    # the heads that share a KV head become its query rows: no K/V expansion for GQA
    queries = q.index_select(0, torch.tensor(decodes.rows, device=q.device))
    queries = queries.view(-1, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    for i, (row, length, offset) in enumerate(
        zip(decodes.rows, decodes.context_lens, decodes.token_offsets, strict=True)
    ):
        tokens = slice(offset, offset + length)
        result = F.scaled_dot_product_attention(
            queries[i],
            keys[tokens].transpose(0, 1).unsqueeze(0).to(q.dtype),
            values[tokens].transpose(0, 1).unsqueeze(0).to(q.dtype),
            scale=scaling,
        )
        out[row] = result.view(num_heads, head_dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached tokens of one request as ``[1, KVH, L, D]``."""
    tokens = cache.flatten(1).index_select(0, block_ids).view(-1, *cache.shape[2:])[:context_len]
    return tokens.transpose(0, 1).unsqueeze(0)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
