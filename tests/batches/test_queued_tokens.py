"""A tenant's limit on queued batch tokens: the input tokens of its batches that have not
ended, as OpenAI's enqueued token limit counts them, checked when a batch is created."""

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from batches import services
from batches.models import Batch, File
from tenants import services as tenant_services
from tests.batches.conftest import jsonl, request_line

pytestmark = pytest.mark.django_db

# "say a" and the role: likely 1 + 4 tokens a chat line (serving.budget)
CHAT_LINE_TOKENS = 5


def _upload(tenant, num_lines: int, *, content: str | None = None) -> File:
    lines = [request_line(f"r{n}") for n in range(num_lines)]
    if content is not None:
        for line in lines:
            line["body"]["messages"][0]["content"] = content
    return services.file_create(
        tenant=tenant, upload=SimpleUploadedFile("in.jsonl", jsonl(lines)), purpose="batch"
    )


def _batch(tenant, file: File) -> Batch:
    return services.batch_create(
        tenant=tenant,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def _limit(tenant, *, plan: int | None = None, own: int | None = None) -> None:
    tenant.plan.max_queued_batch_tokens = plan
    tenant.plan.save()
    tenant.max_queued_batch_tokens = own
    tenant.save()


def test_an_input_file_counts_its_likely_input_tokens(tenant, file_storage_dir):
    chat = _upload(tenant, 3, content="x" * 400)
    prompt = services.file_create(
        tenant=tenant,
        upload=SimpleUploadedFile(
            "p.jsonl",
            jsonl(
                [request_line("p", url="/v1/completions", body={"model": "m", "prompt": "y" * 80})]
            ),
        ),
        purpose="batch",
    )
    unparsable = services.file_create(
        tenant=tenant,
        upload=SimpleUploadedFile("u.jsonl", jsonl([request_line("u", body={"x": "z" * 38})])),
        purpose="batch",
    )

    assert chat.num_input_tokens == 3 * (100 + 4)
    assert prompt.num_input_tokens == 20 + 1
    assert (
        unparsable.num_input_tokens
        == len(json.dumps({"x": "z" * 38}, separators=(",", ":"))) // 4 + 1
    )


def test_batches_are_refused_past_the_plans_limit_until_one_ends(tenant, file_storage_dir):
    _limit(tenant, plan=4 * CHAT_LINE_TOKENS)
    first = _batch(tenant, _upload(tenant, 3))
    three_more = _upload(tenant, 3)

    with pytest.raises(services.QueueFull) as caught:
        _batch(tenant, three_more)

    assert caught.value.code == "token_limit_exceeded"
    assert services.queued_batch_tokens(tenant=tenant) == 3 * CHAT_LINE_TOKENS
    assert _batch(tenant, _upload(tenant, 1)).num_input_tokens == CHAT_LINE_TOKENS
    Batch.objects.filter(pk=first.pk).update(status=Batch.Status.COMPLETED)
    assert _batch(tenant, three_more).status == Batch.Status.VALIDATING


def test_a_batch_over_the_limit_alone_is_invalid(tenant, file_storage_dir):
    _limit(tenant, plan=2 * CHAT_LINE_TOKENS)

    with pytest.raises(services.InvalidRequest) as caught:
        _batch(tenant, _upload(tenant, 3))

    assert not isinstance(caught.value, services.QueueFull)
    assert caught.value.code == "token_limit_exceeded" and caught.value.param == "input_file_id"
    assert not Batch.objects.exists()


def test_the_tenants_own_limit_overrides_its_plans(tenant, other_tenant, file_storage_dir):
    _limit(tenant, plan=None, own=CHAT_LINE_TOKENS)

    with pytest.raises(services.InvalidRequest):
        _batch(tenant, _upload(tenant, 2))
    _limit(tenant, plan=CHAT_LINE_TOKENS, own=10 * CHAT_LINE_TOKENS)
    assert _batch(tenant, _upload(tenant, 2)).status == Batch.Status.VALIDATING
    # another tenant's batches are not in this tenant's queue
    assert services.queued_batch_tokens(tenant=other_tenant) == 0


@pytest.mark.django_db(transaction=True)
def test_the_api_answers_a_full_queue_with_a_429(tenant, file_storage_dir, client):
    _, key = tenant_services.api_key_create(tenant=tenant, name="k")
    _limit(tenant, plan=CHAT_LINE_TOKENS)
    queued = _upload(tenant, 1)
    _batch(tenant, queued)

    response = client.post(
        "/v1/batches",
        {
            "input_file_id": queued.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )

    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert error["code"] == "token_limit_exceeded" and error["type"] == "rate_limit_error"
    assert "Enqueued token limit" in error["message"]


def test_a_batch_no_worker_holds_is_cancelled_at_once_and_frees_its_tokens(
    tenant, file_storage_dir, monkeypatch
):
    """With every batch worker busy, a cancelled batch stayed ``cancelling`` until one took
    it up (hours, behind long batches), its tokens still holding the tenant's queue full."""
    monkeypatch.setattr(services, "_queue_run", lambda batch_id: None)  # the workers are busy
    _limit(tenant, plan=3 * CHAT_LINE_TOKENS)
    first = services.batch_cancel(batch=_batch(tenant, _upload(tenant, 3)))
    assert first.status == Batch.Status.CANCELLED and first.cancelled_at is not None
    assert services.queued_batch_tokens(tenant=tenant) == 0
    assert _batch(tenant, _upload(tenant, 3))  # room again
