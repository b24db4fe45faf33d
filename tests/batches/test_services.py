"""Files and batches through their services and selectors, on the real database and a
temporary files folder."""

import json
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches import selectors, services
from batches.models import Batch, BatchRequest, File
from tests.batches.conftest import jsonl, request_line

pytestmark = pytest.mark.django_db


def _upload(tenant, lines: list[dict], name: str = "input.jsonl") -> File:
    return services.file_create(
        tenant=tenant, upload=SimpleUploadedFile(name, jsonl(lines)), purpose="batch"
    )


def _batch(tenant, file: File, endpoint: str = "/v1/chat/completions") -> Batch:
    return services.batch_create(
        tenant=tenant, input_file_id=file.id, endpoint=endpoint, completion_window="24h"
    )


def test_an_upload_is_stored_under_its_id_not_its_name(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a"), request_line("b")], name="../../evil.jsonl")

    assert file.id.startswith("file-") and file.num_lines == 2
    stored = file_storage_dir / str(tenant.pk) / f"{file.id}.jsonl"
    assert stored.read_bytes() == jsonl([request_line("a"), request_line("b")])
    assert file.bytes == stored.stat().st_size and file.filename == "evil.jsonl"
    assert stored.stat().st_mode & 0o077 == 0


def test_a_bad_line_stores_nothing(tenant, file_storage_dir):
    with pytest.raises(services.InvalidRequest) as caught:
        _upload(tenant, [request_line("a"), request_line("b", method="PUT")])

    assert "Line 2" in caught.value.message and caught.value.param == "file"
    assert not File.objects.exists()
    assert not list(file_storage_dir.rglob("*.jsonl"))


def test_a_file_over_the_limit_is_refused(tenant, file_storage_dir, settings):
    settings.FILES_MAX_BYTES = 100

    with pytest.raises(services.FileTooLarge):
        _upload(tenant, [request_line("a"), request_line("b")])


def test_only_batch_files_are_taken(tenant, file_storage_dir):
    with pytest.raises(services.InvalidRequest) as caught:
        services.file_create(
            tenant=tenant,
            upload=SimpleUploadedFile("x.jsonl", jsonl([request_line("a")])),
            purpose="fine-tune",
        )
    assert caught.value.param == "purpose"


def test_deleting_a_file_removes_its_bytes(
    tenant, file_storage_dir, django_capture_on_commit_callbacks
):
    file = _upload(tenant, [request_line("a")])

    with django_capture_on_commit_callbacks(execute=True):
        services.file_delete(file=file)

    assert not File.objects.exists() and not list(file_storage_dir.rglob("*.jsonl"))


def test_deleting_a_tenant_removes_its_files_bytes(
    tenant, other_tenant, file_storage_dir, django_capture_on_commit_callbacks
):
    """The admin deletes a tenant with its files (a cascade): only ``file_delete`` removed a
    file's bytes, so the tenant's prompts and answers stayed on disk with no row to reach
    them. Another tenant's stay."""
    _upload(tenant, [request_line("a")])
    _upload(tenant, [request_line("b")])
    kept = _upload(other_tenant, [request_line("c")])

    with django_capture_on_commit_callbacks(execute=True):
        tenant.delete()

    assert [path.name for path in file_storage_dir.rglob("*.jsonl")] == [f"{kept.id}.jsonl"]


def test_a_deletion_rolled_back_keeps_the_files_bytes(tenant, file_storage_dir):
    from django.db import transaction

    file = _upload(tenant, [request_line("a")])
    file_id = file.id
    with pytest.raises(RuntimeError), transaction.atomic():
        services.file_delete(file=file)
        raise RuntimeError("the deleting transaction fails")

    assert File.objects.filter(pk=file_id).exists()
    assert len(list(file_storage_dir.rglob("*.jsonl"))) == 1


def test_bytes_whose_file_row_was_rolled_back_are_purged_once_old(
    tenant, other_tenant, file_storage_dir
):
    """A worker killed inside ``batch_finish`` (its result files' rows rolled back with the
    batch's end) left their bytes in storage for good, as does any transaction that fails
    after a file is stored. Bytes with no row are purged once older than any upload or
    result write in progress; files with rows, and recent bytes, stay."""
    import os
    import time
    from datetime import timedelta

    from django.db import transaction

    from batches import tasks

    kept = _upload(tenant, [request_line("a")])
    with pytest.raises(RuntimeError), transaction.atomic():
        services.file_create_generated(
            tenant=other_tenant, purpose="batch_output", filename="x_output.jsonl", content=b"{}\n"
        )
        raise RuntimeError("the worker dies before the batch's end commits")
    stray = [p for p in file_storage_dir.rglob("*.jsonl") if p.name != f"{kept.id}.jsonl"]
    assert len(stray) == 1  # what the rolled-back write left
    recent = stray[0].with_name("file-recent.jsonl")
    recent.write_bytes(b"{}\n")  # an upload stored, its row not yet committed
    hour_ago = time.time() - 3600 - 60
    for path in (stray[0], file_storage_dir / kept.storage_name):
        os.utime(path, (hour_ago, hour_ago))

    assert services.files_orphaned_purge(older_than=timedelta(hours=1)) == 1
    assert sorted(p.name for p in file_storage_dir.rglob("*.jsonl")) == sorted(
        [f"{kept.id}.jsonl", "file-recent.jsonl"]
    )
    assert tasks.purge_orphaned_files() == 0  # the daily task: nothing more to purge


def test_another_tenants_ids_do_not_exist(tenant, other_tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a")])
    batch = _batch(tenant, file)

    with pytest.raises(File.DoesNotExist):
        selectors.file_get(tenant_id=other_tenant.pk, file_id=file.id)
    with pytest.raises(Batch.DoesNotExist):
        selectors.batch_get(tenant_id=other_tenant.pk, batch_id=batch.id)
    with pytest.raises(services.InvalidRequest):
        _batch(other_tenant, file)
    assert selectors.files_list(
        tenant_id=other_tenant.pk, purpose=None, after=None, limit=10, newest_first=True
    ) == ([], False)


def test_a_new_batch_waits_to_be_validated(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a"), request_line("b")])

    batch = _batch(tenant, file)

    assert batch.id.startswith("batch_") and batch.status == Batch.Status.VALIDATING
    assert batch.num_total == 2 and batch.input_file_id == file.id
    assert batch.expires_at - batch.created_at == timezone.timedelta(hours=24)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endpoint", "/v1/embeddings"),
        ("completion_window", "1h"),
        ("metadata", {"k": 1}),
        ("metadata", {str(n): "v" for n in range(17)}),
        ("input_file_id", "file-missing"),
        ("completion_window", ["24h"]),  # unhashable: it was a 500
        ("completion_window", {"24h": 1}),
        ("endpoint", ["/v1/chat/completions"]),
    ],
)
def test_a_batch_request_with_a_bad_field_names_it(tenant, file_storage_dir, field, value):
    file = _upload(tenant, [request_line("a")])
    fields = {
        "input_file_id": file.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": None,
    } | {field: value}

    with pytest.raises(services.InvalidRequest) as caught:
        services.batch_create(tenant=tenant, **fields)

    assert caught.value.param == field


def test_validation_makes_one_pending_request_per_line_once(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a"), request_line("b")])
    batch = _batch(tenant, file)

    batch = services.batch_validate(batch=batch)
    again = services.batch_validate(batch=batch)

    assert batch.status == again.status == Batch.Status.IN_PROGRESS
    assert batch.in_progress_at is not None
    rows = BatchRequest.objects.filter(batch=batch).order_by("line_number")
    assert [(r.custom_id, r.status, r.tenant_id) for r in rows] == [
        ("a", "pending", tenant.pk),
        ("b", "pending", tenant.pk),
    ]


def test_a_lines_body_is_kept_as_it_was_sent_key_order_and_all(tenant, file_storage_dir):
    """PostgreSQL's jsonb sorts an object's keys: the engine got another JSON schema (its
    properties in another order) than the online API gives it for the same body, and a guided
    answer came back with its keys in that other order."""
    schema = {"type": "object", "properties": {"zeta_long_name": {}, "a": {}}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    batch = services.batch_validate(
        batch=_batch(tenant, _upload(tenant, [request_line("a", body=body)]))
    )
    [stored] = BatchRequest.objects.filter(batch=batch)
    assert stored.body_bytes() == json.dumps(body, separators=(",", ":")).encode()


def test_a_line_for_another_endpoint_fails_the_batch(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a"), request_line("b", url="/v1/completions")])

    batch = services.batch_validate(batch=_batch(tenant, file))

    assert batch.status == Batch.Status.FAILED and batch.failed_at is not None
    assert batch.errors[0]["code"] == "mismatched_endpoint" and batch.errors[0]["line"] == 2
    assert not BatchRequest.objects.exists()


def test_a_file_calling_two_models_fails_the_batch_as_openai_does(tenant, file_storage_dir):
    """OpenAI: each input file may hold requests to one model only."""
    other_model = request_line("c")
    other_model["body"]["model"] = "another-model"
    no_model = request_line("b")
    del no_model["body"]["model"]  # its own answer names the missing field
    file = _upload(tenant, [request_line("a"), no_model, other_model])

    batch = services.batch_validate(batch=_batch(tenant, file))

    assert batch.status == Batch.Status.FAILED
    [error] = batch.errors
    assert (error["code"], error["line"], error["param"]) == ("mismatched_model", 3, "body.model")
    assert "another-model" in error["message"] and not BatchRequest.objects.exists()


def test_a_mismatch_past_the_first_page_of_requests_leaves_none(
    tenant, file_storage_dir, monkeypatch
):
    """The requests are written a page at a time as the file is read: those written before a
    line for another endpoint are undone with the batch's failure."""
    monkeypatch.setattr(services, "REQUESTS_CREATED_AT_ONCE", 2)
    lines = [request_line(f"r{i}") for i in range(5)]
    lines.append(request_line("last", url="/v1/completions"))
    batch = services.batch_validate(batch=_batch(tenant, _upload(tenant, lines)))

    assert batch.status == Batch.Status.FAILED and batch.errors[0]["line"] == 6
    assert not BatchRequest.objects.exists()


def test_pages_of_requests_add_up_to_the_file(tenant, file_storage_dir, monkeypatch):
    monkeypatch.setattr(services, "REQUESTS_CREATED_AT_ONCE", 2)
    lines = [request_line(f"r{i}") for i in range(5)]
    batch = services.batch_validate(batch=_batch(tenant, _upload(tenant, lines)))

    assert batch.status == Batch.Status.IN_PROGRESS and batch.num_total == 5
    assert sorted(BatchRequest.objects.values_list("custom_id", flat=True)) == [
        f"r{i}" for i in range(5)
    ]


def test_a_batch_whose_input_bytes_are_gone_fails_instead_of_validating_for_ever(
    tenant, file_storage_dir
):
    file = _upload(tenant, [request_line("a")])
    (file_storage_dir / file.storage_name).unlink()

    batch = services.batch_validate(batch=_batch(tenant, file))

    assert batch.status == Batch.Status.FAILED
    assert batch.errors[0]["code"] == "invalid_input_file" and not BatchRequest.objects.exists()


class UnreadableStorage:
    def open(self, name, mode):
        raise PermissionError(13, "Permission denied", name)


def test_an_input_file_unreadable_for_now_is_read_again_later_within_the_window(
    tenant, file_storage_dir, monkeypatch
):
    batch = _batch(tenant, _upload(tenant, [request_line("a")]))
    monkeypatch.setattr(services, "file_storage", UnreadableStorage)

    with pytest.raises(PermissionError):
        services.batch_validate(batch=batch)
    batch.refresh_from_db()
    assert batch.status == Batch.Status.VALIDATING  # the next pass reads it again

    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now())
    batch = services.batch_validate(batch=batch)  # past the window: left for batch_finish
    assert batch.status == Batch.Status.VALIDATING
    batch = services.batch_finish(batch=batch, runner=batch.runner)
    assert batch.status == Batch.Status.EXPIRED


def test_an_upload_is_read_a_line_at_a_time(tenant, file_storage_dir):
    """Every line decoded at once took about 25 times the file's size: a hostile upload of
    large lines of tiny objects within the limits could take gigabytes."""
    import tracemalloc

    line = request_line("x0")
    line["body"]["metadata"] = [{} for _ in range(100_000)]  # ~300 kB of text
    lines = [{**line, "custom_id": f"x{i}"} for i in range(10)]
    upload = SimpleUploadedFile("big.jsonl", jsonl(lines))
    tracemalloc.start()
    try:
        services.file_create(tenant=tenant, upload=upload, purpose="batch")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 5 * upload.size  # one line's objects at a time, not ten lines'


def test_a_line_longer_than_a_request_may_be_is_refused(tenant, file_storage_dir, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 400
    long_line = request_line("b")
    long_line["body"]["messages"][0]["content"] = "x" * 400

    with pytest.raises(services.InvalidRequest) as caught:
        _upload(tenant, [request_line("a"), long_line])

    assert caught.value.message.startswith("Invalid batch input file: Line 2: longer than 400")


def test_a_runner_that_lost_the_lease_writes_nothing_into_a_line_run_again(
    tenant, file_storage_dir
):
    """Another runner took the batch and runs the line again under a new id: the first
    runner's late answer (its run was cut short) does not take the line's place."""
    batch = services.batch_validate(batch=_batch(tenant, _upload(tenant, [request_line("a")])))
    [request] = batch.requests.all()
    services.batch_request_claim(request=request, request_id="chatcmpl-first")
    services.batch_requests_resume(batch=batch)  # the second runner
    services.batch_request_claim(request=request, request_id="chatcmpl-second")

    late = {"status_code": 500, "request_id": "chatcmpl-first", "body": {"error": {}}}
    services.batch_request_finish(request=request, response=late)
    request.refresh_from_db()
    assert (request.status, request.request_id) == ("running", "chatcmpl-second")
    batch.refresh_from_db()
    assert batch.num_failed == 0

    request.request_id = "chatcmpl-first"  # nor is it made pending again by the first
    services.batch_request_unclaim(request=request)
    assert BatchRequest.objects.get(pk=request.pk).status == "running"

    answer = {"status_code": 200, "request_id": "chatcmpl-second", "body": {}}
    services.batch_request_finish(request=request, response=answer)
    request.refresh_from_db()
    assert request.status == "completed"


def test_a_running_batch_can_be_cancelled_and_a_finished_one_not(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a")])
    batch = _batch(tenant, file)
    assert services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=60)
    batch = services.batch_cancel(batch=batch)  # its runner ends it
    assert batch.status == Batch.Status.CANCELLING and batch.cancelling_at is not None
    assert services.batch_cancel(batch=batch).status == Batch.Status.CANCELLING
    assert services.batch_finish(batch=batch, runner="r").status == Batch.Status.CANCELLED

    done = _batch(tenant, file)
    Batch.objects.filter(pk=done.pk).update(status=Batch.Status.COMPLETED)
    with pytest.raises(services.Conflict):
        services.batch_cancel(batch=done)


def test_a_batch_whose_runners_lease_lapsed_waits_for_its_runner(tenant, file_storage_dir):
    """Its runner may be alive, late to renew, about to claim a line: ended under it, that
    line would run and be metered, its answer written nowhere."""
    batch = services.batch_validate(batch=_batch(tenant, _upload(tenant, [request_line("a")])))
    assert services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=60)
    Batch.objects.filter(pk=batch.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    assert services.batch_cancel(batch=batch).status == Batch.Status.CANCELLING


def test_a_batch_cancelled_with_a_line_running_waits_for_its_runner(tenant, file_storage_dir):
    """Its lease ran out (its worker was lost): the sweep's runner ends the running line."""
    batch = services.batch_validate(batch=_batch(tenant, _upload(tenant, [request_line("a")])))
    [request] = batch.requests.all()
    services.batch_request_claim(request=request, request_id="chatcmpl-1")
    assert services.batch_cancel(batch=batch).status == Batch.Status.CANCELLING


def test_a_batch_no_runner_holds_is_cancelled_at_once_with_what_it_answered(
    tenant, file_storage_dir
):
    from batches.storage import file_storage

    batch = services.batch_validate(
        batch=_batch(tenant, _upload(tenant, [request_line("a"), request_line("b")]))
    )
    first = batch.requests.order_by("line_number").first()
    services.batch_request_claim(request=first, request_id="chatcmpl-1")
    answer = {"status_code": 200, "request_id": "chatcmpl-1", "body": {"id": "chatcmpl-1"}}
    services.batch_request_finish(request=first, response=answer)

    batch = services.batch_cancel(batch=batch)

    assert batch.status == Batch.Status.CANCELLED and batch.cancelled_at is not None
    with file_storage().open(batch.output_file.storage_name, "rb") as output:
        [line] = output.read().splitlines()
    assert b'"custom_id":"a"' in line


def test_batches_are_paged_newest_first_after_a_cursor(tenant, file_storage_dir):
    file = _upload(tenant, [request_line("a")])
    moment = timezone.now()
    created = []
    for _ in range(5):
        batch = _batch(tenant, file)
        Batch.objects.filter(pk=batch.pk).update(created_at=moment)  # ties break by id
        created.append(batch.id)
    newest_first = sorted(created, reverse=True)

    first, has_more = selectors.batches_list(tenant_id=tenant.pk, after=None, limit=2)
    rest, has_more_after = selectors.batches_list(tenant_id=tenant.pk, after=first[-1].id, limit=10)

    assert [b.id for b in first] == newest_first[:2] and has_more
    assert [b.id for b in rest] == newest_first[2:] and not has_more_after


def test_an_answer_holding_a_nul_character_is_kept_and_written_as_the_api_sent_it(
    tenant, file_storage_dir
):
    """A model may emit a NUL: the online API answers it (JSON spells it \\u0000), and jsonb
    refused it, so the line could never finish and the batch was run again and again."""
    from batches.storage import file_storage

    batch = services.batch_validate(
        batch=_batch(tenant, _upload(tenant, [request_line("a"), request_line("b")]))
    )
    first, second = batch.requests.order_by("line_number")
    body = {"id": "chatcmpl-1", "object": "chat.completion", "text": "a\x00b"}
    for request in (first, second):
        services.batch_request_claim(request=request, request_id=f"id-{request.pk}")
        services.batch_request_finish(
            request=request,
            response={"status_code": 200, "request_id": f"id-{request.pk}", "body": body},
        )
    assert services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=60)
    batch = services.batch_finish(batch=batch, runner="r")

    assert batch.status == Batch.Status.COMPLETED and batch.num_completed == 2
    with file_storage().open(batch.output_file.storage_name, "rb") as stream:
        lines = stream.read().splitlines()
    assert b'"text":"a\\u0000b"' in lines[0]
    assert [json.loads(line)["response"]["body"] for line in lines] == [body, body]
    # the answer's keys in the order it gave them, as the online API's
    assert lines[0].index(b'"status_code"') < lines[0].index(b'"request_id"')
    assert lines[0].index(b'"id"') < lines[0].index(b'"object"') < lines[0].index(b'"text"')


def test_an_ended_batch_keeps_no_copy_of_its_prompts_and_answers(tenant, file_storage_dir):
    """Its lines' bodies and answers stayed in the database for good, after the tenant
    deleted its input and output files too."""
    batch = services.batch_validate(
        batch=_batch(tenant, _upload(tenant, [request_line("a"), request_line("b")]))
    )
    for request in batch.requests.all():
        services.batch_request_claim(request=request, request_id=f"id-{request.pk}")
        answer = {"status_code": 200, "request_id": f"id-{request.pk}", "body": {"x": 1}}
        services.batch_request_finish(request=request, response=answer)
    assert services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=60)
    batch = services.batch_finish(batch=batch, runner="r")
    assert batch.status == Batch.Status.COMPLETED and batch.num_completed == 2
    assert not BatchRequest.objects.filter(batch=batch).exists()
    assert not BatchRequest.objects.exists()


def test_the_migration_drops_the_lines_of_batches_that_ended_before_it(tenant, file_storage_dir):
    from importlib import import_module

    from django.apps import apps

    migration = import_module("batches.migrations.0007_drop_ended_batches_lines")
    file = _upload(tenant, [request_line("a")])
    ended = services.batch_validate(batch=_batch(tenant, file))
    Batch.objects.filter(pk=ended.pk).update(status=Batch.Status.COMPLETED)
    running = services.batch_validate(batch=_batch(tenant, file))

    migration.drop_ended_batches_lines(apps, None)

    assert not BatchRequest.objects.filter(batch=ended).exists()
    assert BatchRequest.objects.filter(batch=running).count() == 1


@pytest.mark.parametrize("whose", ["plan", "tenant"])
def test_a_tenants_files_may_take_no_more_than_its_storage_limit(tenant, file_storage_dir, whose):
    """A tenant's uploads had no bound but the size of each: one tenant could fill the files
    volume every tenant's batches share."""
    lines = [request_line("a")]
    size = len(jsonl(lines))
    if whose == "plan":
        tenant.plan.max_file_storage_bytes = 2 * size
        tenant.plan.save()
    else:
        tenant.max_file_storage_bytes = 2 * size
        tenant.save()
    first, second = _upload(tenant, lines), _upload(tenant, lines)
    with pytest.raises(services.StorageFull) as caught:
        _upload(tenant, lines)
    assert caught.value.code == "storage_limit_exceeded" and caught.value.param == "file"
    assert f"{2 * size} of your {2 * size}" in caught.value.message
    assert File.objects.filter(tenant=tenant).count() == 2
    assert len(list(file_storage_dir.rglob("*.jsonl"))) == 2  # the refused one's bytes went
    # nor does a batch start over the limit: its results would take more room still
    with pytest.raises(services.StorageFull) as caught:
        _batch(tenant, first)
    assert caught.value.param == "input_file_id"
    services.file_delete(file=first)  # deleting one makes room
    assert _batch(tenant, second)
    assert _upload(tenant, lines)
