"""The Files and Batch API against hostile input, through the ASGI application: a 4xx that
says what is wrong, never a 500, and nothing stored that the database cannot hold (a batch
whose lines could not be stored stayed ``validating`` for good, holding its tenant's queued
tokens)."""

import json

import httpx
import pytest
from django.core.cache import cache

from serving.services import deployment_register
from tenants import services
from tenants.models import Plan

pytestmark = pytest.mark.django_db(transaction=True)

CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.fixture
def key(tmp_path, settings):
    settings.VAR_DIR = tmp_path
    cache.clear()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan)
    deployment_register(name="m", endpoints=[f"ipc://{tmp_path}/nobody.sock"])
    return services.api_key_create(tenant=tenant, name="k")[1]


def _client(key: str) -> httpx.AsyncClient:
    from config.asgi import application

    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=application),
        base_url="http://testserver",
        headers={"Authorization": f"Bearer {key}"},
    )


def _line(custom_id: str = "a", **body: object) -> bytes:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    line = {"custom_id": custom_id, "method": "POST", "url": CREATE["endpoint"], "body": request}
    return json.dumps(line).encode() + b"\n"


async def _upload(client: httpx.AsyncClient, content: bytes) -> httpx.Response:
    return await client.post(
        "/v1/files",
        files={"file": ("in.jsonl", content, "application/jsonl")},
        data={"purpose": "batch"},
    )


# str.isdigit() says yes to all three; int() refuses the first two, and over 4,300 digits
@pytest.mark.parametrize("limit", ["\u00b2", "\u2460", "1" * 5000])
async def test_a_limit_of_unicode_or_too_many_digits_is_a_400(key, limit):
    async with _client(key) as client:
        for path in ("/v1/batches", "/v1/files"):
            response = await client.get(path, params={"limit": limit})
            assert response.status_code == 400 and response.json()["error"]["param"] == "limit"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/file-%00",
        "/v1/files/file-%00/content",
        "/v1/batches/batch_%00",
        "/v1/files?after=%00",
        "/v1/batches?after=%00",
    ],
)
async def test_a_nul_in_an_id_is_a_404_or_400(key, path):
    async with _client(key) as client:
        response = await client.get(path)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["message"]


async def test_a_nul_in_the_purpose_filter_lists_no_file(key):
    """It reached the database, which refused it: a 500."""
    async with _client(key) as client:
        assert (await _upload(client, _line())).status_code == 200
        response = await client.get("/v1/files", params={"purpose": "batch\0"})
    assert response.status_code == 200, response.text
    assert response.json()["data"] == []


async def test_the_purpose_filters_cursor_may_be_a_file_of_another_purpose(key):
    """A page of one purpose may start after any of the tenant's files, as a page of all of
    them does: it was a 400, "not the id of one of your files"."""
    async with _client(key) as client:
        first = (await _upload(client, _line())).json()
        second = (await _upload(client, _line())).json()
        response = await client.get(
            "/v1/files", params={"purpose": "batch_output", "after": first["id"]}
        )
        both = await client.get("/v1/files", params={"purpose": "batch", "after": second["id"]})
    assert response.status_code == 200 and response.json()["data"] == []
    assert [f["id"] for f in both.json()["data"]] == [first["id"]]


