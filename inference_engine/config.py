"""The engine's configuration: validated numbers only, no I/O.

``EngineConfig`` is what ``LLM`` and the engine process run (the model and how to run it);
``ServerConfig`` is what only the process needs (its socket, queue limits, metrics, shutdown).
Each field's default is the only one: ``python -m inference_engine`` builds a flag per field
(``--max-num-seqs`` for ``max_num_seqs``) from the field's type, default and ``help``, and
``LLM`` takes the fields as keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference_engine.protocol import MAX_FRAME_BYTES
from inference_engine.waiting_queue import SCHEDULING_POLICIES

DTYPES = ("auto", "float32", "float16", "bfloat16")
# torch: vectorised torch ops (the CPU's); triton: one paged kernel launch per layer (the
# GPU's); flash_attn: flash-attn's varlen kernel over a per-step gather of each context
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# how a CPU multiplies bf16/fp16 linear layers (cpu_linear.py)
CPU_GEMM_MODES = ("auto", "native", "widened")
# how CONTROL load swaps models (model_control.py)
MODEL_SWAP_MODES = ("auto", "beside", "replace")
# whether a step is scheduled while the one before runs (core.py)
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")
# how a CPU attends decodes (cpu_kernels.py)
CPU_ATTENTION_MODES = ("auto", "compiled", "torch")


def option(default: Any, description: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its default and the command line's help (and choices)."""
    return field(default=default, metadata={"help": description, "choices": choices})


