"""bench/gpu_throughput.py is run on a GPU machine lent for minutes at a time: a mistake in it
costs that time. ``--smoke`` runs every row of it on a tiny model, on the CPU here."""

import importlib.util
import json
import subprocess
import sys

import torch

from tests.conftest import PYTHON, ROOT, subprocess_env

CORE_ROWS = [
    "engine load",
    "fixed: engine, CUDA graphs",
    "step: 4 decodes at ~32 context",
    "latency at 1 concurrent",
    "fixed: HF generate, static batches of 4 (1 of 2 timed)",
    "ceiling: bare decode forward at 8",
]
REST_ROWS = [
    "engine load",
    "fixed: engine, CUDA graphs, every request with a frequency penalty",
    "latency at 4 concurrent",
    "mixed: engine, CUDA graphs",
    "fixed: engine, CUDA graphs, no async scheduling",
    "fixed: engine, eager",
    "fixed: transformers continuous batching (paged|sdpa)",
]


def run_smoke(tmp_path, *arguments: str) -> tuple[dict[str, dict], str]:
    """The benchmark's ``--smoke`` with ``arguments``: its rows by name (none failed, in the
    order measured) and its stdout."""
    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [
            PYTHON,
            "bench/gpu_throughput.py",
            "--smoke",
            "--model-dir",
            str(tmp_path.parent / "model"),
            "--out",
            str(out),
            *arguments,
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
    return {row["row"]: row for row in rows if "row" in row}, done.stdout


def test_the_done_when_rows_run_alone_and_end_with_a_verdict_on_each_target(tmp_path):
    (tmp_path / "core").mkdir()
    measured, stdout = run_smoke(tmp_path / "core", "--core")
    assert list(measured) == CORE_ROWS
    assert measured["fixed: engine, CUDA graphs"]["tok_s"] > 0
    assert measured["latency at 1 concurrent"]["tpot_p50_ms"] > 0
    assert "ratio" in stdout
    verdicts = stdout.split("done when (issue 15):")[1].splitlines()[1:]
    # no CUDA graph on the CPU, so no captured ceiling to judge the step against
    judged = ["fixed workload", "vs HF static", "single request TPOT"]
    if torch.cuda.is_available():
        judged.insert(2, "4-decode step vs ceiling")
    assert [line.split(":")[0].split(None, 1)[1] for line in verdicts] == judged
    assert all(line.split()[0] in ("MET", "MISS") for line in verdicts)


def test_the_other_rows_run_in_a_call_of_their_own(tmp_path):
    (tmp_path / "rest").mkdir()
    measured, _ = run_smoke(tmp_path / "rest", "--rest")
    assert list(measured) == REST_ROWS
    assert measured["latency at 4 concurrent"]["tpot_p50_ms"] > 0
    assert measured["fixed: engine, eager"]["step_ms"] > 0


def test_sync_waits_for_the_gpu_once(monkeypatch):
    """Timings end at ``sync()``: on CUDA it must wait for the device (it once called itself)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_throughput", ROOT / "bench" / "gpu_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    waits = []
    monkeypatch.setattr(bench, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waits.append(args))
    bench.sync()
    assert waits == [()]
