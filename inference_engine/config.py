"""Engine configuration: validated numbers only, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from inference_engine.waiting_queue import SCHEDULING_POLICIES

DTYPES = ("auto", "float32", "float16", "bfloat16")
# torch: vectorised torch ops (the CPU's); triton: one paged kernel launch per layer (the
# GPU's); flash_attn: flash-attn's varlen kernel over a per-step gather of each context
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")


@dataclass
class EngineConfig:
    """What the engine is asked to run. ``max_model_len=None`` means the model's own limit;
    ``num_kv_blocks`` fixes the KV cache size, else ``kv_cache_memory`` (bytes) sizes it, else
    the runner sizes it: on a GPU, ``gpu_memory_utilization`` of the device's memory less the
    weights and the peak of a profiling step; on the CPU, enough for ``max_num_seqs``
    full-length requests up to 4 GiB. ``enforce_eager`` turns off the CUDA graphs that replay
    decode-only steps; ``max_cudagraph_batch_size`` is the largest one captured (default:
    ``max_num_seqs``, at most 512). ``scheduling_policy`` orders admission: ``fcfs``,
    ``priority``, or ``fair`` (priority, then the least-served tenant)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    max_cudagraph_batch_size: int | None = None
    scheduling_policy: str = "fair"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float):
            raise ValueError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        for name in (
            "num_kv_blocks",
            "kv_cache_memory",
            "max_model_len",
            "max_cudagraph_batch_size",
        ):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
