"""All torch for one step: load an HF causal LM, allocate paged KV tensors, pack, forward, sample.

Dtype ``"auto"`` means the checkpoint's dtype, except that float16 on CPU becomes bfloat16
(CPU float16 matmuls are very slow); float32 and bfloat16 are kept as they are. On a CPU
without bf16 matrix units the batched linear layers multiply in float32 (``cpu_linear.py``).

On a GPU a step's inputs are packed on the host into one pinned buffer and copied once; the
attention is one Triton launch per layer; decode-only steps replay CUDA graphs; and the one
device-to-host copy is the sampled token ids. ``launch`` queues a step without waiting for it
(``PendingStep.result`` waits), so the core can schedule the next one meanwhile (async
scheduling); a decode whose input token is still being sampled reads it on the device.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from inference_engine import attention, prompt_logprobs
from inference_engine.attention import (
    CompiledAttention,
    DecodeBucket,
    LongDecodes,
    PagedMetadata,
    PrefillChunk,
    UnifiedMetadata,
    VarlenMetadata,
)
from inference_engine.config import EngineConfig
from inference_engine.cpu_kernels import paged_attention, use_compiled_attention
from inference_engine.cpu_linear import should_widen, widen_linears
from inference_engine.cuda_graphs import DecodeBatch, DecodeGraphs
from inference_engine.penalties import TokensInFlight
from inference_engine.prompt_logprobs import PendingPromptLogprobs, PromptRows, plan_prompt_rows
from inference_engine.protocol import SamplingParams, TokenLogprobs
from inference_engine.request import Request, RequestStatus
from inference_engine.sampler import SampledTokens, Sampler, SamplingRow
from inference_engine.scheduler import ScheduledRequest

# a decode joins the current bucket while its context is at least this share of the longest
DECODE_BUCKET_RATIO = 0.5
# decodes with at least this many context tokens are attended one by one, unmasked
LONG_DECODE_MIN_CONTEXT = 256
# with the compiled CPU kernel, a fresh prompt chunk longer than this is one causal SDPA call
COMPILED_MAX_FRESH_TOKENS = 64
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step packed on the host, request after request (``R`` requests, ``T`` tokens)."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    lens: np.ndarray  # [R] new tokens
    starts: np.ndarray  # [R] position of each one's first new token
    context_lens: np.ndarray  # [R] tokens with KV after this step
    cu_lens: np.ndarray  # [R + 1] first row of each request
    block_table: np.ndarray  # [R, max_blocks] padded with 0
    logits_rows: np.ndarray  # [S] the last row of each sampling request
    # the prompt rows whose logprobs are asked for, kept after the sampling rows
    prompt: PromptRows | None = None
    # rows of ``token_ids`` whose id a step still in flight is sampling (async scheduling),
    # and their requests: 0 on the host, the sampled id copied in on the device
    device_token_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    device_token_req_ids: list[str] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return (
            bool((self.lens == 1).all())
            and len(self.logits_rows) == len(self.lens)
            and self.prompt is None
        )

    @property
    def kept_rows(self) -> np.ndarray:
        """The rows the forward keeps logits for: the sampling rows, then the prompt rows."""
        if self.prompt is None:
            return self.logits_rows
        return np.concatenate([self.logits_rows, self.prompt.rows])

    def decode_batch(self) -> DecodeBatch:
        return DecodeBatch(
            self.token_ids, self.positions, self.slot_mapping, self.context_lens, self.block_table
        )


def plan_step(
    scheduled: list[ScheduledRequest], block_tables: list[list[int]], block_size: int
) -> StepPlan:
    num_requests = len(scheduled)
    token_ids: list[int] = []
    device_token_rows: list[int] = []
    device_token_req_ids: list[str] = []
    for item in scheduled:
        request = item.request
        token_ids.extend(request.all_token_ids[item.start : item.start + item.num_new_tokens])
        if item.has_device_token:
            device_token_rows.append(len(token_ids))
            device_token_req_ids.append(request.req_id)
            token_ids.append(0)
    lens = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, num_requests)
    starts = np.fromiter((item.start for item in scheduled), np.int64, num_requests)
    cu_lens = np.zeros(num_requests + 1, np.int64)
    np.cumsum(lens, out=cu_lens[1:])
    req_of_token = np.repeat(np.arange(num_requests), lens)
    positions = np.arange(int(cu_lens[-1])) - cu_lens[:-1][req_of_token] + starts[req_of_token]
    table = np.zeros((num_requests, max(len(ids) for ids in block_tables)), np.int64)
    for i, block_ids in enumerate(block_tables):
        table[i, : len(block_ids)] = block_ids
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    is_sampling = np.fromiter((item.is_sampling for item in scheduled), bool, num_requests)
    return StepPlan(
        token_ids=np.array(token_ids, np.int64),
        positions=positions,
        slot_mapping=slots,
        lens=lens,
        starts=starts,
        context_lens=starts + lens,
        cu_lens=cu_lens,
        block_table=table,
        logits_rows=cu_lens[1:][is_sampling] - 1,
        prompt=plan_prompt_rows(scheduled, cu_lens),
        device_token_rows=np.array(device_token_rows, np.int64),
        device_token_req_ids=device_token_req_ids,
    )


@dataclass
class PendingStep:
    """A step launched on the device: ``result()`` waits for its sampled tokens.

    A step whose sampling needs the tokens of the step before it on the host (a grammar to
    advance by them) has its forward launched first and its sampling held in ``deferred``
    until ``launch_sampling()``: the engine calls that once it has read the step before back,
    while the device still runs this step's forward."""

    sampling: list[Request]  # its sampling requests, in the order of their tokens
    tokens: SampledTokens | None  # None when it samples nothing (or not yet)
    deferred: Callable[[], SampledTokens] | None = None
    prompt: PendingPromptLogprobs | None = None  # its prompt logprobs, where asked for

    def launch_sampling(self) -> None:
        """Launch a deferred sampling (once); nothing otherwise."""
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            self.tokens = deferred()

    def result(self) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """The sampled token per sampling request (``NO_TOKEN`` where its grammar allowed none:
        the core fails it) and its logprobs where asked for."""
        self.launch_sampling()
        if self.tokens is None:
            return {}, {}
        token_ids, logprobs = self.tokens.result()
        sampling = self.sampling
        sampled = {r.req_id: token for r, token in zip(sampling, token_ids, strict=True)}
        wanted = {r.req_id: lp for r, lp in zip(sampling, logprobs, strict=True) if lp is not None}
        return sampled, wanted

    def prompt_logprobs(self) -> list[tuple[Request, int, list[TokenLogprobs]]]:
        """The step's prompt logprobs: per request, it, its first entry's position, the
        entries (``prompt_logprobs.PendingPromptLogprobs.result``)."""
        return self.prompt.result() if self.prompt is not None else []


