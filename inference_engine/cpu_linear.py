"""bf16 and fp16 linear layers on CPUs without bf16/fp16 matrix instructions.

Where an x86 CPU has no AVX512-BF16 or AMX (an AVX2 one, say), torch's bf16 and fp16
matmuls fall back to kernels that cost about one matrix-vector product per row: a decode step
of 64 rows spends 5-10x what the same product costs in float32 (``bench/RESULTS-serving.md``).
A bf16 matrix unit multiplies bf16 inputs exactly, accumulates in float32 and rounds the
result to bf16; a widened linear does the same arithmetic with float32 instructions: it widens
the (bf16-valued) input and weight to float32, multiplies, and rounds the output back. Weights
stay in the model's dtype in memory; only batched calls (at least ``WIDEN_MIN_ROWS`` rows) are
widened, since one row is a matrix-vector product that torch's bf16 kernel does well.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn

# below this many rows the low-precision kernel is as fast as widening (bench/RESULTS-serving.md)
WIDEN_MIN_ROWS = 8


def has_matrix_units(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies ``dtype`` matrices natively (or is not an x86, whose
    kernels this module does not know)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return cpu._is_amx_fp16_supported()
    return True


def should_widen(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if mode == "auto":
        return not has_matrix_units(dtype)
    return mode == "widened"


class WidenedLinear(nn.Linear):
    """``nn.Linear`` whose batched calls multiply in float32 and round to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < WIDEN_MIN_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def widen_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``WidenedLinear``; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WidenedLinear
            count += 1
    return count
