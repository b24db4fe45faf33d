"""bench/gpu_throughput.py is run on a GPU machine lent for minutes at a time: a mistake in it
costs that time. ``--smoke`` runs every row of it on a tiny model, on the CPU here."""

import json
import subprocess

from tests.conftest import PYTHON, ROOT, subprocess_env

ROWS = [
    "engine load",
    "fixed: engine, CUDA graphs",
    "step: 4 decodes at ~32 context",
    "fixed: engine, CUDA graphs, every request with a frequency penalty",
    "latency at 1 concurrent",
    "latency at 4 concurrent",
    "mixed: engine, CUDA graphs",
    "fixed: engine, CUDA graphs, no async scheduling",
    "fixed: engine, eager",
    "fixed: HF generate, static batches of 4",
    "fixed: transformers continuous batching (paged|sdpa)",
    "ceiling: bare decode forward at 8",
]


def test_every_row_of_the_gpu_benchmark_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [
            PYTHON,
            "bench/gpu_throughput.py",
            "--smoke",
            "--model-dir",
            str(tmp_path / "model"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    failed = [row for row in rows if "error" in row]
    assert not failed, failed
    assert [row["row"] for row in rows if "row" in row] == ROWS
    measured = {row["row"]: row for row in rows if "row" in row}
    assert measured["fixed: engine, CUDA graphs"]["tok_s"] > 0
    assert measured["latency at 4 concurrent"]["tpot_p50_ms"] > 0
    assert "ratio" in done.stdout