@dataclass
class EngineConfig:
    """What the engine is asked to run. The KV cache is ``num_kv_blocks`` blocks, else
    ``kv_cache_memory`` bytes, else what the runner sizes: on a GPU, ``gpu_memory_utilization``
    of the device's memory less the weights and the peak of a profiling step; on the CPU,
    enough for ``max_num_seqs`` full-length requests up to 4 GiB."""

    model: str = field(metadata={"help": "path of a Hugging Face model directory"})
    dtype: str = option("auto", "weights and KV cache dtype", DTYPES)
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:1 ...")
    block_size: int = option(16, "tokens per KV cache block")
    max_num_seqs: int = option(256, "most requests in one batch")
    max_num_batched_tokens: int = option(
        2048, "most tokens in one step (decodes plus prefill chunks)"
    )
    num_kv_blocks: int | None = option(None, "KV cache size in blocks (or give kv-cache-memory)")
    kv_cache_memory: int | None = option(
        None,
        "KV cache size in bytes (default: what gpu-memory-utilization leaves on a GPU, or "
        "enough on the CPU for max-num-seqs full-length requests up to 4 GiB)",
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    max_model_len: int | None = option(None, "longest prompt plus output (default: the model's)")
    attention_backend: str = option(
        "auto", "auto: Triton's paged kernel on a GPU, torch on the CPU", ATTENTION_BACKENDS
    )
    enforce_eager: bool = option(False, "run decode steps eagerly instead of replaying CUDA graphs")
    async_scheduling: str = option(
        "auto",
        "schedule and launch the next step while the device runs this one (the host's work "
        "hides behind the device's; a request with penalties or a grammar waits for its last "
        "token); auto: on a GPU",
        ASYNC_SCHEDULING_MODES,
    )
    gpu_memory_utilization: float = option(
        0.9, "share of the GPU's memory for weights, activations and KV cache"
    )
    max_cudagraph_batch_size: int | None = option(
        None,
        "largest decode batch captured in a CUDA graph (default: max-num-seqs, at most 512); "
        "larger ones run eagerly",
    )
    cpu_gemm: str = option(
        "auto",
        "bf16/fp16 linear layers on a CPU: widened multiplies batched ones in float32 and "
        "rounds back (same arithmetic as a bf16 matrix unit, 5-10x faster on AVX2), native "
        "keeps torch's kernels, auto widens where the CPU has no bf16/fp16 matrix unit",
        CPU_GEMM_MODES,
    )
    cpu_attention: str = option(
        "auto",
        "decode attention on a CPU: compiled is a C++ kernel built at start-up for this CPU "
        "(needs a C++ compiler; 3-12x faster than torch ops), torch is torch's ops, auto is "
        "compiled where it builds",
        CPU_ATTENTION_MODES,
    )
    scheduling_policy: str = option(
        "fair",
        "admission order: fcfs, priority, or fair (priority, then the least-served tenant by "
        "virtual token counters)",
        SCHEDULING_POLICIES,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path")
        for name in (
            "dtype",
            "attention_backend",
            "cpu_gemm",
            "cpu_attention",
            "scheduling_policy",
            "async_scheduling",
        ):
            _check_choice(self, name)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
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


@dataclass
class ServerConfig:
    """How the engine process serves its ``EngineConfig``."""

    endpoint: str = option(
        "tcp://127.0.0.1:5555", "ZeroMQ endpoint to bind, tcp://HOST:PORT or ipc:///PATH"
    )
    served_model_name: str | None = option(
        None, "model name reported in STATS and metrics (default: the model's path)"
    )
    max_queued_requests: int = option(
        1024, "waiting requests past which a new one is refused with 'overloaded'"
    )
    tenant_queue_share: float = option(
        0.5,
        "most of the waiting queue one tenant may hold; past it only that tenant is refused "
        "with 'overloaded' (1 turns it off)",
    )
    metrics_port: int | None = option(None, "serve Prometheus metrics on this port")
    metrics_host: str = option("127.0.0.1", "address of the metrics server")
    async_output: bool = option(
        True, "detokenize and serialize on an output thread, not in the busy loop"
    )
    mid_step_admission: bool = option(
        True,
        "under fair, on a CPU: a tenant's request arriving while nothing of its tenant runs "
        "gets its first chunk between two layers of the step under way, not after it",
    )
    shutdown_grace_period: float = option(
        30.0, "seconds in-flight requests get to finish after SIGTERM"
    )
    model_swap: str = option(
        "auto",
        "how CONTROL load swaps models: beside builds the new one next to the serving one (no "
        "gap, memory for both), replace unloads first (refusing requests while it loads), "
        "auto replaces on a GPU, whose memory the serving model sized its KV cache to fill",
        MODEL_SWAP_MODES,
    )
    max_frame_bytes: int = option(
        MAX_FRAME_BYTES, "a larger client frame is refused (invalid_request), the link kept"
    )
    client_timeout: float = option(
        5.0,
        "seconds without a frame from a client (its heartbeat comes every second) after which "
        "its requests are aborted: its process died",
    )
    step_timeout: float = option(
        300.0,
        "seconds one step may run before the engine takes itself for hung and exits (code "
        "70), so that its supervisor restarts it and its streams fail instead of waiting "
        "for ever; 0: never",
    )
    grammar_compile_workers: int = option(
        2,
        "threads compiling structured outputs' grammars, one at a time per tenant: a "
        "tenant's slow grammars hold up its own structured requests alone",
    )
    grammar_compile_timeout: float = option(
        30.0,
        "seconds a request's grammar may take to compile (queued time included) before the "
        "request is refused",
    )

    def __post_init__(self) -> None:
        if self.grammar_compile_workers < 1:
            raise ValueError(
                f"grammar_compile_workers must be >= 1, got {self.grammar_compile_workers}"
            )
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not 0 < self.tenant_queue_share <= 1:
            raise ValueError(f"tenant_queue_share must be in (0, 1], got {self.tenant_queue_share}")
        if self.shutdown_grace_period < 0:
            raise ValueError(
                f"shutdown_grace_period must be >= 0, got {self.shutdown_grace_period}"
            )
        _check_positive("max_frame_bytes", self.max_frame_bytes)
        _check_choice(self, "model_swap")
        if not self.client_timeout > 0:
            raise ValueError(f"client_timeout must be > 0, got {self.client_timeout}")
        if self.step_timeout < 0:
            raise ValueError(f"step_timeout must be >= 0, got {self.step_timeout}")
        if self.metrics_port is not None:
            _check_positive("metrics_port", self.metrics_port)


def _check_choice(config: object, name: str) -> None:
    choices = config.__dataclass_fields__[name].metadata["choices"]
    if getattr(config, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(config, name)!r}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
