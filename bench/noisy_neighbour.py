"""A noisy neighbour against a quiet tenant, under `--scheduling-policy fcfs` and `fair`, in
one run, on the engine process over ZeroMQ (the real engine and client, no web tier).

Tenant A keeps ``--flood`` long requests in flight (a finished one is replaced at once);
tenant B sends one short request a second. The engine's KV cache holds only a share of A's
flood, so A's requests queue. Printed: B's TTFT p50/p99 under each policy, beside B's TTFT on
an idle engine, A's throughput under each policy, and the flood's step time (the running
requests over the tokens generated a second, from the engine's STATS) with its preemptions
a second, and B's TTFT split into phases by the engine's timings. Under `fair` B's first chunk
runs inside the step under way, between two of its layers (mid-step admission); the
`fair-between-steps` row is the same policy with B waiting for the step under way to end.

    .venv/bin/python bench/noisy_neighbour.py [--flood 200] [--seconds 20] [--model DIR]
        [--policies fcfs,fair-between-steps,fair]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

from inference_engine.client import AsyncEngineClient  # noqa: E402
from inference_engine.protocol import GenerateRequest, SamplingParams  # noqa: E402

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))
SHORT_PROMPT = "How do I open a file?"
LONG = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# how each compared engine runs: the policy, and fair with a newcomer's first chunk only
# between steps (the step under way finishes first) as well as inside the step under way
VARIANTS = {
    "fcfs": ["--scheduling-policy", "fcfs"],
    "fair": ["--scheduling-policy", "fair"],
    "fair-between-steps": ["--scheduling-policy", "fair", "--no-mid-step-admission"],
}


@contextlib.contextmanager
def engine(model: str, policy: str, kv_bytes: int, threads: int):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tempfile.NamedTemporaryFile("w", suffix=f"-{policy}.log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference_engine",
            "--model",
            model,
            "--endpoint",
            endpoint,
            *VARIANTS[policy],
            "--kv-cache-memory",
            str(kv_bytes),
            "--max-queued-requests",
            "4096",
            "--tenant-queue-share",
            "1",
            "--threads",
            str(threads),
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'platform'}"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()


# B's TTFT split by the engine's timings (time.time() on the same host): the client's frame
# to the engine's I/O thread, waiting there for a step, the step that samples its first
# token, and that token's way back to the client
PHASES = ("to_engine", "to_step", "first_step", "to_client")


async def ttft(client: AsyncEngineClient, tenant: str, phases: list | None = None) -> float:
    began, began_wall = time.perf_counter(), time.time()
    first = first_wall = None
    request = GenerateRequest(prompt=SHORT_PROMPT, params=SHORT, tenant_id=tenant)
    async for delta in client.generate(request):
        if first is None and delta.token_ids:
            first, first_wall = time.perf_counter() - began, time.time()
        if delta.timings is not None and phases is not None and first_wall is not None:
            t = delta.timings
            phases.append(
                (
                    t.arrival - began_wall,
                    t.first_scheduled - t.arrival,
                    t.first_token - t.first_scheduled,
                    first_wall - t.first_token,
                )
            )
    return first if first is not None else float("nan")


async def flood(client: AsyncEngineClient, tokens: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        request = GenerateRequest(prompt=LONG_PROMPT, params=LONG, tenant_id="a")
        async for delta in client.generate(request):
            tokens[0] += len(delta.token_ids)


async def measure(endpoint: str, flood_size: int, seconds: float) -> dict:
    client = AsyncEngineClient(endpoint)
    try:
        await client.wait_ready(timeout=180)
        for _ in range(2):  # the first requests after the engine starts pay its warm-up
            await ttft(client, "b")
        idle = [await ttft(client, "b") for _ in range(9)]
        stop, tokens = asyncio.Event(), [0]
        flooders = [asyncio.create_task(flood(client, tokens, stop)) for _ in range(flood_size)]
        await asyncio.sleep(min(10.0, seconds / 2))  # the flood fills the engine
        start_tokens, began = tokens[0], time.perf_counter()
        first_stats = await client.stats()
        quiet, running, phases = [], [], []
        for _ in range(int(seconds)):
            tick = time.perf_counter()
            quiet.append(await ttft(client, "b", phases))
            running.append((await client.stats()).num_requests_running)
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - tick)))
        elapsed = time.perf_counter() - began
        a_rate = (tokens[0] - start_tokens) / elapsed
        last_stats = await client.stats()
        generated = last_stats.generation_tokens_total - first_stats.generation_tokens_total
        stop.set()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
        return {
            "idle_p50": statistics.median(idle),
            "b_p50": statistics.median(quiet),
            "b_p99": sorted(quiet)[max(0, int(len(quiet) * 0.99) - 1)],
            "a_tok_s": a_rate,
            # every running request samples about one token a step: the flood's step time,
            # which no scheduling can take off B's first token
            "step_s": statistics.mean(running) * elapsed / max(generated, 1),
            "preemptions_s": (last_stats.num_preemptions - first_stats.num_preemptions) / elapsed,
            **{
                f"b_{name}_p50": statistics.median(p[i] for p in phases)
                for i, name in enumerate(PHASES)
            },
        }
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "demo-chat"))
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=48 << 20, help="bytes: a share of A's flood"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--policies",
        default="fcfs,fair-between-steps,fair",
        help=f"comma-separated of {', '.join(VARIANTS)}",
    )
    args = parser.parse_args()
    results = {}
    for policy in args.policies.split(","):
        with engine(args.model, policy, args.kv_cache_memory, args.threads) as endpoint:
            results[policy] = asyncio.run(measure(endpoint, args.flood, args.seconds))
        print(policy, {k: round(v, 4) for k, v in results[policy].items()}, flush=True)
    idle = statistics.median(r["idle_p50"] for r in results.values())
    print()
    print(f"B's TTFT alone on an idle engine: p50 {idle * 1e3:.0f} ms")
    print(
        f"{'policy':18} {'B TTFT p50':>11} {'B TTFT p99':>11} {'x idle':>7} {'A tok/s':>8} "
        f"{'step':>8} {'preempt/s':>9}"
    )
    for policy, r in results.items():
        print(
            f"{policy:18} {r['b_p50'] * 1e3:9.0f} ms {r['b_p99'] * 1e3:9.0f} ms "
            f"{r['b_p50'] / idle:7.1f} {r['a_tok_s']:8.0f} {r['step_s'] * 1e3:5.0f} ms "
            f"{r['preemptions_s']:9.1f}"
        )
    print()
    print("B's TTFT p50 by phase (ms): " + ", ".join(PHASES))
    for policy, r in results.items():
        print(f"{policy:18} " + " ".join(f"{r[f'b_{n}_p50'] * 1e3:9.1f}" for n in PHASES))
    if "fcfs" in results:
        for policy, r in results.items():
            if policy != "fcfs":
                share = r["a_tok_s"] / results["fcfs"]["a_tok_s"]
                print(f"A keeps {share:.0%} of its fcfs rate under {policy}")


if __name__ == "__main__":
    main()
