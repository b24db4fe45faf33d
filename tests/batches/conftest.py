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


def result_lines(batch) -> dict[str, dict]:
    """An ended batch's lines as its output and error files give them (its lines' rows are
    gone by then), by ``custom_id``, in line order; each with ``"file"``: "output" or
    "error"."""
    from batches.models import Batch, File
    from batches.storage import file_storage

    batch = Batch.objects.get(pk=batch.pk)
    lines = []
    for kind, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
        if file_id is None:
            continue
        with file_storage().open(File.objects.get(pk=file_id).storage_name, "rb") as stream:
            lines += [{**json.loads(line), "file": kind} for line in stream.read().splitlines()]
    lines.sort(key=lambda line: int(line["id"].removeprefix("batch_req_")))  # line order
    return {line["custom_id"]: line for line in lines}
