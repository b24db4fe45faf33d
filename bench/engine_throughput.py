"""Offline throughput of the engine against Hugging Face baselines, measured in one run.

Peers, all on the same tiny bf16 Llama and the same requests:
  (a) HF ``generate`` one request at a time
  (b) HF ``generate`` on left-padded static batches of 16
  (c) transformers' continuous batching (``generate_batch`` / its manager)
  (d) this engine (``inference_engine.LLM``)

Workloads:
  fixed   64 prompts (32-256 tokens) x 128 forced new tokens
  mixed   256 requests, prompt lengths 16-1024 and output lengths 16-512 from a fixed seed

Throughput counts the requested output tokens per second of wall time (prefill included).
Static batches generate to the longest request of the batch; only requested tokens count.

    .venv/bin/python bench/engine_throughput.py            # the full spec (slow: tens of minutes)
    .venv/bin/python bench/engine_throughput.py --quick    # shrunken workloads
    .venv/bin/python bench/engine_throughput.py --skip a   # skip the one-at-a-time baseline
    .venv/bin/python bench/engine_throughput.py --threads 1   # on a machine shared with others
    .venv/bin/python bench/engine_throughput.py --repetition-penalty 1.2  # every peer penalises

(c) is driven through the manager behind ``generate_batch`` (``add_request`` takes a
``max_new_tokens`` per request, ``generate_batch`` only one for all); its start-up and warm-up
are not timed, as the engine's model load is not.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass

import torch

MODEL_DESCRIPTION = (
    "Llama, hidden 256, 4 layers, 4 heads / 2 KV heads (head_dim 64), MLP 768, vocab 32000, "
    "bf16, random weights"
)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: list[int]
    # every peer's requests apply it (HF's processor and the engine's penalty are the same
    # rule: prompt and output tokens, positive logits divided, negative multiplied)
    repetition_penalty: float = 1.0

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_new_tokens)


def build_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def make_workloads(quick: bool) -> list[Workload]:
    rng = random.Random(2024)
    n_fixed, new_fixed = (16, 32) if quick else (64, 128)
    fixed = Workload(
        "fixed",
        [[rng.randrange(3, 32000) for _ in range(rng.randint(32, 256))] for _ in range(n_fixed)],
        [new_fixed] * n_fixed,
    )
    n_mixed, max_prompt, max_out = (32, 256, 64) if quick else (256, 1024, 512)
    prompt_lens = [rng.randint(16, max_prompt) for _ in range(n_mixed)]
    mixed = Workload(
        "mixed",
        [[rng.randrange(3, 32000) for _ in range(n)] for n in prompt_lens],
        [rng.randint(16, max_out) for _ in range(n_mixed)],
    )
    return [fixed, mixed]


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@torch.inference_mode()
def run_hf_sequential(path: str, workload: Workload) -> float:
    model = load_hf(path)
    start = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.max_new_tokens, strict=True):
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            repetition_penalty=workload.repetition_penalty,
        )
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf_static(path: str, workload: Workload, batch_size: int = 16) -> float:
    model = load_hf(path)
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[i : i + batch_size]
        n = max(workload.max_new_tokens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            repetition_penalty=workload.repetition_penalty,
        )
    return time.perf_counter() - start


def run_hf_continuous(path: str, workload: Workload) -> float:
    from transformers import GenerationConfig

    model = load_hf(path)
    config = GenerationConfig(
        max_new_tokens=max(workload.max_new_tokens),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
        repetition_penalty=workload.repetition_penalty,
    )
    # The manager's start-up (cache sizing, warm-up) is excluded, like the engine's load.
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(
            zip(workload.prompts, workload.max_new_tokens, strict=True)
        ):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        finished = 0
        while finished < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
        elapsed = time.perf_counter() - start
    return elapsed


def run_engine(path: str, workload: Workload) -> float:
    from inference_engine import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=n,
            ignore_eos=True,
            repetition_penalty=workload.repetition_penalty,
        )
        for n in workload.max_new_tokens
    ]
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    produced = [len(o.token_ids) for o in outputs]
    assert produced == workload.max_new_tokens, "engine produced the wrong token counts"
    return elapsed


PEERS = {
    "a": ("HF generate, one at a time", run_hf_sequential),
    "b": ("HF generate, static batches of 16", run_hf_static),
    "c": ("transformers continuous batching", run_hf_continuous),
    "d": ("inference_engine", run_engine),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shrink both workloads")
    parser.add_argument("--skip", default="", help="peers to skip, e.g. 'a' or 'ac'")
    parser.add_argument("--workloads", default="fixed,mixed", help="comma-separated names")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="for every peer's requests"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"model: {MODEL_DESCRIPTION}")
    with tempfile.TemporaryDirectory() as path:
        build_model(path)
        for workload in make_workloads(args.quick):
            if workload.name not in args.workloads.split(","):
                continue
            workload.repetition_penalty = args.repetition_penalty
            print(
                f"\nworkload {workload.name}: {len(workload.prompts)} requests, "
                f"{sum(map(len, workload.prompts))} prompt tokens, "
                f"{workload.num_output_tokens} output tokens, "
                f"repetition penalty {workload.repetition_penalty}"
            )
            rates = {}
            for key, (label, run) in PEERS.items():
                if key in args.skip:
                    continue
                elapsed = run(path, workload)
                rates[key] = workload.num_output_tokens / elapsed
                print(
                    f"  ({key}) {label:<36} {elapsed:8.1f} s  {rates[key]:8.1f} tok/s", flush=True
                )
            if "d" in rates:
                for key, rate in rates.items():
                    if key != "d":
                        print(f"  engine / ({key}) = {rates['d'] / rate:.2f}x")


if __name__ == "__main__":
    main()
