"""A real Celery worker, started with the documented command, runs tasks end to end: over
the filesystem broker in the embedded mode, over Redis when REDIS_URL is set (CI)."""

import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env

CLIENT = """
import django
django.setup()
from datetime import datetime, timedelta, UTC
from config.tasks import ping
from tenants import services
from tenants.models import UsageRecord, UsageRollup
from tenants.tasks import rollup_usage

print(ping.delay().get(timeout=60))
tenant = services.tenant_create(slug="acme")
key, _ = services.api_key_create(tenant=tenant, name="k")
now = datetime.now(UTC)
services.usage_records_save([
    services.usage_record_build(
        request_id=f"r{n}", tenant=tenant, api_key=key, model="m", source="api", status="ok",
        started_at=now - timedelta(hours=n), finished_at=now, prompt_tokens=10, completion_tokens=n,
    )
    for n in range(3)
])
rollup_usage.delay().get(timeout=60)
hours = UsageRollup.objects.filter(period="hour").count()
print(hours >= 1, sum(r.requests for r in UsageRollup.objects.filter(period="day")))
"""


@pytest.fixture
def worker_env(tmp_path):
    # the worker and the client share a fresh embedded database in tmp_path
    env = subprocess_env(VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, DEBUG=None)
    subprocess.run(
        [PYTHON, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
    )
    return env


def test_worker_runs_tasks(worker_env):
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
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["pong", "True", "3"]
    finally:
        worker.terminate()
        output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output


QUEUE_BATCH_RUN = """
import django
django.setup()
from celery.exceptions import TimeoutError
from batches.tasks import run_batch
from config.tasks import ping
waiting = run_batch.delay("batch_nobody")
print(ping.delay().get(timeout=60))
try:
    waiting.get(timeout=3)
except TimeoutError:
    print("waiting", waiting.id)
"""
BATCH_RUN_RESULT = """
import django, sys
django.setup()
from config.celery import app
print(app.AsyncResult(sys.argv[1]).get(timeout=60))
"""


def _worker(env: dict[str, str], *queue_args: str) -> subprocess.Popen:
    argv = [PYTHON, "-m", "celery", "-A", "config", "worker", "--pool", "solo", "-l", "WARNING"]
    return subprocess.Popen(
        [*argv, *queue_args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _client(env: dict[str, str], script: str, *args: str) -> list[str]:
    result = subprocess.run(
        [PYTHON, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_batch_runs_wait_for_a_batch_worker_not_the_default_one(worker_env):
    """A batch's run holds its worker for as long as the batch lasts: on the default queue,
    two batches took both of `make run`'s worker processes, and health polls, roll-ups and
    model loads waited for hours behind them."""
    default = _worker(worker_env, "--queues", "celery", "--hostname", "celery@%h")
    batches = None
    try:
        pong, waiting, task_id = _client(worker_env, QUEUE_BATCH_RUN)
        assert (pong, waiting) == ("pong", "waiting")  # the default worker left it
        batches = _worker(worker_env, "--queues", "batches", "--hostname", "batches@%h")
        assert _client(worker_env, BATCH_RUN_RESULT, task_id) == ["held"]  # no such batch
    finally:
        for worker in (default, batches):
            if worker is not None:
                worker.terminate()
                worker.communicate(timeout=30)
