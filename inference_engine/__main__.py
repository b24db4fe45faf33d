"""``python -m inference_engine --model PATH --endpoint tcp://127.0.0.1:5555 [options]``"""

from __future__ import annotations

import argparse
import logging
import os

from inference_engine.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from inference_engine.protocol import MAX_FRAME_BYTES
from inference_engine.server import EngineServer, ServerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference_engine",
        description="Serve one model over ZeroMQ (ROUTER socket, msgspec frames).",
    )
    add = parser.add_argument
    add("--model", required=True, help="path of a Hugging Face model directory")
    add(
        "--endpoint",
        default="tcp://127.0.0.1:5555",
        help="ZeroMQ endpoint to bind, tcp://HOST:PORT or ipc:///PATH (default: %(default)s)",
    )
    add("--served-model-name", help="model name reported in STATS and metrics (default: --model)")
    add("--dtype", default="auto", choices=DTYPES, help="weights and KV cache dtype")
    add("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:1 ...")
    add("--block-size", type=int, default=16, help="tokens per KV cache block")
    add("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="most tokens in one step (decodes plus prefill chunks)",
    )
    add("--num-kv-blocks", type=int, help="KV cache size in blocks (or give --kv-cache-memory)")
    add(
        "--kv-cache-memory",
        type=int,
        help="KV cache size in bytes (default: what --gpu-memory-utilization leaves on a GPU, "
        "or enough on CPU for max-num-seqs full-length requests up to 4 GiB)",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, activations and KV cache (default: "
        "%(default)s)",
    )
    add(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: Triton's paged kernel on a GPU, torch on the CPU (default: %(default)s)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs",
    )
    add(
        "--max-cudagraph-batch-size",
        type=int,
        help="largest decode batch captured in a CUDA graph (default: --max-num-seqs, at most "
        "512); larger ones run eagerly",
    )
    add("--max-model-len", type=int, help="longest prompt plus output (default: the model's)")
    add("--no-enable-prefix-caching", action="store_true", help="turn prefix caching off")
    add(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests past which a new one is refused with 'overloaded'",
    )
    add("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    add("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    add(
        "--no-async-output",
        action="store_true",
        help="detokenize and serialize in the busy loop instead of an output thread",
    )
    add(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: %(default)s)",
    )
    add(
        "--max-frame-bytes",
        type=int,
        default=MAX_FRAME_BYTES,
        help="larger client frames are dropped unread (default: %(default)s)",
    )
    add(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default: one per CPU this process may run on, its affinity); "
        "on a machine shared with other processes, fewer threads avoid waiting on "
        "descheduled ones",
    )
    add("--log-level", default="INFO", help="logging level (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.max_queued_requests < 0:
        parser.error("--max-queued-requests must be >= 0")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine_config = engine_config_from(args)
    except ValueError as exc:
        raise SystemExit(f"python -m inference_engine: error: {exc}") from None
    server_config = ServerConfig(
        endpoint=args.endpoint,
        served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        async_output=not args.no_async_output,
        shutdown_grace_period=args.shutdown_grace_period,
        max_frame_bytes=args.max_frame_bytes,
    )
    import torch

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    EngineServer(engine_config, server_config).run()


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_cudagraph_batch_size=args.max_cudagraph_batch_size,
    )


if __name__ == "__main__":
    main()
