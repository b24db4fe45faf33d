"""The live platform of the gateway tests, and input files for batches."""

import json

import pytest

from tests.gateway.conftest import (  # noqa: F401 - fixtures
    MODEL_NAME,
    Daphne,
    engine,
    platform,
    tiny_model_dir,
)


@pytest.fixture(scope="session")
def batches_daphne(django_db_setup, django_db_blocker, engine, tmp_path_factory):  # noqa: F811
    """The gateway tests' live Daphne, kept whole: a runner in the test process reads and
    writes files where it does."""
    server = Daphne(tmp_path_factory.mktemp("daphne"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def daphne_server(batches_daphne) -> str:
    return batches_daphne.base


@pytest.fixture
def shared_files(settings, batches_daphne):
    """This process's files storage is the live Daphne's."""
    settings.VAR_DIR = batches_daphne.folder


def request_line(custom_id: str, **overrides: object) -> dict:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"say {custom_id}"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    }
    line.update(overrides)
    return line


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture
def file_storage_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    return tmp_path / "files"
