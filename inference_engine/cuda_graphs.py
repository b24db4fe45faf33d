"""Decode-only steps replayed from CUDA graphs, one per batch size of a ladder (as vLLM and
nano-vllm do): a step of ``n`` decodes is padded to the next captured size and replayed.

Every input of a graph lives in one static device buffer with fixed offsets, so a step is one
host-to-device copy (through a pinned buffer, the block table packed to the step's width and
spread on the device), the input ids a step in flight samples copied in on the device (async
scheduling), and one replay. Padding rows are decodes of one token on a scratch block that no
request owns: they write their K/V there and their logits are dropped, so they never touch a
real request's cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inference_engine.attention import UnifiedMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURED_BATCH_SIZE = 512

# (input_ids [1, B], position_ids [1, B], slot_mapping [B], attention metadata) -> logits [B, V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, UnifiedMetadata], torch.Tensor]


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16: the padding stays under 8 rows where
    batches are small and steps are cheap, as in vLLM's default ladder."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, MAX_CAPTURED_BATCH_SIZE + 1, 16))
    capped = [size for size in sizes if size < max_batch_size]
    return [*capped, min(max_batch_size, MAX_CAPTURED_BATCH_SIZE)]


@dataclass(frozen=True)
class DecodeBatch:
    """A decode-only step on the host: one new token per request."""

    token_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    slot_mapping: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n] context after this step
    block_table: np.ndarray  # [n, num_blocks]


class StaticInputs:
    """The fixed layout of every graph's inputs: ids, positions, slots, context lengths and
    query starts (``max_batch_size`` each, one more for the starts), then a step's block table
    packed to its own width, then the block tables the graphs read (``max_blocks_per_seq``
    wide). A step copies the packed table from the host, ``batch_size x`` its longest
    request's blocks, and spreads it into the graphs' tables on the device: at a 128k context
    the full width would be 16 MB a step over PCIe for 256 requests."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        rows = max_batch_size
        table_size = rows * max_blocks_per_seq
        self.offsets = [0, rows, 2 * rows, 3 * rows, 4 * rows, 5 * rows + 1]
        self.packed_offset = self.offsets[-1]
        self.tables_offset = self.packed_offset + table_size
        self.size = self.tables_offset + table_size

    def views(self, buffer: np.ndarray | torch.Tensor):
        """``(ids, positions, slots, seq_lens, query_start_loc, block_tables)`` over ``buffer``."""
        bounds = zip(self.offsets[:-1], self.offsets[1:], strict=True)
        ids, positions, slots, seq_lens, starts = (buffer[start:end] for start, end in bounds)
        tables = buffer[self.tables_offset : self.size].reshape(self.max_batch_size, -1)
        return ids, positions, slots, seq_lens, starts, tables

    def packed(self, buffer: np.ndarray | torch.Tensor, batch_size: int, width: int):
        """A step's block table ``[batch_size, width]`` as ``fill`` packed it."""
        start = self.packed_offset
        return buffer[start : start + batch_size * width].reshape(batch_size, width)

    def used(self, batch_size: int, width: int) -> int:
        """Elements to copy for a step: everything before the tables, and its packed table."""
        return self.packed_offset + batch_size * width

    def fill(
        self,
        host: np.ndarray,
        batch: DecodeBatch,
        batch_size: int,
        scratch_block: int,
        block_size: int,
    ) -> int:
        """Write ``batch`` padded to ``batch_size`` into ``host``, the layout's host copy, its
        block table packed; returns the table's width."""
        ids, positions, slots, seq_lens, starts, _ = self.views(host)
        num_real = len(batch.token_ids)
        width = batch.block_table.shape[1]
        if num_real > batch_size or width > self.max_blocks_per_seq:
            raise ValueError("the decode batch does not fit the captured graph")
        ids[:num_real] = batch.token_ids
        positions[:num_real] = batch.positions
        slots[:num_real] = batch.slot_mapping
        seq_lens[:num_real] = batch.seq_lens
        table = self.packed(host, batch_size, width)
        table[:num_real] = batch.block_table
        padding = slice(num_real, batch_size)
        ids[padding] = 0
        positions[padding] = 0
        slots[padding] = scratch_block * block_size
        seq_lens[padding] = 1
        table[padding] = 0
        table[padding, 0] = scratch_block
        starts[: batch_size + 1] = np.arange(batch_size + 1)
        return width


