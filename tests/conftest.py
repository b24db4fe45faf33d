"""Fixtures shared across the suite. Engine fixtures live in tests/inference_engine/."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def fast_password_hashing():
    """Passwords hashed with MD5, as Django's testing docs advise: the default PBKDF2 (a million
    iterations) takes half a second a password here, and fixtures make five users a test. The
    Daphne the tests start on their database does the same (``tests.live_server_settings``);
    platforms they start whole (``make run`` and the like) keep the real hashers."""
    try:
        from django.test import override_settings
    except ImportError:  # the engine's tests also run where Django is not installed
        yield
        return
    from tests.live_server_settings import TEST_PASSWORD_HASHERS

    with override_settings(PASSWORD_HASHERS=TEST_PASSWORD_HASHERS):
        yield


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each test gets channel layers of its own. Each async test runs on a loop of its own,
    and channels_redis ties its receiving to the loop that started it: a chat socket a test
    left open (its relay receiving, ``chat.relay``) made every receive of every later test
    fail with "Two event loops are trying to receive() on one channel layer at once!".
    Where no test has imported Channels (or it is not installed, as for the engine's tests on
    the GPU machine), no layer exists to clear."""
    layers = sys.modules.get("channels.layers")
    if layers is not None:
        layers.channel_layers.backends.clear()
    yield


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user("alice", password="correct horse battery")


def staff_user(username: str, *permissions: str, password: str = "pw-staff-123"):
    """A staff user holding ``permissions`` ("app_label.codename") and no others."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    user = get_user_model().objects.create_user(username, password=password, is_staff=True)
    for permission in permissions:
        app_label, codename = permission.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user


@pytest.fixture
def tenant(db):
    from tenants import services

    return services.tenant_create(slug="acme", name="Acme")


@pytest.fixture
def other_tenant(db):
    from tenants import services

    return services.tenant_create(slug="globex", name="Globex")


def subprocess_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a child process of the project: paths set, overrides applied
    (None removes a variable). The project's paths go before the ``PYTHONPATH`` inherited,
    which stays: the GPU machine's packages are installed into a folder it names."""
    env = dict(os.environ)
    inherited = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    paths = dict.fromkeys([str(ROOT / "platform"), str(ROOT), *inherited])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


PYTHON = sys.executable


# threads of each async test's default executor (config.workers runs the database work there)
TEST_EXECUTOR_THREADS = 8


@pytest.fixture
async def async_db(transactional_db):
    """Database access from async tests. ORM calls made through ``sync_to_async`` run on
    asgiref's executor thread, which keeps its own connection: close it afterwards, or the
    test database cannot be dropped at the end of the run.

    The same goes for the threads of the loop's default executor, where ``config.workers``
    runs the API's and the chat's database work: Channels' test communicator turns off the
    connection clean-up around each call, so each thread keeps the connection it took from
    PostgreSQL's pool, and every test's loop left one or more lent for good (20 such tests
    and the pool was empty: the next request waited 30 s and failed). Each thread closes its
    own at the end; a barrier makes each close run on a thread of its own."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from asgiref.sync import sync_to_async
    from django.db import connections

    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(TEST_EXECUTOR_THREADS, thread_name_prefix="test-worker")
    loop.set_default_executor(executor)
    yield
    await sync_to_async(connections.close_all)()
    barrier = threading.Barrier(TEST_EXECUTOR_THREADS)

    def close_this_threads_connections() -> None:
        try:
            connections.close_all()
        finally:  # a failed close must not leave the others waiting for it
            barrier.wait(timeout=60)

    await asyncio.gather(
        *(
            loop.run_in_executor(executor, close_this_threads_connections)
            for _ in range(TEST_EXECUTOR_THREADS)
        )
    )
