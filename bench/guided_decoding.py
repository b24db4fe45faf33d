"""Structured outputs' cost: the engine's throughput with 0%, 50% and 100% of a batch guided by
a JSON schema, and the sampler's per-step mask cost, in one run.

    .venv/bin/python bench/guided_decoding.py [--model models/demo-chat] [--requests 64]
                                              [--max-tokens 128] [--repeat 2]

The peer is the same engine unguided (0%): the goal is at most 10% fewer tokens a second at
100% guided. Every request is greedy on the same chat prompt with ``max_tokens`` tokens at most;
a guided request ends where its JSON does, so each figure is generated tokens over wall time.
The step figures time the sampler alone on a ``[requests, vocab]`` logits tensor: unguided, and
with every row masked by a matcher in the middle of the schema (fill on the host, apply).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from inference_engine import LLM, SamplingParams
from inference_engine.protocol import StructuredOutputsParams
from inference_engine.sampler import Sampler, SamplingRow

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "needs_code": {"type": "boolean"},
    },
    "required": ["answer", "confidence", "topics", "needs_code"],
    "additionalProperties": False,
}
QUESTION = [
    {"role": "user", "content": "How do I read a file line by line in Python? Answer as JSON."}
]


def run(llm: LLM, requests: int, guided_share: float, max_tokens: int) -> tuple[float, int]:
    num_guided = round(requests * guided_share)
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    guided = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
    )
    params = [guided] * num_guided + [free] * (requests - num_guided)
    began = time.perf_counter()
    outputs = llm.chat([QUESTION] * requests, params)
    elapsed = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outputs)
    return tokens / elapsed, tokens


def step_cost_ms(llm: LLM, requests: int, repeat: int) -> tuple[float, float]:
    """The sampler's median ms per step without and with a grammar on every row."""
    vocab_size = llm.core.vocab_size
    logits = torch.randn(requests, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=100)
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    prefix = llm.tokenizer('{"answer": "use', add_special_tokens=False)["input_ids"]
    sampler = Sampler(torch.device("cpu"))

    def rows(guided: bool) -> list[SamplingRow]:
        made = []
        for i in range(requests):
            matcher = None
            if guided:
                matcher = llm.core.grammars.matcher(spec)
                for token in prefix:
                    matcher.accept_token(token)
            made.append(SamplingRow(str(i), params, [1], [], frozenset(), matcher))
        return made

    def median_ms(guided: bool) -> float:
        times = []
        for _ in range(repeat * 20):
            batch = rows(guided)  # fresh matchers: the step advances them
            began = time.perf_counter()
            sampler(logits, batch)
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)

    return median_ms(False), median_ms(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/demo-chat")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model)
    run(llm, 8, 1.0, 16)  # warm up: weights, the grammar's compilation
    results = {}
    for share in (0.0, 0.5, 1.0):
        rounds = [run(llm, args.requests, share, args.max_tokens) for _ in range(args.repeat)]
        results[share] = max(rate for rate, _ in rounds), rounds[0][1]
    peer = results[0.0][0]
    print(f"{args.requests} requests, greedy, max_tokens {args.max_tokens}, {args.model}")
    print(f"{'guided':>8} {'tok/s':>9} {'tokens':>7} {'vs unguided':>12}")
    for share, (rate, tokens) in results.items():
        print(f"{share:>8.0%} {rate:>9.1f} {tokens:>7} {rate / peer:>11.2f}x")
    plain, masked = step_cost_ms(llm, args.requests, args.repeat)
    print(
        f"sampler step at {args.requests} rows: unguided {plain:.2f} ms, every row guided "
        f"{masked:.2f} ms (+{masked - plain:.2f} ms a step for the masks)"
    )


if __name__ == "__main__":
    main()
