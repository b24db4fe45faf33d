"""What the gateway costs: the same streaming chat requests through the platform's HTTP API
(Daphne, auth, admission, metering, SSE) and straight through ``AsyncEngineClient``, against
one engine process, at 1 and 64 concurrent streams.

Prints TTFT and inter-token latency (p50, p99) and throughput for both, the ratios, and the
CPU time Daphne spent (a figure that the machine's noise moves less than the ratios). Goal:
the gateway adds under 5 ms to TTFT at p50 and keeps 90% of direct throughput at 64. Daphne
runs as deployed, with DEBUG off.

By default the engine gets CPU 0 to itself and Daphne and the clients share the others, as
when the engine owns a GPU host; ``--engine-cpus ''`` lets all three share every CPU.

    .venv/bin/python bench/gateway_overhead.py [--model models/demo-chat] [--max-tokens 64]
        [--baseline GIT_REF]  # also a commit's web tier, alternating: before and after
"""

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

PROMPT = [{"role": "user", "content": "What does json.dumps do?"}]
MODEL_NAME = "bench"


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0
    server_cpu: float | None = None  # CPU seconds Daphne spent on the run (gateway only)

    def add(self, start: float, token_times: list[float], num_tokens: int) -> None:
        if token_times:
            self.ttft.append(token_times[0] - start)
            self.itl.extend(b - a for a, b in zip(token_times, token_times[1:], strict=False))
        self.tokens += num_tokens
        self.requests += 1


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _direct(endpoint: str, num: int, concurrency: int, max_tokens: int) -> Run:
    from inference_engine.client import AsyncEngineClient
    from inference_engine.protocol import GenerateRequest, SamplingParams

    client = AsyncEngineClient(endpoint)
    await client.wait_ready(timeout=120)
    run, gate = Run(), asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            request = GenerateRequest(
                messages=PROMPT,
                params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            )
            start, times, count = time.perf_counter(), [], 0
            async for delta in client.generate(request):
                if delta.token_ids:
                    times.append(time.perf_counter())
                    count += len(delta.token_ids)
            run.add(start, times, count)

    began = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(num)))
    run.seconds = time.perf_counter() - began
    client.close()
    return run


class _SSEConnection:
    """One keep-alive HTTP/1.1 connection that POSTs a streaming request and reads its
    server-sent events. A load generator on the same two cores as the server must stay light:
    httpx spends more CPU per event than Daphne does (measured 1.0 s vs 0.7 s for 8,192
    events), so this reads the chunked body with asyncio streams and looks for content
    events with a regex; the usage event is the only one parsed as JSON."""

    CONTENT = re.compile(rb'"delta":\{"content":"[^"]')

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self) -> tuple[float, list[float], int]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        start, times, tokens = time.perf_counter(), [], 0
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"gateway answered {head[:200]!r}")
        while size := int((await self.reader.readline()).strip(), 16):
            chunk = await self.reader.readexactly(size + 2)
            now = time.perf_counter()
            times += [now] * len(self.CONTENT.findall(chunk))
            if b'"usage":{' in chunk:
                usage_event = next(e for e in chunk.split(b"\n\n") if b'"usage":{' in e)
                tokens = json.loads(usage_event[6:])["usage"]["completion_tokens"]
        await self.reader.readline()  # the blank line after the last chunk
        return start, times, tokens

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _gateway(base: str, key: str, num: int, concurrency: int, max_tokens: int) -> Run:
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": PROMPT,
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    host, port = base.removeprefix("http://").split(":")
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    idle: asyncio.Queue = asyncio.Queue()
    connections = [_SSEConnection(host, int(port), request) for _ in range(concurrency)]
    for connection in connections:
        idle.put_nowait(connection)
    run = Run()

    async def one() -> None:
        connection = await idle.get()
        try:
            run.add(*(await connection.stream()))
        finally:
            idle.put_nowait(connection)

    began = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(num)))
    run.seconds = time.perf_counter() - began
    for connection in connections:
        connection.close()
    return run


SETUP = """
import django, sys
django.setup()
from django.core.management import call_command
from serving.services import deployment_register
from tenants import services
from tenants.models import Plan
call_command("migrate", interactive=False, verbosity=0)
plan = Plan.objects.create(slug="bench", name="Bench")
tenant = services.tenant_create(slug="bench", plan=plan)
deployment_register(name=sys.argv[2], endpoints=[sys.argv[1]])
print(services.api_key_create(tenant=tenant, name="bench")[1])
"""


