"""When the engine attends with the compiled CPU kernel, and what it does where the
kernel cannot be built (the kernel's arithmetic is tested in test_attention.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from inference_engine import cpu_kernels
from inference_engine.config import EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def no_compiler(monkeypatch):
    """A process where the kernel has not been built yet and no compiler is on PATH."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_failure", [])
    monkeypatch.setenv("CXX", "no-such-compiler")


@pytest.mark.parametrize(
    ("mode", "device", "backend"),
    [("torch", CPU, "torch"), ("auto", CUDA, "triton"), ("compiled", CPU, "triton")],
)
def test_the_kernel_is_only_for_the_cpus_torch_backend(no_compiler, mode, device, backend):
    # never built, so no compiler is needed to decide
    assert cpu_kernels.use_compiled_attention(mode, device, backend) is False


def test_auto_falls_back_to_torch_ops_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="inference_engine.cpu_kernels"):
        assert cpu_kernels.use_compiled_attention("auto", CPU, "torch") is False
    assert "no C++ compiler (no-such-compiler)" in caplog.text


def test_compiled_refuses_to_start_without_the_kernel(no_compiler):
    with pytest.raises(cpu_kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        cpu_kernels.use_compiled_attention("compiled", CPU, "torch")
    # the failure is remembered: no second build attempt in this process
    with pytest.raises(cpu_kernels.KernelUnavailable):
        cpu_kernels.paged_attention()


def test_the_runner_attends_with_the_kernel_where_it_builds(model_dirs):
    from inference_engine import LLM, SamplingParams

    try:
        cpu_kernels.paged_attention()
    except cpu_kernels.KernelUnavailable as error:
        pytest.skip(f"the compiled CPU kernel cannot be built here: {error}")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # a prompt in chunks (a fresh one, then one after it), a short one, then a prefix-cache
    # hit that extends a cached context by a few tokens
    first, second = [[5, 6, 7], [9] * 40], [[9] * 40 + [3, 4, 5]]
    outputs = {}
    for mode in ("auto", "torch"):
        llm = LLM(
            model_dirs["llama"],
            dtype="float32",
            device="cpu",
            cpu_attention=mode,
            max_num_batched_tokens=32,
        )
        assert (llm.core.runner.attention_kernel is not None) == (mode == "auto")
        outputs[mode] = [o.token_ids for o in llm.generate(first, params)]
        hit = llm.generate(second, params)
        assert hit[0].num_cached_tokens > 0
        outputs[mode] += [o.token_ids for o in hit]
    assert outputs["auto"] == outputs["torch"]


def test_builds_for_different_cpus_do_not_share_a_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_cpu_features", lambda: "flags : fpu avx2")
    avx2 = cpu_kernels._build_directory()
    monkeypatch.setattr(cpu_kernels, "_cpu_features", lambda: "flags : fpu avx2 avx512f")
    assert cpu_kernels._build_directory() != avx2
    assert avx2.parent == tmp_path


def test_the_mode_is_a_checked_choice():
    with pytest.raises(ValueError, match="cpu_attention"):
        EngineConfig(model="m", cpu_attention="fast")
