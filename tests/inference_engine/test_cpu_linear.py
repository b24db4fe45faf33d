"""Widened bf16/fp16 linears: the arithmetic of a bf16 matrix unit with float32 instructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference_engine import cpu_linear
from inference_engine.config import EngineConfig
from inference_engine.cpu_linear import WIDEN_MIN_ROWS, WidenedLinear, should_widen, widen_linears


def widened_copy(linear: nn.Linear) -> nn.Linear:
    copy = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    copy.load_state_dict(linear.state_dict())
    widen_linears(copy)
    return copy.to(linear.weight.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_batched_calls_are_float32_products_of_the_low_precision_values(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    widened = widened_copy(linear)
    x = torch.randn(3, WIDEN_MIN_ROWS, 96).to(dtype)
    with torch.no_grad():
        out = widened(x)
        exact = F.linear(
            x.double(),
            linear.weight.double(),
            None if linear.bias is None else linear.bias.double(),
        )
    assert out.dtype == dtype and out.shape == (3, WIDEN_MIN_ROWS, 40)
    assert torch.equal(
        out, F.linear(x.float(), linear.weight.float(), widened_bias(linear)).to(dtype)
    )
    # products of bf16/fp16 values are exact in float32: one rounding to dtype at the end
    tolerance = torch.finfo(dtype).eps * exact.abs() + 1e-3
    assert ((out.double() - exact).abs() <= tolerance).all()


def widened_bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.float()


def test_fewer_rows_than_the_threshold_use_the_native_kernel():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    widened = widened_copy(linear)
    x = torch.randn(WIDEN_MIN_ROWS - 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(widened(x), F.linear(x, linear.weight, linear.bias))


def test_widen_linears_swaps_plain_linears_only_and_keeps_their_weights():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)), Custom(2, 2))
    weights = [p.clone() for p in model.parameters()]
    assert widen_linears(model) == 2
    assert [type(m) for m in model if isinstance(m, nn.Linear)] == [WidenedLinear, Custom]
    assert type(model[2][0]) is WidenedLinear
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("mode", "device", "dtype", "native", "expected"),
    [
        ("auto", "cpu", torch.bfloat16, False, True),
        ("auto", "cpu", torch.bfloat16, True, False),
        ("auto", "cpu", torch.float32, False, False),
        ("widened", "cpu", torch.bfloat16, True, True),
        ("widened", "cpu", torch.float16, True, True),
        ("widened", "cpu", torch.float32, False, False),
        ("widened", "cuda", torch.bfloat16, False, False),
        ("native", "cpu", torch.bfloat16, False, False),
    ],
)
def test_should_widen(monkeypatch, mode, device, dtype, native, expected):
    monkeypatch.setattr(cpu_linear, "has_matrix_units", lambda _dtype: native)
    assert should_widen(mode, torch.device(device), dtype) is expected


def test_auto_asks_the_cpu_for_its_matrix_units(monkeypatch):
    monkeypatch.setattr(cpu_linear.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_linear.has_matrix_units(torch.bfloat16) is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_linear.has_matrix_units(torch.bfloat16) is True
    monkeypatch.setattr(cpu_linear.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_linear.has_matrix_units(torch.bfloat16) is True


def test_the_mode_is_a_validated_engine_option():
    assert EngineConfig(model="m").cpu_gemm == "auto"
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        EngineConfig(model="m", cpu_gemm="fast")
