"""Engine configuration: validated numbers only, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """What the engine is asked to run. ``max_model_len=None`` means the model's own limit;
    ``num_kv_blocks`` fixes the KV cache size, else ``kv_cache_memory`` (bytes) sizes it, else
    the runner picks a default from free memory."""

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

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