@dataclass
class Gateway:
    """One web tier under test: a Daphne from a source tree, with its own embedded database."""

    name: str
    source: Path
    port: int
    env: dict[str, str]
    key: str = ""
    process: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _gateway_env(base_env: dict[str, str], source: Path, var_dir: str) -> dict[str, str]:
    paths = os.pathsep.join([str(source / "platform"), str(source)])
    return {**base_env, "VAR_DIR": var_dir, "PYTHONPATH": paths}


def _start_gateway(gateway: Gateway, endpoint: str, cpus: set[int] | None) -> None:
    """Migrate its fresh database, register the engine, make a key, start its Daphne."""
    setup = subprocess.run(
        [sys.executable, "-c", SETUP, endpoint, MODEL_NAME],
        env=gateway.env, cwd=gateway.source, capture_output=True, text=True, check=True,
    )  # fmt: skip
    gateway.key = setup.stdout.strip().splitlines()[-1]
    gateway.process = subprocess.Popen(
        [sys.executable, "-m", "config.webserver", "-p", str(gateway.port),
         "config.asgi:application"],
        env=gateway.env, cwd=gateway.source, stderr=subprocess.DEVNULL,
        preexec_fn=_pinned_to(cpus),
    )  # fmt: skip


def _checkout(ref: str) -> Path:
    """A worktree of ``ref`` beside this one (the same virtual environment runs it)."""
    folder = Path(tempfile.mkdtemp(prefix="gateway-bench-baseline-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), ref],
        check=True, capture_output=True,
    )  # fmt: skip
    return folder


def _cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process so far (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pinned_to(cpus: set[int] | None):
    """A preexec_fn that pins the child to ``cpus`` (None: no pinning)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _wait_http(url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} never answered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "demo-chat"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--requests",
        type=int,
        default=640,
        help="requests at 64 streams: 10 per stream, so that the first wave's arrival is not "
        "most of the run",
    )
    parser.add_argument("--single", type=int, default=48, help="requests one at a time")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both paths")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--engine-threads", default="1", help="engine torch threads (1 leaves a core to Daphne)"
    )
    parser.add_argument(
        "--engine-cpus",
        default="0" if (os.cpu_count() or 1) > 1 else "",
        help="CPUs the engine is pinned to (the web tier and this client get the others), as "
        "when the engine owns a GPU host; '' shares every CPU between all three",
    )
    parser.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run the web tier of this commit (a git worktree) on the same engine, "
        "alternating with this tree's, and print both: a change's before and after in one run",
    )
    args = parser.parse_args()
    engine_cpus = {int(cpu) for cpu in args.engine_cpus.split(",") if cpu}
    web_cpus = set(range(os.cpu_count() or 1)) - engine_cpus or None

    work = tempfile.mkdtemp(prefix="gateway-bench-")
    endpoint = f"ipc://{work}/engine.sock"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "LOG_LEVEL": "WARNING",
        # as deployed: DEBUG keeps every query's SQL and runs one more to render it
        "DEBUG": "0",
        "SECRET_KEY": "gateway-bench-only",
        "ALLOWED_HOSTS": "127.0.0.1",
    }
    for name in ("DATABASE_URL", "REDIS_URL"):
        env.pop(name, None)
    gateways = [Gateway("gateway", ROOT, args.port, _gateway_env(env, ROOT, f"{work}/ours"))]
    baseline_tree = None
    if args.baseline:
        baseline_tree = _checkout(args.baseline)
        baseline_env = _gateway_env(env, baseline_tree, f"{work}/baseline")
        gateways.append(
            Gateway(f"@{args.baseline}"[:8], baseline_tree, args.port + 1, baseline_env)
        )
    for gateway in gateways:
        os.makedirs(gateway.env["VAR_DIR"], exist_ok=True)

    engine = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "--model", args.model, "--endpoint", endpoint,
         "--served-model-name", MODEL_NAME, "--log-level", "WARNING",
         "--threads", args.engine_threads],
        env=gateways[0].env,
        preexec_fn=_pinned_to(engine_cpus),
    )  # fmt: skip
    if engine_cpus and web_cpus:
        os.sched_setaffinity(0, web_cpus)  # this process is the clients of both paths
    rows = []
    try:
        for gateway in gateways:
            _start_gateway(gateway, endpoint, web_cpus if engine_cpus else None)
        for gateway in gateways:
            _wait_http(f"{gateway.base}/health/live", 60)
        asyncio.run(_direct(endpoint, 4, 4, 8))  # warm-up: engine ready, caches primed
        for gateway in gateways:
            asyncio.run(_gateway(gateway.base, gateway.key, 4, 4, 8))
        for round_ in range(args.rounds):  # alternating, so a noisy spell hits every path
            for concurrency, num in ((1, args.single), (64, args.requests)):
                direct = asyncio.run(_direct(endpoint, num, concurrency, args.max_tokens))
                served = {}
                # every other round the other way round, so that no tree always goes first
                for gateway in gateways if round_ % 2 == 0 else gateways[::-1]:
                    cpu_before = _cpu_seconds(gateway.process.pid)
                    run = asyncio.run(
                        _gateway(gateway.base, gateway.key, num, concurrency, args.max_tokens)
                    )
                    cpu_after = _cpu_seconds(gateway.process.pid)
                    if cpu_before is not None and cpu_after is not None:
                        run.server_cpu = cpu_after - cpu_before
                    served[gateway.name] = run
                ordered = {gateway.name: served[gateway.name] for gateway in gateways}
                rows.append((round_ + 1, concurrency, direct, ordered))
    finally:
        for process in [g.process for g in gateways if g.process] + [engine]:
            process.terminate()
            process.wait(timeout=30)
        if baseline_tree is not None:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline_tree)],
                check=False,
            )
    _report(args, rows, engine_cpus, web_cpus)


def _report(args, rows, engine_cpus, web_cpus) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"\nmachine: {machine}, Python {platform.python_version()}")
    if engine_cpus and web_cpus:
        print(f"engine on CPUs {sorted(engine_cpus)}; Daphne and the clients on {sorted(web_cpus)}")
    else:
        print("engine, Daphne and the clients share every CPU")
    print(f"model: {args.model}, {args.max_tokens} tokens per request, greedy, ignore_eos")
    header = f"{'round':>5} {'streams':>7} {'path':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
    print(header + f"{'ITL p50':>8} {'ITL p99':>8} {'tok/s':>8}  Daphne CPU per request")
    added: dict[tuple[str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    cpu_per_token: dict[tuple[str, int], list[float]] = {}
    for round_, concurrency, direct, served in rows:
        for name, run in (("direct", direct), *served.items()):
            ttft = f"{_pct(run.ttft, 0.5):>7.1f}ms {_pct(run.ttft, 0.99):>7.1f}ms"
            itl = f"{_pct(run.itl, 0.5):>6.1f}ms {_pct(run.itl, 0.99):>6.1f}ms"
            tok_s = run.tokens / run.seconds
            cpu = ""
            if run.server_cpu is not None:
                cpu = f"  {run.server_cpu / run.requests * 1000:.2f}ms"
                per_token = run.server_cpu / run.tokens
                cpu_per_token.setdefault((name, concurrency), []).append(per_token)
            print(f"{round_:>5} {concurrency:>7} {name:>8} {ttft} {itl} {tok_s:>8.0f}{cpu}")
        for name, run in served.items():
            added.setdefault((name, concurrency), []).append(
                (statistics.median(run.ttft) - statistics.median(direct.ttft)) * 1000
            )
            ratios.setdefault((name, concurrency), []).append(
                (run.tokens / run.seconds) / (direct.tokens / direct.seconds)
            )
    print(f"\nmedian of {args.rounds} rounds (each round's figures in brackets):")
    for (name, concurrency), values in added.items():
        each_added = ", ".join(f"{a:+.1f}" for a in values)
        each_ratio = ", ".join(f"{r:.2f}" for r in ratios[name, concurrency])
        print(
            f"{name:>8}, {concurrency:>2} streams: adds "
            f"{statistics.median(values):+.1f} ms TTFT p50 [{each_added}]; "
            f"throughput vs direct {statistics.median(ratios[name, concurrency]):.2f} "
            f"[{each_ratio}]"
        )
    for (name, concurrency), values in cpu_per_token.items():
        print(
            f"{name:>8}, {concurrency:>2} streams: Daphne spent "
            f"{statistics.median(values) * 1e6:.0f} us of CPU per streamed token "
            "(the request's own work included)"
        )


if __name__ == "__main__":
    main()
