"""A real Celery worker, started with the documented command, runs a task end to end:
over the filesystem broker in the embedded mode, over Redis when REDIS_URL is set (CI)."""

import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env

CLIENT = """
from config.celery import app
from config.tasks import ping
print(ping.delay().get(timeout=60))
"""


@pytest.fixture
def worker_env(tmp_path):
    # DATABASE_URL is not needed by this task; keep the worker off the test database.
    return subprocess_env(VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, DEBUG=None)


def test_worker_runs_a_task(worker_env):
    worker = subprocess.Popen(
        [PYTHON, "-m", "celery", "-A", "config", "worker", "--pool", "solo", "-l", "WARNING"],
        cwd=ROOT,
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        result = subprocess.run(
            [PYTHON, "-c", CLIENT],
            cwd=ROOT,
            env=worker_env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "pong"
    finally:
        worker.terminate()
        output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output
