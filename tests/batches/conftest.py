"""The live platform of the gateway tests, and input files for batches."""

import json

import pytest

from tests.gateway.conftest import (  # noqa: F401 - fixtures
    MODEL_NAME,
    daphne_server,
    engine,
    platform,
    tiny_model_dir,
)


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
