"""The deployment files: what every process of a compose deployment must share."""

import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_web_tier_and_the_worker_share_the_files_storage():
    """An upload through the web tier is read by the worker that runs its batch, and the
    worker's output file is downloaded through the web tier: each container had its own
    var/, and a batch could not find its input file."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    var_dir = re.search(r"^ENV VAR_DIR=(\S+)$", dockerfile, re.M).group(1)
    files_dir = f"{var_dir}/files"
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]

    mounts = {
        name: {
            v.split(":")[0]
            for v in services[name].get("volumes", [])
            if v.split(":")[1] == files_dir
        }
        for name in ("web", "worker", "batch-worker")
    }

    assert mounts["web"] and mounts["web"] == mounts["worker"] == mounts["batch-worker"]
    # the image makes the directory, so that a new volume is the platform user's to write
    assert "var/files" in dockerfile and "chown -R llm-platform var" in dockerfile


def test_every_queue_has_a_worker_and_one_worker_has_beat():
    """Batch runs have a queue of their own: a deployment without its worker leaves every
    batch validating."""
    from django.conf import settings

    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    units = {path.name: path.read_text() for path in (DEPLOY / "systemd").glob("*.service")}
    commands = {
        "compose": [str(service.get("command", "")) for service in services.values()],
        "systemd": [line for text in units.values() for line in text.splitlines()
                    if line.startswith("ExecStart=")],
    }  # fmt: skip
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    for where, lines in commands.items():
        workers = [line for line in lines if " worker " in line]
        queues = {
            queue
            for line in workers
            for queue in re.search(r"--queues (\S+)", line).group(1).split(",")
        }
        assert queues == {"celery", *routed}, where
        assert sum("--beat" in line for line in workers) == 1, where
