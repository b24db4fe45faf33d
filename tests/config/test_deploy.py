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


def test_a_worker_reserves_no_more_than_one_task_beyond_those_it_runs():
    """With Celery's default (four a process), a busy batch worker held queued runs that
    another host's idle worker could have started, for the sweep's ten minutes."""
    from config import celery_app

    assert celery_app.conf.worker_prefetch_multiplier == 1


def _seconds(value: str) -> float:
    return float(value.rstrip("s"))


def test_the_engine_ends_its_own_streams_before_it_is_killed():
    """The engine's grace period (30 s) was the time systemd and compose gave it before
    SIGKILL: it was killed as its drain ended, never failing its streams itself."""
    from inference_engine.config import ServerConfig

    default_grace = ServerConfig.__dataclass_fields__["shutdown_grace_period"].default
    unit = (DEPLOY / "systemd" / "llm-platform-engine.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    flag = re.search(r"--shutdown-grace-period[ =](\S+)", exec_start)
    grace = float(flag.group(1)) if flag else default_grace
    timeout = _seconds(re.search(r"^TimeoutStopSec=(\S+)$", unit, re.M).group(1))
    assert grace + 10 <= timeout, f"systemd: grace {grace} s, SIGKILL at {timeout} s"

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    engine = compose["services"]["engine"]
    stop = _seconds(engine.get("stop_grace_period", compose["x-platform"]["stop_grace_period"]))
    flag = re.search(r"--shutdown-grace-period[ =](\S+)", engine["command"])
    grace = float(flag.group(1)) if flag else default_grace
    assert grace + 10 <= stop, f"compose: grace {grace} s, SIGKILL at {stop} s"


def test_the_beat_schedule_outlives_a_recreated_worker_container():
    """Beat's record of when each task last ran lay in the worker container's own layer: a
    recreated worker waited a whole day again before each daily task (a purge never ran on
    a stack redeployed daily)."""
    worker = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["worker"]
    schedule_file = worker["environment"]["CELERY_BEAT_SCHEDULE_FILENAME"]
    mounts = [volume.split(":")[1] for volume in worker.get("volumes", [])]

    assert any(schedule_file.startswith(mount.rstrip("/") + "/") for mount in mounts), mounts
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    folder = schedule_file.rsplit("/", 1)[0].removeprefix("/srv/llm-platform/")
    assert folder in dockerfile  # made by the image, so a new volume is the platform user's


def test_under_compose_the_web_port_is_the_proxys_and_its_forwarded_client_is_trusted():
    """The web container is reached by the host's TLS proxy from the Docker bridge: with
    FORWARDED_ALLOW_IPS left to loopback, every client was the proxy's address, so 50 failed
    sign-ins by anybody refused everybody's for 15 minutes. And the plain-HTTP port was
    published on every interface, past the proxy."""
    import ipaddress

    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert all(port.startswith("127.0.0.1:") for port in services["web"]["ports"])
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "llm-platform.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    trusted = [ipaddress.ip_network(n, strict=False) for n in env["FORWARDED_ALLOW_IPS"].split(",")]
    for bridge_gateway in ("172.17.0.1", "172.18.0.1", "127.0.0.1"):
        assert any(ipaddress.ip_address(bridge_gateway) in network for network in trusted)


def test_every_engine_listening_beyond_loopback_and_its_clients_share_a_token():
    """The engine bound tcp://0.0.0.0:5555 in plain: anybody reaching the port generated
    unmetered or unloaded the model. Each deployment's engine now reads ENGINE_TOKEN, from
    the environment file its web tier and workers read too."""
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    platform = [name for name, s in services.items() if "llm-platform.env" in s.get("env_file", "")]
    assert {"engine", "web", "worker", "batch-worker"} <= set(platform)
    example = (DEPLOY / "llm-platform.env.example").read_text()
    assert re.search(r"^ENGINE_TOKEN=replace-with-", example, re.M)  # refused until set
    units = {path.name: path.read_text() for path in (DEPLOY / "systemd").glob("*.service")}
    for name, text in units.items():
        # the engine's file holds its token alone: a GPU host needs none of the web's secrets
        wanted = "engine.env" if name == "llm-platform-engine.service" else "env"
        assert f"EnvironmentFile=/etc/llm-platform/{wanted}\n" in text, name