# the row of a request that finished (or was aborted) before its deferred sampling: its
# token is dropped, so it is drawn greedily with nothing else (no grammar, no generator)
_DROPPED = SamplingParams(temperature=0)


def _sampling_rows(sampling: list[Request]) -> list[SamplingRow]:
    rows = []
    for r in sampling:
        if r.status != RequestStatus.RUNNING:
            rows.append(SamplingRow(r.req_id, _DROPPED, [], [], frozenset()))
            continue
        rows.append(
            SamplingRow(
                r.req_id,
                r.sampling_params,
                r.prompt_token_ids,
                r.output_token_ids,
                r.eos_token_ids,
                r.grammar,
                r.closing_tokens if r.wants_closing else None,
                # this step's own token is one of the request's placeholders
                r.num_output_placeholders - 1,
            )
        )
    return rows


def kv_cache_budget(
    total_memory: int, utilization: float, peak_torch_memory: int, non_torch_memory: int
) -> int:
    """Bytes left for the KV cache when this engine may use ``utilization`` of the device:
    what remains after the weights and a profiled step's activations (``peak_torch_memory``)
    and the CUDA context and libraries' own memory (``non_torch_memory``), as vLLM sizes it."""
    budget = int(total_memory * utilization) - peak_torch_memory - non_torch_memory
    if budget <= 0:
        raise ValueError(
            f"no memory is left for the KV cache: {utilization:.0%} of "
            f"{total_memory / 2**30:.1f} GiB is {total_memory * utilization / 2**30:.1f} GiB, "
            f"and the weights and a step's activations take "
            f"{(peak_torch_memory + non_torch_memory) / 2**30:.1f} GiB; "
            "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return budget


def default_num_kv_blocks(
    sized_bytes: int,
    bytes_per_block: int,
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """The KV cache's blocks where no size is given: what ``sized_bytes`` holds, but never more
    than ``max_num_seqs`` requests at ``max_model_len`` can fill. On a GPU a small model's
    share of the device is millions of blocks (a Python object each, and seconds to build)
    that no step could ever use."""
    most = max_num_seqs * -(-max_model_len // block_size)
    return min(most, sized_bytes // bytes_per_block)


class HostStaging:
    """Copies a step's integer arrays to the device in one transfer: packed into a pinned host
    buffer, then one non-blocking copy. On the CPU the arrays are used where they are.

    Each step packs into a pinned buffer of its own from torch's caching host allocator, which
    does not hand a buffer out again until the copy queued from it has run: a step that samples
    nothing (a long prompt's middle chunk) does not wait for the device, so a buffer reused
    across steps could be rewritten while the previous step's copy still waits in the stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]
        sizes = [array.size for array in arrays]
        pinned = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host = pinned.numpy()
        offset = 0
        for array, size in zip(arrays, sizes, strict=True):
            host[offset : offset + size] = array.reshape(-1)
            offset += size
        device_buffer = pinned.to(self.device, non_blocking=True)
        return [
            part.view(array.shape)
            for part, array in zip(device_buffer.split(sizes), arrays, strict=True)
        ]


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
        # what this process held before this engine: another engine's, which the memory
        # profile must not count as this one's
        self._allocated_before = 0
        if self.device.type == "cuda":
            gc.collect()  # an engine dropped unclosed (a cycle) is not this one's, nor another's
            self._allocated_before = torch.cuda.memory_allocated(self.device)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, getattr(hf_config, "dtype", None), self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=self.dtype, attn_implementation=attention.ATTENTION_NAME
        )
        self.model.to(self.device).eval()
        if should_widen(config.cpu_gemm, self.device, self.dtype):
            count = widen_linears(self.model)
            logger.info("%d %s linear layers multiply batches in float32", count, self.dtype)
        self.vocab_size = self.model.config.vocab_size
        self.spec = model_spec(self.model.config, getattr(self.model, "generation_config", None))
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        self.backend = attention.select_backend(config.attention_backend, self.device)
        self.attention_kernel = (
            paged_attention()
            if use_compiled_attention(config.cpu_attention, self.device, self.backend)
            else None
        )
        self.sampler = Sampler(self.device)
        self.staging = HostStaging(self.device)
        # the last launched step: the next step's inputs take a token it is still sampling
        # from its ids on the device (async scheduling)
        self._last_step: PendingStep | None = None
        # while set, called before each decoder layer and the LM head of an eager CPU forward
        # (EngineCore.admit_mid_step); a GPU's host runs ahead of its kernels, so not there
        self.layer_boundary: Callable[[], None] | None = None
        self.has_layer_boundaries = self.device.type == "cpu" and self._hook_layer_boundaries()
        self.num_blocks = self._num_kv_blocks()
        # decode graphs pad their batches with requests on one scratch block past the
        # scheduler's, so the Triton backend keeps one
        num_cache_blocks = self.num_blocks + (self.backend == "triton")
        shape = self._cache_shape(num_cache_blocks)
        self.key_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        self.value_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); attention: %s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.bytes_per_block / 2**30,
            self.backend if self.attention_kernel is None else "the compiled CPU kernel",
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.backend == "triton" and not config.enforce_eager:
            self.graphs = self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """The decode graphs, captured; None (decode steps run eagerly) where the model's
        forward cannot be captured, e.g. one that reads a device value on the host."""
        graphs = self.decode_graphs(capture=True)
        stream = torch.cuda.current_stream(self.device)
        try:
            seconds = graphs.capture()
        except RuntimeError:
            logger.warning(
                "capturing CUDA graphs failed; decode steps run eagerly (as with --enforce-eager)",
                exc_info=True,
            )
            # torch.cuda.graph leaves its capture stream current when ending the capture fails
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(self.device)
            return None
        logger.info(
            "captured CUDA graphs for %d decode batch sizes up to %d in %.1f s",
            len(graphs.sizes),
            graphs.max_batch_size,
            seconds,
        )
        return graphs

    def _hook_layer_boundaries(self) -> bool:
        """Hook the model's decoder layers and LM head so that a forward calls
        ``layer_boundary`` before each; False where the model has no list of layers."""
        decoder = self.model.get_decoder()
        # `layers` in most families, `h` in GPT-2's: the one list with a module per layer
        lists = [
            child
            for child in decoder.children()
            if isinstance(child, torch.nn.ModuleList) and len(child) == self.spec.num_layers
        ]
        if len(lists) != 1:
            logger.info("no list of decoder layers found: a step is not paused for newcomers")
            return False
        [layers] = lists
        for module in [*layers, self.model.get_output_embeddings()]:
            if module is not None:
                module.register_forward_pre_hook(self._at_layer_boundary)
        return True

    def _at_layer_boundary(self, module: torch.nn.Module, args: tuple) -> None:
        if (boundary := self.layer_boundary) is not None:
            boundary()

    def decode_graphs(self, *, capture: bool) -> DecodeGraphs:
        """Decode graphs over this runner's caches (scratch block: the one past the
        scheduler's). ``capture=False`` replays eagerly, for tests without a GPU."""
        max_batch_size = self.config.max_cudagraph_batch_size or self.config.max_num_seqs
        # a decode-only step has at most max_num_seqs requests of one token each, and no more
        # tokens than a step may hold: no larger graph could ever replay
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        return DecodeGraphs(
            self._graph_forward,
            max_batch_size=min(max_batch_size, limit),
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            scratch_block=self.key_caches[0].shape[0] - 1,
            block_size=self.block_size,
            device=self.device,
            capture=capture,
        )

    def _graph_forward(self, input_ids, positions, slot_mapping, unified) -> torch.Tensor:
        meta = PagedMetadata(self.key_caches, self.value_caches, slot_mapping, unified=unified)
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
            logits_to_keep=0,
            paged_metadata=meta,
        )
        return output.logits[0]

    def _cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        spec = self.spec
        return attention.kv_cache_shape(
            self.backend, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim
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
        else:
            sized = (
                self._profile_kv_cache_bytes()
                if self.device.type == "cuda"
                else DEFAULT_CPU_KV_CACHE_BYTES
            )
            num_blocks = default_num_kv_blocks(
                sized,
                self.bytes_per_block,
                max_num_seqs=self.config.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
            )
        if num_blocks < 1:
            raise ValueError("KV cache memory is too small for a single block")
        return int(num_blocks)

    def _profile_kv_cache_bytes(self) -> int:
        """Run the largest step the scheduler can make (``max_num_batched_tokens`` tokens,
        split over up to ``max_num_seqs`` sampling requests) on a throwaway cache, then size the
        KV cache from the peak memory it took."""
        torch.cuda.synchronize(self.device)
        gc.collect()  # an engine dropped unclosed: its graphs and runner are a cycle
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # a step holds up to max_num_batched_tokens over up to max_num_seqs requests, each at
        # most max_model_len long
        num_tokens = min(
            self.config.max_num_batched_tokens, self.config.max_num_seqs * self.max_model_len
        )
        num_requests = min(self.config.max_num_seqs, num_tokens)
        lens = np.full(num_requests, num_tokens // num_requests, np.int64)
        lens[: num_tokens % num_requests] += 1
        blocks_per_request = -(-int(lens.max()) // self.block_size)
        shape = self._cache_shape(num_requests * blocks_per_request)
        self.key_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        self.value_caches = [self._empty(shape) for _ in range(self.spec.num_layers)]
        table = np.arange(num_requests * blocks_per_request).reshape(num_requests, -1)
        cu_lens = np.zeros(num_requests + 1, np.int64)
        np.cumsum(lens, out=cu_lens[1:])
        req_of_token = np.repeat(np.arange(num_requests), lens)
        positions = np.arange(num_tokens) - cu_lens[:-1][req_of_token]
        plan = StepPlan(
            token_ids=np.zeros(num_tokens, np.int64),
            positions=positions,
            slot_mapping=table[req_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size,
            lens=lens,
            starts=np.zeros(num_requests, np.int64),
            context_lens=lens,
            cu_lens=cu_lens,
            block_table=table,
            logits_rows=cu_lens[1:] - 1,
        )
        logits = self._forward(plan)
        # the sampler's widest path: float32 copies, sorting for top-p, noise
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1)
        rows = [SamplingRow(str(i), params, [0], [0], frozenset()) for i in range(num_requests)]
        self.sampler(logits, rows)
        self.sampler.release([row.req_id for row in rows])
        torch.cuda.synchronize(self.device)
        del logits
        self.key_caches, self.value_caches = [], []
        peak_torch_memory = max(
            torch.cuda.max_memory_allocated(self.device) - self._allocated_before, 0
        )
        free, total = torch.cuda.mem_get_info(self.device)
        # what the process holds outside torch's allocator: the CUDA context, cuBLAS, NCCL
        non_torch_memory = max(total - free - torch.cuda.memory_reserved(self.device), 0)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)  # with the profile's memory given back
        budget = kv_cache_budget(
            total, self.config.gpu_memory_utilization, peak_torch_memory, non_torch_memory
        )
        logger.info(
            "memory profile: weights and peak activations %.2f GiB, outside torch %.2f GiB, "
            "%.2f GiB left for the KV cache at gpu_memory_utilization=%.2f",
            peak_torch_memory / 2**30,
            non_torch_memory / 2**30,
            budget / 2**30,
            self.config.gpu_memory_utilization,
        )
        return min(budget, free)

    def close(self) -> None:
        """Drop the weights, the KV cache and the decode graphs, and give their device memory
        back: the graphs hold this runner's forward, a cycle only the collector breaks."""
        self.graphs = None
        self.key_caches, self.value_caches = [], []
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, req_ids: list[str]) -> None:
        self.sampler.release(req_ids)

    def execute(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Run one step. Returns the sampled token per sampling request and its logprobs
        where asked for."""
        return self.launch(scheduled, block_tables).result()

    @torch.inference_mode()
    def launch(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> PendingStep:
        """Queue one step on the device (the forward, the sampling and the copy of its tokens
        back) without waiting for it. A decode whose input token the previous launch is still
        sampling (``ScheduledRequest.has_device_token``) reads it from that launch's ids on the
        device, and so do the penalties. Where a guided request's grammar has yet to see a
        token in flight, the sampling is deferred (``PendingStep.launch_sampling``)."""
        plan = plan_step(scheduled, block_tables, self.block_size)
        fill = self._device_token_fill(plan)
        graphs = self.graphs
        if graphs is not None and plan.is_decode_only and len(plan.lens) <= graphs.max_batch_size:
            logits = graphs.run(plan.decode_batch(), fill)
        else:
            logits = self._forward(plan, fill)
        prompt = None
        if plan.prompt is not None:
            num_sampling = len(plan.logits_rows)
            prompt = prompt_logprobs.launch(logits[num_sampling:], plan.prompt)
            logits = logits[:num_sampling]
        sampling = [item.request for item in scheduled if item.is_sampling]
        if not sampling:
            self._last_step = None
            return PendingStep(sampling, None, prompt=prompt)
        if any(r.needs_host_tokens and r.num_output_placeholders > 1 for r in sampling):
            self._last_step = PendingStep(
                sampling,
                None,
                deferred=partial(self._sample_deferred, logits, sampling),
                prompt=prompt,
            )
        else:
            rows = _sampling_rows(sampling)
            tokens = self.sampler.launch(logits, rows, self._penalised_tokens_in_flight(rows))
            self._last_step = PendingStep(sampling, tokens, prompt=prompt)
        return self._last_step

    @torch.inference_mode()
    def _sample_deferred(self, logits: torch.Tensor, sampling: list[Request]) -> SampledTokens:
        """The sampling of a step whose requests' tokens from the step before are all on the
        host now: its rows are built as the synchronous engine builds them (a request that
        finished meanwhile gets a bare greedy row: its token is dropped)."""
        return self.sampler.launch(logits, _sampling_rows(sampling))

    def _rows_in_last_step(self, req_ids: list[str]) -> np.ndarray:
        """The rows of the previous launch's sampled ids that hold these requests' tokens."""
        if self._last_step is None:
            raise RuntimeError("a step reads tokens that no step in flight samples")
        row_of = {request.req_id: i for i, request in enumerate(self._last_step.sampling)}
        return np.array([row_of[req_id] for req_id in req_ids], np.int64)

    def _device_token_fill(self, plan: StepPlan) -> Callable[[torch.Tensor], None] | None:
        """Where ``plan`` has tokens the previous launch is sampling: a function that copies
        them, on the device, into a step's input ids ``[T]``."""
        if not plan.device_token_req_ids:
            return None
        source_rows = self._rows_in_last_step(plan.device_token_req_ids)
        rows, source_rows = self.staging.upload(plan.device_token_rows, source_rows)
        sampled = self._last_step.tokens.device_ids

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, rows, sampled.index_select(0, source_rows).to(input_ids.dtype))

        return fill

    def _penalised_tokens_in_flight(self, rows: list[SamplingRow]) -> TokensInFlight | None:
        """The outputs that penalised rows have in the previous launch, still on the device:
        the penalties count them without waiting for that step."""
        waiting = [
            i for i, row in enumerate(rows) if row.num_pending_outputs and row.params.has_penalties
        ]
        if not waiting:
            return None
        source_rows = self._rows_in_last_step([rows[i].req_id for i in waiting])
        rows_on_device, source_rows = self.staging.upload(np.array(waiting, np.int64), source_rows)
        return TokensInFlight(
            rows_on_device, self._last_step.tokens.device_ids.index_select(0, source_rows)
        )

    def _forward(
        self, plan: StepPlan, fill: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """The model run eagerly over a packed step: logits ``[S + P, V]`` of its sampling
        rows, then of its prompt rows (``StepPlan.kept_rows``).
        ``fill`` completes the input ids on the device (``_device_token_fill``)."""
        input_ids, positions, logits_rows, meta = self._prepare(plan)
        if fill is not None:
            fill(input_ids[0])
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
            logits_to_keep=logits_rows,
            paged_metadata=meta,
        )
        return output.logits[0]

    def _prepare(self, plan: StepPlan):
        if self.backend == "triton":
            ids, positions, slots, table, seq_lens, starts, logits_rows = self.staging.upload(
                plan.token_ids,
                plan.positions,
                plan.slot_mapping,
                plan.block_table,
                plan.context_lens,
                plan.cu_lens,
                plan.kept_rows,
            )
            unified = UnifiedMetadata(table, seq_lens, starts, int(plan.lens.max()))
            meta = PagedMetadata(self.key_caches, self.value_caches, slots, unified=unified)
            return ids.unsqueeze(0), positions.unsqueeze(0), logits_rows, meta

        device = self.device

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        lens, starts, context_lens, cu_lens = (
            plan.lens,
            plan.starts,
            plan.context_lens,
            plan.cu_lens,
        )
        meta = PagedMetadata(self.key_caches, self.value_caches, to_device(plan.slot_mapping))
        if self.backend == "flash_attn":
            num_requests, block_size, table = len(lens), self.block_size, plan.block_table
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
            meta.cache_rows = attention.block_major_rows(
                meta.slot_mapping, self.block_size, self.spec.num_kv_heads
            )
            self._plan_cpu_attention(
                meta, plan.block_table, lens, starts, context_lens, cu_lens, to_device
            )
        input_tensor = to_device(plan.token_ids).unsqueeze(0)
        return (
            input_tensor,
            to_device(plan.positions).unsqueeze(0),
            to_device(plan.kept_rows),
            meta,
        )

    def _plan_cpu_attention(self, meta, table, lens, starts, context_lens, cu_lens, to_device):
        block_size = self.block_size
        compiled = np.zeros(len(lens), bool)
        if self.attention_kernel is not None:
            # a long fresh prompt is one causal SDPA call, faster than the kernel's tiles
            compiled = (starts > 0) | (lens <= COMPILED_MAX_FRESH_TOKENS)
        for i in np.flatnonzero((lens > 1) & ~compiled):
            start, num_new, context_len = int(starts[i]), int(lens[i]), int(context_lens[i])
            block_ids = mask = None
            if start > 0:
                block_ids = to_device(table[i, : -(-context_len // block_size)])
                query_pos = np.arange(start, context_len)[:, None]
                mask = to_device(np.arange(context_len)[None, :] <= query_pos)
            meta.prefill_chunks.append(
                PrefillChunk(int(cu_lens[i]), num_new, context_len, block_ids, mask)
            )
        if self.attention_kernel is not None:
            rows = np.flatnonzero(compiled)
            if len(rows):
                num_blocks = -(-int(context_lens[rows].max()) // block_size)
                meta.compiled = CompiledAttention(
                    to_device(np.ascontiguousarray(table[rows, :num_blocks], np.int64)),
                    to_device(context_lens[rows].astype(np.int64)),
                    to_device(cu_lens[rows].astype(np.int64)),
                    to_device(lens[rows].astype(np.int64)),
                    self.attention_kernel,
                )
            return
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
                )
            )
            bucket_start = end
