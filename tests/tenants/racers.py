"""Helpers for the quota tests: a tenant with only the limits a test sets, and processes that
race for admission together (each with its own threads, all released by one barrier file)."""

import subprocess
from pathlib import Path

from tenants import services
from tenants.models import Plan, Tenant
from tests.conftest import PYTHON, ROOT, subprocess_env

RACER = """
import os, sys, threading, time, django
django.setup()
from tenants import quotas
from tenants.models import Tenant
tenant = Tenant.objects.select_related("plan").get(pk=int(sys.argv[1]))
barrier_file, num_threads = sys.argv[2], int(sys.argv[3])
admitted = []
def attempt():
    try:
        admitted.append(quotas.admission_acquire(tenant=tenant, estimated_tokens=1))
    except quotas.QuotaExceeded:
        pass
threads = [threading.Thread(target=attempt) for _ in range(num_threads)]
while not os.path.exists(barrier_file):
    time.sleep(0.01)
for t in threads: t.start()
for t in threads: t.join()
print(len(admitted))
"""


def tenant_with(**limits) -> Tenant:
    """A tenant on a plan without limits, with only ``limits`` set."""
    plan = Plan.objects.create(slug="unlimited", name="Unlimited")
    return services.tenant_create(slug="acme", plan=plan, **limits)


def subprocess_database_url() -> str:
    from django.db import connection

    settings = connection.settings_dict
    return (
        f"postgres://{settings['USER']}:{settings['PASSWORD']}@{settings['HOST']}:"
        f"{settings['PORT']}/{settings['NAME']}"
    )


def race_processes(
    tenant: Tenant, folder: Path, *, num_processes: int, num_threads: int
) -> list[int]:
    """How many requests each of ``num_processes`` racers admitted (they exit holding them)."""
    barrier = folder / "go"
    racers = [
        subprocess.Popen(
            [PYTHON, "-c", RACER, str(tenant.pk), str(barrier), str(num_threads)],
            cwd=ROOT,
            env=subprocess_env(DATABASE_URL=subprocess_database_url()),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(num_processes)
    ]
    barrier.touch()
    return [int(racer.communicate(timeout=120)[0].strip()) for racer in racers]
