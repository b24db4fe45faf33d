"""A batch's lines are authorized as the online API would authorize them when each starts: a
revoked, expired or deleted key, or a deactivated tenant, stops what has not started (a leaked
key's batches no longer run, nor are metered, once the key is revoked)."""

from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches import services as batch_services
from batches.models import Batch, BatchRequest
from batches.tasks import run_batch
from gateway.auth import api_key_for
from gateway.errors import ApiError
from serving.services import deployment_register
from tenants import services
from tenants.models import ApiKey, Plan, UsageRecord
from tests.batches.conftest import MODEL_NAME, jsonl, request_line, result_lines

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def world(engine, file_storage_dir, monkeypatch):  # noqa: F811 - fixtures of tests.batches
    monkeypatch.setattr(batch_services, "_queue_run", lambda batch_id: None)  # run it by hand
    engine.wait_ready()
    plan = Plan.objects.create(slug="open", name="Open")
    tenant = services.tenant_create(slug="acme", plan=plan)
    key, raw = services.api_key_create(tenant=tenant, name="leaked")
    deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
    return tenant, key, raw


def _batch(tenant, key, num_lines: int = 3) -> Batch:
    lines = [request_line(f"r{i}") for i in range(num_lines)]
    upload = SimpleUploadedFile("r.jsonl", jsonl(lines))
    file = batch_services.file_create(tenant=tenant, upload=upload, purpose="batch")
    return batch_services.batch_create(
        tenant=tenant,
        api_key=key,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def _lines(batch: Batch) -> list[tuple[str, int | None, str | None]]:
    """Each line's status, HTTP status and error code, in line order, from its results."""
    statuses = {"output": BatchRequest.Status.COMPLETED, "error": BatchRequest.Status.FAILED}
    return [
        (
            statuses[line["file"]],
            (line["response"] or {}).get("status_code"),
            ((line["response"] or {}).get("body") or {}).get("error", {}).get("code"),
        )
        for line in result_lines(batch).values()
    ]


def _batch_records(tenant) -> int:
    return UsageRecord.objects.filter(tenant=tenant, source=UsageRecord.Source.BATCH).count()


def _kill(how: str, tenant, key) -> None:
    if how == "revoked":
        services.api_key_revoke(api_key=key)
    elif how == "expired":
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(days=1))
    elif how == "deleted":
        key.delete()
    else:
        tenant.is_active = False
        tenant.save()


@pytest.mark.parametrize(
    ("how", "status", "code"),
    [
        ("revoked", 401, "invalid_api_key"),
        ("expired", 401, "invalid_api_key"),
        ("deleted", 401, "invalid_api_key"),
        ("tenant_inactive", 403, "tenant_inactive"),
    ],
)
def test_a_batch_whose_key_or_tenant_died_before_it_ran_runs_nothing(world, how, status, code):
    tenant, key, raw = world
    batch = _batch(tenant, key)
    _kill(how, tenant, key)
    with pytest.raises(ApiError) as online:  # what the online API answers that key now
        api_key_for(raw)
    assert (online.value.status, online.value.code) == (status, code)

    run_batch(batch.id)

    assert _lines(batch) == [(BatchRequest.Status.FAILED, status, code)] * 3
    assert _batch_records(tenant) == 0  # nothing reached the engine


def test_a_key_revoked_while_its_batch_runs_stops_the_lines_not_yet_started(
    world, settings, monkeypatch
):
    settings.BATCH_MAX_IN_FLIGHT = 1  # one line at a time: the revocation falls between two
    tenant, key, _ = world
    batch = _batch(tenant, key, num_lines=4)
    finish = batch_services.batch_request_finish

    def finish_then_revoke(**kwargs) -> None:
        finish(**kwargs)
        if kwargs["request"].line_number == 1:
            services.api_key_revoke(api_key=ApiKey.objects.get(pk=key.pk))

    monkeypatch.setattr(batch_services, "batch_request_finish", finish_then_revoke)
    run_batch(batch.id)

    lines = _lines(batch)
    assert lines[0] == (BatchRequest.Status.COMPLETED, 200, None)
    assert lines[1:] == [(BatchRequest.Status.FAILED, 401, "invalid_api_key")] * 3
    assert _batch_records(tenant) == 1