async def test_a_nul_in_a_batchs_fields_is_a_4xx(key):
    async with _client(key) as client:
        upload = await _upload(client, _line())
        assert upload.status_code == 200, upload.text
        missing = await client.post("/v1/batches", json={**CREATE, "input_file_id": "file-\0"})
        assert missing.status_code in (400, 404) and missing.json()["error"]["message"]
        body = {**CREATE, "input_file_id": upload.json()["id"], "metadata": {"k": "v\0"}}
        refused = await client.post("/v1/batches", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"


async def test_a_batch_with_a_field_the_api_does_not_know_is_a_400_naming_it(key):
    """It was created, the field ignored, where the generation endpoints refuse one."""
    async with _client(key) as client:
        upload = await _upload(client, _line())
        body = {**CREATE, "input_file_id": upload.json()["id"], "extra": 1}
        refused = await client.post("/v1/batches", json=body)
        listed = await client.get("/v1/batches")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "extra"
    assert listed.json()["data"] == []


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (
            {"files": [("file", (f"{i}.jsonl", _line(), "application/jsonl")) for i in range(101)]},
            "files",
        ),
        (
            {
                "files": {"file": ("in.jsonl", _line(), "application/jsonl")},
                "data": {f"f{i}": "x" for i in range(1_001)},
            },
            "fields",
        ),
    ],
)
async def test_an_upload_of_too_many_parts_is_a_400(key, parts, message):
    """Past Django's limits on a multipart body's files and fields, a 400 saying which (it
    was a 500: Django's SuspiciousOperation reached the API's catch-all)."""
    async with _client(key) as client:
        response = await client.post(
            "/v1/files", data={"purpose": "batch", **parts.get("data", {})}, files=parts["files"]
        )
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
        assert (await _upload(client, _line())).status_code == 200


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


async def test_a_batchs_metadata_nested_past_the_cap_is_a_400(key):
    """Its metadata is not typed below its top level: the decoder reads it by recursion, and
    ran out of stack (a 500) where the API's cap did not stop it first."""
    async with _client(key) as client:
        upload = await _upload(client, _line())
        input_file_id = upload.json()["id"]
        for depth in (101, 3_000):
            body = json.dumps({**CREATE, "input_file_id": input_file_id, "metadata": "RAW"})
            raw = body.replace('"RAW"', _nested(depth).decode()).encode()
            response = await client.post(
                "/v1/batches", content=raw, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 400, response.text
            assert "100 levels" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        # past the cap a line is refused as it is uploaded, wherever it nests: where Python's
        # stack ran out depended on the caller's own depth, and a line the upload took crashed
        # the runner, deeper in its stack, on every pass
        (
            _line()
            .replace(b'"hi"', json.dumps({"x": "RAW"}).encode())
            .replace(b'"RAW"', _nested(101)),
            "more than 100 levels deep",
        ),
        (_line().replace(b'"hi"', _nested(977)), "more than 100 levels deep"),
        (_line(custom_id="x" * 513), "at most 512 characters"),
        (_line(custom_id="a\0b"), "NUL"),
        (_line(messages=[{"role": "user", "content": "a\0b"}]), "NUL"),
        (b'{"custom_id": "a", "method": "POST", "body": {"content": "caf\xe9"}}\n', "UTF-8"),
    ],
)
async def test_an_upload_with_a_line_that_cannot_be_stored_is_a_400_naming_it(key, content, reason):
    async with _client(key) as client:
        response = await _upload(client, _line("first") + content)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "Line 2" in message and reason in message


async def test_a_file_whose_bytes_are_gone_is_a_404_not_a_broken_200(key):
    """Content asked for as the file is deleted (its bytes go when the deletion commits), or
    lost from storage: the response said 200 and its length, then the stream raised."""
    from asgiref.sync import sync_to_async

    from batches.models import File
    from batches.storage import file_storage

    async with _client(key) as client:
        created = (await _upload(client, _line())).json()
        file = await File.objects.aget(id=created["id"])
        await sync_to_async(file_storage().delete)(file.storage_name)
        response = await client.get(f"/v1/files/{created['id']}/content")
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "not_found"


async def test_an_upload_past_the_tenants_file_storage_is_a_400_not_a_retried_429(key):
    """The SDK retries a 429 by itself: waiting frees no storage."""
    from asgiref.sync import sync_to_async

    line = _line()
    await sync_to_async(Plan.objects.filter(slug="open").update)(
        max_file_storage_bytes=len(line) + 1
    )
    async with _client(key) as client:
        assert (await _upload(client, line)).status_code == 200
        refused = await _upload(client, line)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("storage_limit_exceeded", "file")
