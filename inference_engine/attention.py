"""Paged attention registered with transformers' ``AttentionInterface`` as ``"paged_engine"``.

The model runs one packed row per step (``[1, T]``) with ``attention_mask=None``. The runner
passes a ``PagedMetadata`` as the ``paged_metadata`` forward kwarg; transformers forwards it to
every attention call. This function writes the step's K/V into the paged cache of
``module.layer_idx`` and attends each request over its own blocks, causally:

- the ``torch`` backend keeps each layer's cache block-major, ``[num_blocks, KVH, block_size,
  D]``, so a block is one contiguous ``[KVH, block_size, D]`` tile; the GPU backends keep it
  token-major, ``[num_blocks, block_size, KVH, D]`` (``kv_cache_shape``);
- with the compiled CPU kernel (``cpu_kernels.py``, the default where a C++ compiler is found),
  every decode of the step is attended in one call that reads each one's K/V straight from
  its blocks; otherwise:
- short decodes (one new token) are batched in buckets of similar context length: one
  ``index_select`` of their blocks, kept as blocks (``[B, N, KVH, block_size, D]``, no
  transpose into one long sequence), then batched matmuls per block, a masked softmax over all
  of a request's blocks, and a sum of the blocks' weighted values, accumulating in float32
  throughout; long decodes run one unmasked SDPA call each over exactly their tokens, which
  is faster than padding buckets at that size;
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
from collections.abc import Callable
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
class CompiledAttention:
    """The step's requests attended by the compiled CPU kernel (``cpu_kernels.py``): every
    decode, and every chunk that extends a cached context or is short."""

    block_table: torch.Tensor  # [R, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [R] int64: tokens with KV once the step's are written
    query_starts: torch.Tensor  # [R] int64: the first row of each in the packed step
    query_lens: torch.Tensor  # [R] int64
    kernel: Callable[..., None]


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

    key_caches: list[torch.Tensor]  # per layer, in ``kv_cache_shape``'s layout
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    # [T * KVH] rows of a block-major cache viewed as [-1, head_dim]; None: token-major cache
    cache_rows: torch.Tensor | None = None
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    long_decodes: LongDecodes | None = None
    compiled: CompiledAttention | None = None
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


def kv_cache_shape(
    backend: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache: block-major for the ``torch`` backend, whose decode matmuls
    read a gathered block as it lies; token-major for the GPU kernels, which index slots."""
    if backend == "torch":
        return (num_blocks, num_kv_heads, block_size, head_dim)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def block_major_rows(slots: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """The rows that slots ``[T]`` write in a block-major cache viewed as ``[-1, head_dim]``:
    ``[T * KVH]``, token after token, each token's heads in order."""
    blocks, offsets = slots // block_size, slots % block_size
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = (blocks * num_kv_heads).unsqueeze(1) + heads.unsqueeze(0)
    return (rows * block_size + offsets.unsqueeze(1)).view(-1)


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
    if meta.cache_rows is None:
        key_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
        value_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, v.to(value_cache.dtype))
    else:
        rows = (-1, head_dim)
        key_cache.view(rows).index_copy_(0, meta.cache_rows, k.reshape(rows).to(key_cache.dtype))
        value_cache.view(rows).index_copy_(
            0, meta.cache_rows, v.reshape(rows).to(value_cache.dtype)
        )

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

    if meta.cache_rows is None:
        raise RuntimeError("the torch attention backend needs a block-major cache")
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(q)
    for chunk in meta.prefill_chunks:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        chunk_q = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.block_ids is None:
            chunk_k = k[rows].transpose(0, 1).unsqueeze(0)
            chunk_v = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            chunk_k = _gather(key_cache, chunk.block_ids, chunk.context_len).unsqueeze(0)
            chunk_v = _gather(value_cache, chunk.block_ids, chunk.context_len).unsqueeze(0)
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
    if meta.compiled is not None:
        compiled = meta.compiled
        compiled.kernel(
            out,
            q,
            key_cache,
            value_cache,
            compiled.block_table,
            compiled.context_lens,
            compiled.query_starts,
            compiled.query_lens,
            head_dim**-0.5 if scaling is None else scaling,
        )
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

    The blocks stay blocks: scores are batched matmuls over ``[B, N, KVH]`` tiles of
    ``block_size`` keys, read as the gather left them (concatenating a request's blocks into
    one sequence would copy every key again). The heads that share a KV head are its query
    rows (``[.., KVH, G, D]``), so GQA needs no K/V expansion. Padded key positions get
    ``-inf`` before the softmax, so they weigh 0."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[1]
    batch, num_blocks = bucket.block_table.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    keys = _gather_blocks(key_cache, bucket.block_table)  # [B, N, KVH, block_size, D]
    values = _gather_blocks(value_cache, bucket.block_table)
    queries = q.index_select(0, bucket.query_index).view(batch, 1, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries.float(), keys.transpose(-1, -2))  # [B, N, KVH, G, block_size]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group, -1)
    scores.mul_(scale).masked_fill_(bucket.padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group, num_blocks, -1)
    result = torch.matmul(probs.permute(0, 3, 1, 2, 4), values).sum(1)  # [B, KVH, G, D]
    out.index_copy_(0, bucket.query_index, result.view(batch, num_heads, head_dim).to(out.dtype))


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The blocks of ``block_table`` (``[B, N]``) as float32 ``[B, N, KVH, block_size, D]``:
    one ``index_select`` of whole blocks, widened where the cache is narrower."""
    blocks = cache.index_select(0, block_table.view(-1)).view(*block_table.shape, *cache.shape[1:])
    return blocks.float()


def _attend_long_decodes(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    decodes: LongDecodes,
    scaling: float | None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    key_blocks = key_cache.index_select(0, decodes.block_ids)  # [sum of blocks, KVH, bs, D]
    value_blocks = value_cache.index_select(0, decodes.block_ids)
    # the heads that share a KV head become its query rows: no K/V expansion for GQA
    queries = q.index_select(0, torch.tensor(decodes.rows, device=q.device))
    queries = queries.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    for i, (row, length, offset) in enumerate(
        zip(decodes.rows, decodes.context_lens, decodes.token_offsets, strict=True)
    ):
        blocks = slice(offset // block_size, (offset + length - 1) // block_size + 1)
        result = F.scaled_dot_product_attention(
            queries[i],
            _as_sequence(key_blocks[blocks], length).to(q.dtype),
            _as_sequence(value_blocks[blocks], length).to(q.dtype),
            scale=scaling,
        )
        out[row] = result.view(num_heads, head_dim)


def _as_sequence(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Block-major ``[n, KVH, block_size, D]`` as one request's first ``length`` tokens,
    ``[KVH, length, D]``."""
    num_kv_heads, head_dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length]


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached tokens of one request as ``[KVH, L, D]``."""
    return _as_sequence(cache.index_select(0, block_ids), context_len)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
