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
        for name in ("web", "worker")
    }

    assert mounts["web"] and mounts["web"] == mounts["worker"]
    # the image makes the directory, so that a new volume is the platform user's to write
    assert "var/files" in dockerfile and "chown -R llm-platform var" in dockerfile
