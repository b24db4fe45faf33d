"""bench/gpu_throughput.py is run on a GPU machine lent for minutes at a time: a mistake in it
costs that time. ``--smoke`` runs every row of it on a tiny model, on the CPU here."""

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

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
    "fixed: HF generate, static batches of 4 (1 of 2 timed)",
    "fixed: transformers continuous batching (paged|sdpa)",
    "ceiling: bare decode forward at 8",
]


@pytest.fixture
def bench(monkeypatch):
    """bench/gpu_throughput.py, imported."""
    spec = importlib.util.spec_from_file_location(
        "gpu_throughput", ROOT / "bench" / "gpu_throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_row_runs_on_a_tiny_model_and_the_run_ends_with_a_verdict_on_each_target(
    tmp_path,
):
    out = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [
            PYTHON,
            "bench/gpu_throughput.py",
            "--smoke",
            "--hf-batches",  # as --core times HF's static batches
            "1",
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
    measured = {row["row"]: row for row in rows if "row" in row}
    assert list(measured) == ROWS
    assert measured["fixed: engine, CUDA graphs"]["tok_s"] > 0
    assert measured["latency at 1 concurrent"]["tpot_p50_ms"] > 0
    assert measured["latency at 4 concurrent"]["tpot_p50_ms"] > 0
    assert measured["fixed: engine, eager"]["step_ms"] > 0
    assert "ratio" in done.stdout
    verdicts = done.stdout.split("done when (issue 15):")[1].splitlines()[1:]
    # no CUDA graph on the CPU, so no captured ceiling to judge the step against
    judged = ["fixed workload", "vs HF static", "single request TPOT"]
    if torch.cuda.is_available():
        judged.insert(2, "4-decode step vs ceiling")
    assert [line.split(":")[0].split(None, 1)[1] for line in verdicts] == judged
    assert all(line.split()[0] in ("MET", "MISS") for line in verdicts)


def test_the_done_when_rows_and_the_others_split_every_row_between_two_calls(bench):
    def rows(core=False, rest=False, skip=""):
        return bench.select_rows(argparse.Namespace(core=core, rest=rest, skip=skip))

    core, rest, every = rows(core=True), rows(rest=True), rows()
    assert core == {"fixed", "step", "latency1", "hf", "ceiling"}
    assert core | rest == every and not core & rest
    assert rows(skip="latency,cb") == every - {"latency", "latency1", "cb"}
    with pytest.raises(SystemExit, match="no such rows: warp"):
        rows(skip="warp")


def test_sync_waits_for_the_gpu_once(bench, monkeypatch):
    """Timings end at ``sync()``: on CUDA it must wait for the device (it once called itself)."""
    waits = []
    monkeypatch.setattr(bench, "DEVICE", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waits.append(args))
    bench.sync()
    assert waits == [()]
