"""A live platform for gateway tests: an engine subprocess on a tiny model and a Daphne
subprocess sharing the test database (and Redis, when REDIS_URL is set)."""

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 256


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def database_url() -> str:
    from django.db import connection

    settings = connection.settings_dict
    if settings["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{settings['NAME']}"
    return (
        f"postgres://{settings['USER']}:{settings['PASSWORD']}@{settings['HOST']}:"
        f"{settings['PORT']}/{settings['NAME']}"
    )


class Engine:
    def __init__(self, model_dir: str, endpoint: str, log: Path) -> None:
        self.model_dir, self.endpoint, self.log = model_dir, endpoint, log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "inference_engine",
                "--model",
                self.model_dir,
                "--endpoint",
                self.endpoint,
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                "float32",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--num-kv-blocks",
                "256",
            ],
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120):
        """The engine's STATS once it reports ready."""
        import asyncio

        from inference_engine.client import AsyncEngineClient

        async def wait():
            client = AsyncEngineClient(self.endpoint)
            try:
                return await client.wait_ready(timeout=timeout)
            finally:
                client.close()

        return asyncio.run(wait())

    def stop(self, sig: int = 15) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.inference_engine.conftest import save_model

    return save_model(tmp_path_factory.mktemp("gateway-model") / "llama", "llama")


@pytest.fixture(scope="session")
def engine(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine")
    engine = Engine(tiny_model_dir, f"ipc://{folder}/engine.sock", folder / "engine.log")
    engine.start()
    yield engine
    engine.stop()


class Daphne:
    """A Daphne subprocess serving the platform on the test database."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.base = f"http://127.0.0.1:{free_port()}"
        env = subprocess_env(
            DATABASE_URL=database_url(),
            SECRET_KEY="live-server-test-secret-key-0123456789-abcdefghijklmnopqrstuvwxyz",
            DEBUG="1",
            VAR_DIR=str(folder),
            DJANGO_SETTINGS_MODULE="tests.live_server_settings",
            # Without a shared cache, the tests' changes cannot reach the server's cached
            # authorizations (gateway.authorization): have it read them every time.
            **({} if os.environ.get("REDIS_URL") else {"GATEWAY_AUTH_CACHE_SECONDS": "0"}),
        )
        port = self.base.rsplit(":", 1)[1]
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "config.webserver",
                "-b",
                "127.0.0.1",
                "-p",
                port,
                "config.asgi:application",
            ],
            cwd=ROOT,
            env=env,
            stdout=(folder / "daphne.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: _answers(f"{self.base}/health/live"), 60, "Daphne")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if os.environ.get("SHOW_LIVE_LOGS"):
            print((self.folder / "daphne.log").read_text())


@pytest.fixture(scope="session")
def daphne_server(django_db_setup, django_db_blocker, engine, tmp_path_factory):
    """Base URL of a live Daphne on the test database, with the engine running."""
    server = Daphne(tmp_path_factory.mktemp("daphne"))
    yield server.base
    server.stop()


class Platform:
    """A live Daphne and engine, and one tenant with a key on an open plan."""

    def __init__(self, base: str, engine, key: str, tenant) -> None:
        self.base, self.engine, self.key, self.tenant = base, engine, key, tenant

    def client(self, key: str | None = None, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or self.key, **kwargs)

    def async_client(self, key: str | None = None):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key or self.key)

    def records(self) -> list:
        from tenants.models import UsageRecord

        return list(UsageRecord.objects.filter(tenant=self.tenant).order_by("started_at"))


def wait_for_quiet_database(quiet_for: float = 0.3, timeout: float = 15.0) -> None:
    """Wait until no other client of the test database has been in a transaction for
    ``quiet_for`` seconds. The live server settles a request (its usage record) just after the
    client has read the last byte; the flush that ends a transactional test, racing that
    write, can deadlock with it on PostgreSQL, and the next test then finds the last one's
    rows."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    deadline = time.monotonic() + timeout
    quiet_since = None
    while (now := time.monotonic()) < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND state IS NOT NULL AND state <> 'idle'"
            )
            [(busy,)] = cursor.fetchall()
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_for:
            return
        time.sleep(0.02)


@pytest.fixture
def platform(daphne_server, engine):
    from serving.services import deployment_register
    from tenants import services
    from tenants.models import Plan

    engine.wait_ready()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan)
    _, key = services.api_key_create(tenant=tenant, name="sdk")
    deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
    yield Platform(daphne_server, engine, key, tenant)
    wait_for_quiet_database()
