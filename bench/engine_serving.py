"""Serving over ZeroMQ against the in-process engine, measured in one run.

Peers, all on the same tiny Llama, tokenizer and requests (greedy, EOS ignored):
  (a) ``LLM.generate`` in process: no transport, detokenized at the end (the ceiling)
  (b) ``python -m inference_engine`` + one ``AsyncEngineClient``, N concurrent streams,
      async output processing (detokenize/serialize/send on the output thread)
  (c) the same with ``--no-async-output`` (that work inline in the busy loop)

Figures: output tokens per second of wall time, and per stream, as the client sees them,
time to first token and inter-token latency (p50 / p99), and CPU time per output token of the
engine process (user + system; steadier than wall time on a busy machine) and of the client.
Ratios: (b)/(a), (c)/(a), (b)/(c), of throughput and of engine CPU per token. Then the same
requests are served again at lower concurrency (``--levels``, default 1 and 16 streams).
Each peer runs ``--repeat`` times, interleaved, each run in a fresh process, and the fastest
run counts (the machine this was written on is shared, so single runs are noisy).

    .venv/bin/python bench/engine_serving.py            # 64 streams x 128 tokens
    .venv/bin/python bench/engine_serving.py --quick    # 32 streams x 32 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

VOCAB_SIZE = 8000
MODEL_DESCRIPTION = (
    f"Llama, hidden 256, 4 layers, 4 heads / 2 KV heads (head_dim 64), MLP 768, "
    f"byte-level BPE vocab {VOCAB_SIZE}, float32, random weights"
)


def build_model(path: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [
        (Path(module.__file__).read_text(errors="replace"))
        for module in (argparse, asyncio.base_events, statistics, subprocess, tempfile)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def make_prompts(num_streams: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(2024)
    return [
        [rng.randrange(1, vocab_size) for _ in range(rng.randint(32, 128))]
        for _ in range(num_streams)
    ]


def run_offline(path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """In a fresh process, like the served peers' engines."""
    code = (
        "import json, sys; from engine_serving import offline_worker; "
        "print(json.dumps(offline_worker(*json.load(sys.stdin))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([path, prompts, max_tokens]),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def offline_worker(path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from inference_engine import LLM, SamplingParams

    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return {"elapsed": elapsed, "cpu": cpu, "texts": [o.text for o in outputs]}


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_all(
    endpoint: str,
    engine_pid: int,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int | None = None,
) -> dict:
    from inference_engine.client import AsyncEngineClient
    from inference_engine.protocol import GenerateRequest, SamplingParams

    client = AsyncEngineClient(endpoint)
    await client.wait_ready(timeout=120)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warm = GenerateRequest(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    [_ async for _ in client.generate(warm)]
    ttfts: list[float] = []
    itls: list[float] = []
    gate = asyncio.Semaphore(concurrency or len(prompts))

    async def one(prompt: list[int]) -> str:
        async with gate:
            return await stream_one(prompt)

    async def stream_one(prompt: list[int]) -> str:
        sent = last = time.perf_counter()
        text, num_tokens = [], 0
        request = GenerateRequest(prompt_token_ids=prompt, params=params)
        async for delta in client.generate(request):
            now = time.perf_counter()
            if delta.token_ids:
                if num_tokens == 0:
                    ttfts.append(now - sent)
                else:
                    itls.append((now - last) / len(delta.token_ids))
                last = now
                num_tokens += len(delta.token_ids)
            text.append(delta.text)
        assert num_tokens == max_tokens, (num_tokens, delta)
        return "".join(text)

    start, cpu_start = time.perf_counter(), process_cpu_seconds(engine_pid)
    client_cpu_start = time.process_time()
    texts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed, cpu = time.perf_counter() - start, process_cpu_seconds(engine_pid) - cpu_start
    client_cpu = time.process_time() - client_cpu_start
    client.close()
    return {"elapsed": elapsed, "cpu": cpu, "client_cpu": client_cpu, "texts": texts,
            "ttft": ttfts, "itl": itls}  # fmt: skip


def run_served(
    path: str, folder: str, prompts, max_tokens: int, *flags: str, concurrency: int | None = None
) -> dict:
    endpoint = f"ipc://{folder}/bench-{len(flags)}.sock"
    command = [sys.executable, "-m", "inference_engine", "--model", path, "--endpoint", endpoint,
               "--dtype", "float32", "--log-level", "WARNING", *flags]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "platform")]))
    engine = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        return asyncio.run(stream_all(endpoint, engine.pid, prompts, max_tokens, concurrency))
    finally:
        engine.terminate()
        engine.wait(60)


def percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {cuts[49] * 1000:7.1f} ms  p99 {cuts[98] * 1000:7.1f} ms"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 streams x 32 tokens")
    parser.add_argument("--streams", type=int, help="concurrent streams (default 64)")
    parser.add_argument("--max-tokens", type=int, help="tokens per stream (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per peer (default 3)")
    parser.add_argument(
        "--levels",
        default="1,16",
        help="also serve the same requests at these lower concurrencies (default 1,16)",
    )
    args = parser.parse_args()
    num_streams = args.streams or (32 if args.quick else 64)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"model: {MODEL_DESCRIPTION}")
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "model")
        build_model(path)
        prompts = make_prompts(num_streams, VOCAB_SIZE)
        num_tokens = num_streams * max_tokens
        print(f"workload: {num_streams} concurrent streams, prompts 32-128 tokens, "
              f"{max_tokens} tokens each ({num_tokens} output tokens)\n")  # fmt: skip
        peers = {
            "a": ("LLM.generate in process", lambda: run_offline(path, prompts, max_tokens)),
            "b": ("served, async output", lambda: run_served(path, folder, prompts, max_tokens)),
            "c": (
                "served, --no-async-output",
                lambda: run_served(path, folder, prompts, max_tokens, "--no-async-output"),
            ),
        }
        runs: dict[str, list[dict]] = {key: [] for key in peers}
        for _ in range(args.repeat):
            for key, (_, run) in peers.items():
                runs[key].append(run())
        results = {
            key: (label, min(runs[key], key=lambda r: r["elapsed"]))
            for key, (label, _) in peers.items()
        }
        levels = [int(level) for level in args.levels.split(",") if level.strip()]
        by_level = {
            level: min(
                (
                    run_served(path, folder, prompts, max_tokens, concurrency=level)
                    for _ in range(args.repeat)
                ),
                key=lambda r: r["elapsed"],
            )
            for level in levels
            if level < num_streams
        }
    rates = {}
    for key, (label, result) in results.items():
        rates[key] = num_tokens / result["elapsed"]
        all_runs = " ".join(f"{r['elapsed']:.2f}" for r in runs[key])
        print(f"({key}) {label:<26} {result['elapsed']:7.2f} s  {rates[key]:8.1f} tok/s"
              f"   (runs: {all_runs} s)")  # fmt: skip
        cpu = min(r["cpu"] for r in runs[key]) / num_tokens * 1000
        line = f"    engine CPU {cpu:.2f} ms/token"
        if "ttft" in result:
            client_cpu = min(r["client_cpu"] for r in runs[key]) / num_tokens * 1000
            line += f", client CPU {client_cpu:.2f} ms/token"
            print(f"    TTFT {percentiles(result['ttft'])}   ITL {percentiles(result['itl'])}")
        print(line)
    same = all(r["texts"] == runs["a"][0]["texts"] for rs in runs.values() for r in rs)
    print(f"\nsame texts in all three: {same}")
    print(f"served async / in process  (b)/(a) = {rates['b'] / rates['a']:.2f}x")
    print(f"served inline / in process (c)/(a) = {rates['c'] / rates['a']:.2f}x")
    print(f"async / inline output      (b)/(c) = {rates['b'] / rates['c']:.2f}x")
    offline = rates["a"]
    for level, result in sorted(by_level.items()):
        rate = num_tokens / result["elapsed"]
        print(f"\nserved (async) at {level} concurrent streams: {rate:8.1f} tok/s "
              f"({rate / offline:.2f}x in process)")  # fmt: skip
        print(f"    TTFT {percentiles(result['ttft'])}   ITL {percentiles(result['itl'])}")
    cpus = {key: min(r["cpu"] for r in rs) for key, rs in runs.items()}
    print(f"engine CPU per token vs in process: (b)/(a) = {cpus['b'] / cpus['a']:.2f}x, "
          f"(c)/(a) = {cpus['c'] / cpus['a']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
