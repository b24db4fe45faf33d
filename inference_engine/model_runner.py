"""All torch for one step: load an HF causal LM, allocate paged KV tensors, pack, forward, sample.

Dtype ``"auto"`` means the checkpoint's dtype, except that float16 on CPU becomes bfloat16
(CPU float16 matmuls are very slow); float32 and bfloat16 are kept as they are.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from inference_engine import attention
from inference_engine.attention import (
    DecodeBucket,
    LongDecodes,
    PagedMetadata,
    PrefillChunk,
    VarlenMetadata,
)
from inference_engine.config import EngineConfig
from inference_engine.protocol import TokenLogprobs
from inference_engine.sampler import Sampler, SamplingRow
from inference_engine.scheduler import ScheduledRequest

# a decode joins the current bucket while its context is at least this share of the longest
DECODE_BUCKET_RATIO = 0.5
# decodes with at least this many context tokens are attended one by one, unmasked
LONG_DECODE_MIN_CONTEXT = 256
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
CUDA_KV_CACHE_FRACTION = 0.8
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@dataclass
class ModelSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the OS. Each step allocates the same
    large temporaries (gathered K/V, activations); without this every one of them is a fresh
    mmap whose pages fault in again, which costs more than the attention itself on CPU."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 31)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, config_dtype: torch.dtype | str | None, device: torch.device):
    if name != "auto":
        return getattr(torch, name)
    dtype = getattr(torch, config_dtype) if isinstance(config_dtype, str) else config_dtype
    dtype = dtype or torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16
    return dtype


def model_spec(hf_config, generation_config) -> ModelSpec:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    eos_ids: set[int] = set()
    for source in (hf_config, generation_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        eos_ids.update([eos] if isinstance(eos, int) else (eos or []))
    max_positions = getattr(hf_config, "max_position_embeddings", None) or 2048
    # the paged attention attends over the whole context: cap the length where the model
    # would slide a window instead, so outputs never silently differ from the model's own
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        max_positions = min(max_positions, window)
    return ModelSpec(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        eos_token_ids=frozenset(eos_ids),
    )


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        attention.register()
        torch.set_grad_enabled(False)
        if resolve_device(config.device).type == "cpu":
            keep_freed_memory()
        self.config = config
        self.device = resolve_device(config.device)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, getattr(hf_config, "dtype", None), self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=self.dtype, attn_implementation=attention.ATTENTION_NAME
        )
        self.model.to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.spec = model_spec(self.model.config, getattr(self.model, "generation_config", None))
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.key_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        self.value_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        self.sampler = Sampler(self.device)
        self.use_varlen = (
            attention.flash_attn_varlen_func is not None and self.device.type == "cuda"
        )

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def bytes_per_block(self) -> int:
        spec = self.spec
        element_size = torch.finfo(self.dtype).bits // 8
        return (
            2
            * spec.num_layers
            * self.block_size
            * spec.num_kv_heads
            * spec.head_dim
            * (element_size)
        )

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory is not None:
            num_blocks = self.config.kv_cache_memory // self.bytes_per_block
        elif self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            num_blocks = int(free_bytes * CUDA_KV_CACHE_FRACTION) // self.bytes_per_block
        else:
            max_len = self.config.max_model_len or self.spec.max_position_embeddings
            wanted = self.config.max_num_seqs * -(-max_len // self.block_size)
            num_blocks = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError("KV cache memory is too small for a single block")
        return int(num_blocks)

    def release(self, req_ids: list[str]) -> None:
        self.sampler.release(req_ids)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Run one step. Returns the sampled token per sampling request and its logprobs
        where asked for."""
        input_ids, positions, logits_rows, meta = self._prepare(scheduled, block_tables)
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
            logits_to_keep=logits_rows,
            paged_metadata=meta,
        )
        sampling = [item.request for item in scheduled if item.is_sampling]
        if not sampling:
            return {}, {}
        rows = [
            SamplingRow(
                r.req_id, r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids
            )
            for r in sampling
        ]
        token_ids, logprobs = self.sampler(output.logits[0], rows)
        sampled = {r.req_id: token for r, token in zip(sampling, token_ids, strict=True)}
        wanted = {r.req_id: lp for r, lp in zip(sampling, logprobs, strict=True) if lp is not None}
        return sampled, wanted

    def _prepare(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]):
        block_size, device = self.block_size, self.device
        num_requests = len(scheduled)
        token_ids: list[int] = []
        for item in scheduled:
            token_ids.extend(
                item.request.all_token_ids[item.start : item.start + item.num_new_tokens]
            )
        lens = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, num_requests)
        starts = np.fromiter((item.start for item in scheduled), np.int64, num_requests)
        context_lens = starts + lens
        cu_lens = np.zeros(num_requests + 1, np.int64)
        np.cumsum(lens, out=cu_lens[1:])
        num_tokens = int(cu_lens[-1])
        req_of_token = np.repeat(np.arange(num_requests), lens)
        positions = np.arange(num_tokens) - cu_lens[:-1][req_of_token] + starts[req_of_token]
        max_blocks = max(len(table) for table in block_tables)
        table = np.zeros((num_requests, max_blocks), np.int64)
        for i, block_ids in enumerate(block_tables):
            table[i, : len(block_ids)] = block_ids
        slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
        is_sampling = np.fromiter((item.is_sampling for item in scheduled), bool, num_requests)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        meta = PagedMetadata(self.key_caches, self.value_caches, to_device(slots))
        if self.use_varlen:
            cu_seqlens_k = np.zeros(num_requests + 1, np.int64)
            np.cumsum(context_lens, out=cu_seqlens_k[1:])
            req_of_key = np.repeat(np.arange(num_requests), context_lens)
            key_pos = np.arange(int(cu_seqlens_k[-1])) - cu_seqlens_k[:-1][req_of_key]
            key_slots = table[req_of_key, key_pos // block_size] * block_size
            meta.varlen = VarlenMetadata(
                to_device(cu_lens.astype(np.int32)),
                to_device(cu_seqlens_k.astype(np.int32)),
                int(lens.max()),
                int(context_lens.max()),
                to_device(key_slots + key_pos % block_size),
            )
        else:
            self._plan_cpu_attention(meta, table, lens, starts, context_lens, cu_lens, to_device)
        logits_rows = to_device(cu_lens[1:][is_sampling] - 1)
        input_tensor = torch.tensor(token_ids, dtype=torch.long).to(device).unsqueeze(0)
        return input_tensor, to_device(positions).unsqueeze(0), logits_rows, meta

    def _plan_cpu_attention(self, meta, table, lens, starts, context_lens, cu_lens, to_device):
        block_size = self.block_size
        for i in np.flatnonzero(lens > 1):
            start, num_new, context_len = int(starts[i]), int(lens[i]), int(context_lens[i])
            block_ids = mask = None
            if start > 0:
                block_ids = to_device(table[i, : -(-context_len // block_size)])
                query_pos = np.arange(start, context_len)[:, None]
                mask = to_device(np.arange(context_len)[None, :] <= query_pos)
            meta.prefill_chunks.append(
                PrefillChunk(int(cu_lens[i]), num_new, context_len, block_ids, mask)
            )
        long_decodes = np.flatnonzero((lens == 1) & (context_lens >= LONG_DECODE_MIN_CONTEXT))
        if len(long_decodes):
            num_blocks = -(-context_lens[long_decodes] // block_size)
            block_offsets = np.zeros(len(long_decodes), np.int64)
            np.cumsum(num_blocks[:-1], out=block_offsets[1:])
            block_ids = np.concatenate(
                [table[i, :n] for i, n in zip(long_decodes, num_blocks, strict=True)]
            )
            meta.long_decodes = LongDecodes(
                cu_lens[long_decodes].tolist(),
                context_lens[long_decodes].tolist(),
                (block_offsets * block_size).tolist(),
                to_device(block_ids),
            )
        decodes = np.flatnonzero((lens == 1) & (context_lens < LONG_DECODE_MIN_CONTEXT))
        if len(decodes) == 0:
            return
        decodes = decodes[np.argsort(-context_lens[decodes], kind="stable")]
        bucket_start = 0
        for end in range(1, len(decodes) + 1):
            longest = context_lens[decodes[bucket_start]]
            if end < len(decodes) and context_lens[decodes[end]] >= DECODE_BUCKET_RATIO * longest:
                continue
            members = decodes[bucket_start:end]
            num_blocks = -(-int(longest) // block_size)
            padding = np.arange(num_blocks * block_size)[None, :] >= context_lens[members][:, None]
            meta.decode_buckets.append(
                DecodeBucket(
                    to_device(cu_lens[members]),
                    to_device(np.ascontiguousarray(table[members, :num_blocks])),
                    to_device(padding[:, None, None, :]),
                    int(longest),
                )
            )
            bucket_start = end
