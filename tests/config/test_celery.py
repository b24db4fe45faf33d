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
