"""``python -m inference_engine --model PATH --endpoint tcp://127.0.0.1:5555 [options]``"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields

from inference_engine.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from inference_engine.protocol import MAX_FRAME_BYTES
from inference_engine.server import EngineServer, ServerConfig
from inference_engine.waiting_queue import SCHEDULING_POLICIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m inference_engine",
        description="Serve one model over ZeroMQ (ROUTER socket, msgspec frames).",
    )
    add = parser.add_argument
    defaults = {f.name: f.default for f in fields(EngineConfig)}

    def add_engine(name: str, **options) -> None:
        """A flag for an ``EngineConfig`` field, with the field's default."""
        field_name = name.removeprefix("--").replace("-", "_")
        add(name, default=defaults[field_name], **options)

    add("--model", required=True, help="path of a Hugging Face model directory")
    add(
        "--endpoint",
        default="tcp://127.0.0.1:5555",
        help="ZeroMQ endpoint to bind, tcp://HOST:PORT or ipc:///PATH (default: %(default)s)",
    )
    add("--served-model-name", help="model name reported in STATS and metrics (default: --model)")
    add_engine("--dtype", choices=DTYPES, help="weights and KV cache dtype")
    add_engine("--device", help="torch device: auto, cpu, cuda, cuda:1 ...")
    add_engine("--block-size", type=int, help="tokens per KV cache block")
    add_engine("--max-num-seqs", type=int, help="most requests in one batch")
    add_engine(
        "--max-num-batched-tokens",
        type=int,
        help="most tokens in one step (decodes plus prefill chunks)",
    )
    add_engine(
        "--num-kv-blocks", type=int, help="KV cache size in blocks (or give --kv-cache-memory)"
    )
    add_engine(
        "--kv-cache-memory",
        type=int,
        help="KV cache size in bytes (default: what --gpu-memory-utilization leaves on a GPU, "
        "or enough on CPU for max-num-seqs full-length requests up to 4 GiB)",
    )
    add_engine(
        "--gpu-memory-utilization",
        type=float,
        help="share of the GPU's memory for weights, activations and KV cache (default: "
        "%(default)s)",
    )
    add_engine(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="auto: Triton's paged kernel on a GPU, torch on the CPU (default: %(default)s)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs",
    )
    add_engine(
        "--max-cudagraph-batch-size",
        type=int,
        help="largest decode batch captured in a CUDA graph (default: --max-num-seqs, at most "
        "512); larger ones run eagerly",
    )
    add_engine(
        "--max-model-len", type=int, help="longest prompt plus output (default: the model's)"
    )
    add("--no-enable-prefix-caching", action="store_true", help="turn prefix caching off")
    add(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests past which a new one is refused with 'overloaded'",
    )
    add(
        "--tenant-queue-share",
        type=float,
        default=0.5,
        help="most of the waiting queue one tenant may hold; past it only that tenant is "
        "refused with 'overloaded' (default: %(default)s; 1 turns it off)",
    )
    add_engine(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        help="admission order: fcfs, priority, or fair (priority, then the least-served "
        "tenant by virtual token counters) (default: %(default)s)",
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
    if not 0 < args.tenant_queue_share <= 1:
        parser.error("--tenant-queue-share must be in (0, 1]")
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
        tenant_queue_share=args.tenant_queue_share,
    )
    import torch

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    EngineServer(engine_config, server_config).run()


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    options["enable_prefix_caching"] = not args.no_enable_prefix_caching
    return EngineConfig(**options)


if __name__ == "__main__":
    main()