class DecodeGraphs:
    """Captures ``forward`` for each size of ``capture_sizes`` and replays the smallest that
    holds a decode step. With ``capture=False`` the same static buffers and padding run the
    forward eagerly instead, which lets the CPU tests check everything but the capture."""

    def __init__(
        self,
        forward: Forward,
        *,
        max_batch_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_batch_size)
        self.layout = StaticInputs(self.sizes[-1], max_blocks_per_seq)
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.device = device
        self.capture_enabled = capture
        pin = device.type == "cuda"
        # two host buffers, used in turn, each with the event of the last copy from it: with
        # async scheduling a step is filled while the one before may still wait to be copied
        # (the host fills everything up to the graphs' tables, which only the device holds)
        size = self.layout.tables_offset
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next_host = 0
        self.inputs = torch.zeros(self.layout.size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every size's logits land in the first rows of one buffer: a buffer per captured size
        # would hold the ladder's sum of rows (4,000 at 256) x the vocabulary on the device,
        # outside what the KV cache was sized around
        self.logits: torch.Tensor | None = None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def batch_size_for(self, num_requests: int) -> int | None:
        """The captured size a step of ``num_requests`` decodes runs at, None if too many."""
        for size in self.sizes:
            if size >= num_requests:
                return size
        return None

    def capture(self) -> float:
        """Capture every size, largest first so the smaller ones reuse its memory pool.
        Returns the seconds it took."""
        began = time.perf_counter()
        empty = DecodeBatch(*(np.zeros(0, np.int64) for _ in range(4)), np.zeros((0, 1), np.int64))
        pool = None
        for size in reversed(self.sizes):
            self._upload(empty, size)
            self._run(size)  # warm-up: lazy initialisation and autotuning stay out of the graph
            if not self.capture_enabled:
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        if self.capture_enabled:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began

    def run(
        self, batch: DecodeBatch, fill: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Logits ``[n, V]`` for the batch's ``n`` decodes. ``fill`` completes the input ids
        on the device (tokens a step in flight samples) once they are copied in."""
        num_real = len(batch.token_ids)
        size = self.batch_size_for(num_real)
        if size is None:
            raise ValueError(f"{num_real} decodes exceed the largest captured batch")
        self._upload(batch, size)
        if fill is not None:
            fill(self.layout.views(self.inputs)[0])
        graph = self.graphs.get(size)
        if graph is None:
            return self._run(size)[:num_real]
        graph.replay()
        return self.logits[:num_real]

    def _upload(self, batch: DecodeBatch, size: int) -> None:
        turn = self._next_host
        self._next_host ^= 1
        host = self.hosts[turn]
        if (copied := self._copied[turn]) is not None:
            copied.synchronize()  # the copy from this buffer two steps ago has run
        width = self.layout.fill(host.numpy(), batch, size, self.scratch_block, self.block_size)
        used = self.layout.used(size, width)
        self.inputs[:used].copy_(host[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record(torch.cuda.current_stream(self.device))
        tables = self.layout.views(self.inputs)[-1]
        tables[:size, :width].copy_(self.layout.packed(self.inputs, size, width))

    def _run(self, size: int) -> torch.Tensor:
        """The forward of ``size`` rows, its logits copied into the shared buffer's first rows
        (allocated by the first, largest, size's run)."""
        ids, positions, slots, seq_lens, starts, tables = self.layout.views(self.inputs)
        meta_inputs = UnifiedMetadata(tables[:size], seq_lens[:size], starts[: size + 1], 1)
        logits = self.forward(
            ids[:size].unsqueeze(0), positions[:size].unsqueeze(0), slots[:size], meta_inputs
        )
        if self.logits is None:
            self.logits = logits.new_empty((self.max_batch_size, logits.shape[-1]))
        out = self.logits[:size]
        out.copy_(logits)
        return out
