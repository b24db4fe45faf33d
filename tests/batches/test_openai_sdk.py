"""The Files and Batch APIs end to end with the official openai SDK against a live Daphne."""

import httpx
import openai
import pytest

from tenants import services
from tests.batches.conftest import jsonl, request_line

pytestmark = pytest.mark.django_db(transaction=True)


def _upload(client: openai.OpenAI, lines: list[dict], name: str = "requests.jsonl"):
    return client.files.create(file=(name, jsonl(lines), "application/jsonl"), purpose="batch")


def test_a_file_is_uploaded_listed_read_and_deleted(platform):
    client = platform.client()
    lines = [request_line(f"req-{n}") for n in range(50)]

    created = _upload(client, lines)

    assert created.id.startswith("file-") and created.object == "file"
    assert (created.purpose, created.filename, created.bytes) == (
        "batch",
        "requests.jsonl",
        len(jsonl(lines)),
    )
    assert client.files.retrieve(created.id) == created
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.content(created.id).content == jsonl(lines)
    deleted = client.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_a_file_with_a_bad_line_is_refused_naming_the_line(platform):
    client = platform.client()
    lines = [request_line("a"), request_line("b"), request_line("c", url="/v1/embeddings")]

    with pytest.raises(openai.BadRequestError) as caught:
        _upload(client, lines)

    error = caught.value.body
    assert "Line 3" in error["message"] and error["param"] == "file"
    assert error["type"] == "invalid_request_error"
    assert client.files.list().data == []


def test_a_batch_is_created_listed_retrieved_and_cancelled(platform):
    client = platform.client()
    file = _upload(client, [request_line("a"), request_line("b")])

    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )

    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.input_file_id == file.id and batch.metadata == {"job": "nightly"}
    assert batch.request_counts.total == 2
    assert batch.expires_at - batch.created_at == 24 * 3600
    assert client.batches.retrieve(batch.id).id == batch.id
    cancelled = client.batches.cancel(batch.id)  # no worker had taken it: ended at once
    assert cancelled.status == "cancelled" and cancelled.cancelling_at is not None
    assert cancelled.cancelled_at is not None


def test_batches_are_listed_newest_first_by_cursor(platform):
    client = platform.client()
    file = _upload(client, [request_line("a")])
    ids = [
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]

    first = client.batches.list(limit=2)
    second = client.batches.list(limit=2, after=first.data[-1].id)

    assert [b.id for b in first.data] + [b.id for b in second.data] == ids[::-1]
    assert first.has_more and not second.has_more
    assert [b.id for b in client.batches.list(limit=1)] == ids[::-1]  # the SDK follows pages


def test_a_batch_for_an_unknown_endpoint_is_refused(platform):
    client = platform.client()
    file = _upload(client, [request_line("a")])

    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )

    assert caught.value.body["param"] == "endpoint"


def test_another_tenants_key_gets_404_for_every_id(platform):
    owner = platform.client()
    file = _upload(owner, [request_line("a")])
    batch = owner.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = services.tenant_create(slug="globex", plan=platform.tenant.plan)
    _, other_key = services.api_key_create(tenant=other, name="other")
    stranger = platform.client(key=other_key)

    for call in (
        lambda: stranger.files.retrieve(file.id),
        lambda: stranger.files.content(file.id),
        lambda: stranger.files.delete(file.id),
        lambda: stranger.batches.retrieve(batch.id),
        lambda: stranger.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert stranger.files.list().data == [] and stranger.batches.list().data == []
    with pytest.raises(openai.BadRequestError):
        stranger.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert owner.files.retrieve(file.id).id == file.id


def test_a_broken_multipart_body_is_a_400(platform):
    response = httpx.post(
        f"{platform.base}/v1/files",
        content=b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\nno end",
        headers={
            "Authorization": f"Bearer {platform.key}",
            "Content-Type": "multipart/form-data; boundary=",
        },
    )

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "file"


def test_files_need_a_key(platform):
    response = httpx.get(f"{platform.base}/v1/files")

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


def test_an_upload_past_the_api_body_limit_reaches_the_view(platform):
    """The web server's body limit (8 MB) does not apply to POST /v1/files, whose files may
    be 100 MB; it still applies to every other path."""
    padding = "x" * 1000
    lines = [request_line(f"r{n}", body={"model": "m", "prompt": padding}) for n in range(9000)]
    raw = jsonl([{**line, "url": "/v1/completions"} for line in lines])
    assert len(raw) > 8 * 1024 * 1024

    created = _upload(platform.client(), [{**line, "url": "/v1/completions"} for line in lines])
    refused = httpx.post(
        f"{platform.base}/v1/chat/completions",
        content=raw,
        headers={"Authorization": f"Bearer {platform.key}"},
    )

    assert created.bytes == len(raw)
    assert refused.status_code == 413


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, "missing_api_key"), ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key")],
)
def test_an_upload_past_the_api_body_limit_without_a_good_key_is_a_401(platform, headers, code):
    """Only a client the API would serve may send more than the API's limit: anyone else's
    upload is answered as the API answers its key, and the server serves on."""
    raw = b"x" * (9 * 1024 * 1024)
    files = {"file": ("input.jsonl", raw, "application/jsonl")}

    refused = httpx.post(
        f"{platform.base}/v1/files", files=files, data={"purpose": "batch"}, headers=headers
    )

    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == code
    assert refused.headers["x-request-id"].startswith("req_")
    assert refused.headers["connection"] == "close"  # the web server's answer, not the view's
    assert platform.client().files.list().data is not None
