"""Writes: files uploaded and deleted, batches created, validated, cancelled, run (a lease
on the batch, each line claimed and finished on its own) and finished with their output and
error files. Every service takes the tenant's object (or the tenant) explicitly; reads live
in ``selectors``."""

import functools
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta

import msgspec
from django.contrib.auth.models import AbstractBaseUser
from django.core.files import File as DjangoFile
from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from batches.estimate import line_input_tokens
from batches.jsonl import (
    ENDPOINTS,
    InputLine,
    InputLineError,
    encode_lines,
    iter_lines,
    split_lines,
)
from batches.models import ACTIVE_STATUSES, Batch, BatchRequest, File
from batches.selectors import stored_file_bytes
from batches.storage import file_storage, max_file_bytes, max_line_bytes
from config.json_text import NUL
from tenants.audit import audit_record
from tenants.models import ApiKey, AuditEvent, Tenant, UsageRecord
from tenants.selectors import tenant_file_storage_limit, tenant_queued_batch_tokens_limit

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
CANCELLABLE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)
UNFINISHED = (BatchRequest.Status.PENDING, BatchRequest.Status.RUNNING)
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}

logger = logging.getLogger(__name__)


class InvalidRequest(Exception):
    """A request the client must change; ``param`` names the field at fault."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class FileTooLarge(InvalidRequest):
    pass


class Conflict(InvalidRequest):
    """The object's state forbids the change (cancelling a finished batch)."""


class StorageFull(InvalidRequest):
    """The tenant's files take its storage limit: an upload waits for deletions (a 400, not
    a 429: waiting frees nothing)."""


class QueueFull(InvalidRequest):
    """The tenant's unfinished batches hold too many tokens for another now; it may be
    created once some have ended."""


def file_create(*, tenant: Tenant, upload: DjangoFile, purpose: str) -> File:
    """Store an uploaded batch input file once every line of it is a valid request."""
    if purpose != File.Purpose.BATCH:
        raise InvalidRequest(
            f"Invalid purpose '{purpose}': this server takes 'batch' files only.",
            param="purpose",
        )
    limit = max_file_bytes()
    if upload.size > limit:
        raise FileTooLarge(
            f"The file is {upload.size} bytes; the limit is {limit}.",
            param="file",
            code="file_too_large",
        )
    upload.seek(0)
    num_lines = num_input_tokens = 0
    try:
        # a line at a time: the decoded lines of a whole file would take many times its size
        for line in iter_lines(split_lines(upload, max_line_bytes())):
            num_lines += 1
            num_input_tokens += line_input_tokens(line)
    except InputLineError as exc:
        raise InvalidRequest(
            f"Invalid batch input file: {exc}", param="file", code="invalid_file"
        ) from exc
    upload.seek(0)
    file = File(
        tenant=tenant,
        purpose=purpose,
        filename=(upload.name or "file.jsonl")[:255],
        bytes=upload.size,
        num_lines=num_lines,
        num_input_tokens=num_input_tokens,
    )
    return _file_save(file, upload, check=functools.partial(_check_storage, tenant, upload.size))


def _check_room_for_results(tenant: Tenant) -> None:
    """A batch's results are files of the tenant's too: none starts once its files take the
    storage limit (its results are never refused: a batch that ran keeps its answers)."""
    limit = tenant_file_storage_limit(tenant=tenant)
    if limit is not None and (stored := stored_file_bytes(tenant_id=tenant.pk)) >= limit:
        raise StorageFull(
            f"Your organization's files take {stored} of your {limit} bytes of file storage: "
            "no room for this batch's results. Delete files you no longer need "
            "(DELETE /v1/files/{file_id}).",
            param="input_file_id",
            code="storage_limit_exceeded",
        )


def _check_storage(tenant: Tenant, num_bytes: int) -> None:
    limit = tenant_file_storage_limit(tenant=tenant)
    if limit is None:
        return
    stored = stored_file_bytes(tenant_id=tenant.pk)
    if stored + num_bytes > limit:
        raise StorageFull(
            f"Your organization's files take {stored} of your {limit} bytes of file storage, "
            f"and this file is {num_bytes} more. Delete files you no longer need "
            "(DELETE /v1/files/{file_id}).",
            param="file",
            code="storage_limit_exceeded",
        )


def file_create_generated(*, tenant: Tenant, purpose: str, filename: str, content: bytes) -> File:
    """A file the platform writes for the tenant (a batch's output or errors)."""
    file = File(
        tenant=tenant,
        purpose=purpose,
        filename=filename,
        bytes=len(content),
        num_lines=content.count(b"\n"),
    )
    return _file_save(file, ContentFile(content))


def _file_save(file: File, content: DjangoFile, check: Callable[[], None] | None = None) -> File:
    """Store the bytes, then the row; ``check`` (a limit) runs with the tenant's row locked
    just before the row goes in: two uploads at once cannot both take the last room, and no
    other change of the tenant waits while the bytes are written. Refused, the bytes go."""
    storage = file_storage()
    file.storage_name = storage.save(f"{file.tenant_id}/{file.id}.jsonl", content)
    try:
        with transaction.atomic():
            if check is not None:
                Tenant.objects.select_for_update().filter(pk=file.tenant_id).first()
                check()
            file.save(force_insert=True)
    except BaseException:
        storage.delete(file.storage_name)
        raise
    return file


@transaction.atomic
def file_delete(*, file: File) -> None:
    """Forget the file; its bytes go once that is committed (``file_bytes_remove``)."""
    file.delete()


def file_bytes_remove(*, file: File) -> None:
    """Remove a deleted file's bytes once its deletion is committed: connected to every
    deletion of a file (``BatchesConfig.ready``), so that a file deleted with its tenant (a
    cascade: the admin deleting a tenant) leaves none of its prompts or answers behind."""
    storage_name = file.storage_name
    if storage_name:
        transaction.on_commit(lambda: file_storage().delete(storage_name))


# Bytes with no file row this old are left by a write whose transaction never committed
# (a worker killed inside ``batch_finish``); anything younger may be an upload or a batch's
# result being written now, its row not yet committed.
ORPHANED_FILE_AGE = timedelta(hours=1)


def files_orphaned_purge(*, older_than: timedelta = ORPHANED_FILE_AGE) -> int:
    """Remove the stored bytes that no file row names and that are older than
    ``older_than``; how many were removed."""
    storage = file_storage()
    cutoff = timezone.now() - older_than
    removed = 0
    names = _stored_names(storage, "")
    while chunk := [name for _, name in zip(range(500), names, strict=False)]:
        known = set(
            File.objects.filter(storage_name__in=chunk).values_list("storage_name", flat=True)
        )
        for name in chunk:
            if name in known:
                continue
            try:
                is_old = storage.get_modified_time(name) < cutoff
            except (FileNotFoundError, NotImplementedError):
                continue  # gone meanwhile, or a storage that cannot tell its age
            if is_old:
                storage.delete(name)
                logger.info("removed the orphaned file bytes %s", name)
                removed += 1
    return removed


def _stored_names(storage, folder: str):
    """Every name under ``folder`` of ``storage``, depth first."""
    try:
        folders, names = storage.listdir(folder)
    except FileNotFoundError:  # nothing stored yet
        return
    except OSError:  # a folder not the platform's (lost+found on a volume of its own)
        logger.warning("cannot list %r in the files storage: left alone", folder, exc_info=True)
        return
    for name in names:
        yield f"{folder}/{name}" if folder else name
    for sub in folders:
        yield from _stored_names(storage, f"{folder}/{sub}" if folder else sub)


def _check_metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs.",
            param="metadata",
        )
    for key, value in metadata.items():
        if isinstance(value, str) and (NUL in key or NUL in value):
            raise InvalidRequest(
                "'metadata' must not contain the NUL character (\\u0000).", param="metadata"
            )
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str):
            raise InvalidRequest(
                f"'metadata' keys are at most {MAX_METADATA_KEY} characters and its values "
                "strings.",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"'metadata' values are at most {MAX_METADATA_VALUE} characters.",
                param="metadata",
            )
    return metadata


def queued_batch_tokens(*, tenant: Tenant) -> int:
    """The input tokens of the tenant's batches that have not ended."""
    queued = Batch.objects.filter(tenant=tenant, status__in=ACTIVE_STATUSES).aggregate(
        tokens=Sum("num_input_tokens")
    )
    return queued["tokens"] or 0


def _check_queued_tokens(tenant: Tenant, num_tokens: int) -> None:
    limit = tenant_queued_batch_tokens_limit(tenant=tenant)
    if limit is None:
        return
    if num_tokens > limit:
        raise InvalidRequest(
            f"The batch holds about {num_tokens} input tokens; your organization's limit on "
            f"queued batch tokens is {limit}. Split the input file.",
            param="input_file_id",
            code="token_limit_exceeded",
        )
    queued = queued_batch_tokens(tenant=tenant)
    if queued + num_tokens > limit:
        raise QueueFull(
            f"Enqueued token limit reached: your unfinished batches hold about {queued} input "
            f"tokens, and this one about {num_tokens} more; the limit is {limit}. Try again "
            "once some in-progress batches have ended.",
            code="token_limit_exceeded",
        )


@transaction.atomic
def batch_create(
    *,
    tenant: Tenant,
    input_file_id: object,
    endpoint: object,
    completion_window: object,
    metadata: object = None,
    api_key: ApiKey | None = None,
) -> Batch:
    """A batch over one of the tenant's input files, left ``validating`` for the worker, which
    is queued once this commits. Its lines are metered under ``api_key`` (the tenant's).
    Refused when its input tokens would take the tenant's unfinished batches past their limit:
    ``QueueFull`` for now, ``InvalidRequest`` when the batch alone is over it."""
    if api_key is not None and api_key.tenant_id != tenant.pk:
        raise ValueError("The API key belongs to another tenant.")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    if not isinstance(completion_window, str) or completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
    checked_metadata = _check_metadata(metadata)
    if not isinstance(input_file_id, str):
        raise InvalidRequest("'input_file_id' must be a file id.", param="input_file_id")
    # an id with a NUL is nobody's (and the database would refuse to compare it)
    files = File.objects.filter(tenant=tenant, pk=input_file_id) if NUL not in input_file_id else []
    input_file = next(iter(files), None)
    if input_file is None or input_file.purpose != File.Purpose.BATCH:
        raise InvalidRequest(
            f"No batch input file with id '{input_file_id}'.",
            param="input_file_id",
            code="invalid_input_file",
        )
    # one creation at a time per tenant, so that two cannot both pass the queued tokens limit
    tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
    _check_queued_tokens(tenant, input_file.num_input_tokens)
    _check_room_for_results(tenant)
    now = timezone.now()
    batch = Batch.objects.create(
        tenant=tenant,
        api_key=api_key,
        endpoint=endpoint,
        input_file_id=input_file.id,
        completion_window=completion_window,
        metadata=checked_metadata,
        num_total=input_file.num_lines,
        num_input_tokens=input_file.num_input_tokens,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )
    transaction.on_commit(functools.partial(_queue_run, batch.id))
    return batch


def _queue_run(batch_id: str) -> None:
    from batches.tasks import run_batch  # the task runs these services: imported late

    try:
        batch_queue_run(batch_id=batch_id, queue=run_batch.delay)
    except Exception:  # the batch exists: the sweep starts it once the broker is back
        logger.exception("could not queue batch %s", batch_id)


def batch_queue_run(*, batch_id: str, queue: Callable[[str], object]) -> None:
    """Queue a runner for the batch (``queue``: the task's ``delay``), marked as queued first:
    a worker may claim it, and clear the mark, before ``delay`` returns. The sweep leaves a
    queued runner waiting for a while; one the broker did not take is not marked."""
    Batch.objects.filter(pk=batch_id).update(queued_at=timezone.now())
    try:
        queue(batch_id)
    except BaseException:
        Batch.objects.filter(pk=batch_id).update(queued_at=None)
        raise


def _fail(batch: Batch, errors: list[dict]) -> Batch:
    batch.status = Batch.Status.FAILED
    batch.errors = errors
    batch.failed_at = timezone.now()
    batch.save(update_fields=["status", "errors", "failed_at"])
    return batch


class _Mismatch(Exception):  # noqa: N818 - the file's fault, not an error of the platform's
    """A line of the input file calls another endpoint than the batch's, or another model
    than the file's first line that names one (a batch runs one model); ``error`` is OpenAI's
    error object for it."""

    def __init__(self, error: dict) -> None:
        super().__init__(error["message"])
        self.error = error


def _check_calls(batch: Batch, line: InputLine, model: str | None) -> str | None:
    """The file's model once ``line`` is read (``model``: before it); raises ``_Mismatch``."""
    if line.url != batch.endpoint:
        raise _Mismatch(
            {
                "code": "mismatched_endpoint",
                "message": f"The line's url {line.url} is not the batch's endpoint "
                f"{batch.endpoint}.",
                "param": "url",
                "line": line.line_number,
            }
        )
    if line.model is None or model is None:
        return model or line.model  # a line without one: its own answer says what is wrong
    if line.model != model:
        raise _Mismatch(
            {
                "code": "mismatched_model",
                "message": f"The line's model '{line.model}' is not the file's model '{model}': "
                "a batch's requests all call one model.",
                "param": "body.model",
                "line": line.line_number,
            }
        )
    return model


REQUESTS_CREATED_AT_ONCE = 1000


def _requests_create(batch: Batch, lines: Iterable[InputLine]) -> int:
    """One pending request per line, written a page at a time as the lines are read; how
    many. Raises ``_Mismatch`` (the requests written before stay: roll them back)."""
    page: list[BatchRequest] = []
    num_created = 0
    model = None
    for line in lines:
        model = _check_calls(batch, line, model)
        page.append(
            BatchRequest(
                tenant=batch.tenant,
                batch=batch,
                custom_id=line.custom_id,
                line_number=line.line_number,
                body=line.body.decode(),
            )
        )
        if len(page) == REQUESTS_CREATED_AT_ONCE:
            BatchRequest.objects.bulk_create(page)
            num_created, page = num_created + len(page), []
    BatchRequest.objects.bulk_create(page)
    return num_created + len(page)


def _input_file_error(message: str) -> dict:
    return {
        "code": "invalid_input_file",
        "message": message,
        "param": "input_file_id",
        "line": None,
    }


@transaction.atomic
def batch_validate(*, batch: Batch) -> Batch:
    """Turn a ``validating`` batch's input file into one pending request per line and start
    it, or fail it with OpenAI's ``errors`` when a line calls another endpoint or model, or
    the file is gone. Does nothing to a batch past validating, so a worker may call it again
    after a crash. A file that cannot be read for now (another error of the storage) raises,
    for a later pass, unless the batch's window is over: then it is left validating, for
    ``batch_finish`` to expire."""
    batch = Batch.objects.select_for_update().get(pk=batch.pk)
    if batch.status != Batch.Status.VALIDATING:
        return batch
    input_file = File.objects.filter(tenant=batch.tenant, pk=batch.input_file_id).first()
    if input_file is None:
        return _fail(batch, [_input_file_error("The input file was deleted.")])
    try:
        # a savepoint: a mismatch found past the first page undoes the requests written
        with transaction.atomic(), file_storage().open(input_file.storage_name, "rb") as stream:
            num_total = _requests_create(batch, iter_lines(split_lines(stream)))
    except _Mismatch as exc:
        return _fail(batch, [exc.error])
    except FileNotFoundError:
        logger.error("batch %s: its input file's bytes are gone", batch.pk)
        return _fail(batch, [_input_file_error("The input file's contents were lost.")])
    except InputLineError as exc:  # the bytes are no longer what was checked at the upload
        logger.error("batch %s: its input file no longer reads: %s", batch.pk, exc)
        return _fail(batch, [_input_file_error(f"Invalid batch input file: {exc}")])
    except OSError:
        if batch.expires_at > timezone.now():
            raise
        logger.exception("batch %s: its input file could not be read in its window", batch.pk)
        return batch
    batch.status = Batch.Status.IN_PROGRESS
    batch.num_total = num_total
    batch.in_progress_at = timezone.now()
    batch.save(update_fields=["status", "num_total", "in_progress_at"])
    return batch


@transaction.atomic
def batch_cancel(*, batch: Batch, actor: AbstractBaseUser | None = None) -> Batch:
    """Stop a batch from starting new lines: its runner finishes it as ``cancelled`` once its
    running lines end; one that no runner has and with no line running (queued behind other
    batches) is ``cancelled`` at once, its results written and its queued tokens freed.
    ``actor``: the person cancelling it in the console, in the tenant's audit log (None: the
    tenant's app, through the API)."""
    batch = Batch.objects.select_for_update().get(pk=batch.pk)
    if batch.status == Batch.Status.CANCELLING:
        return batch
    if batch.status not in CANCELLABLE:
        raise Conflict(
            f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable"
        )
    now = timezone.now()
    batch.status = Batch.Status.CANCELLING
    batch.cancelling_at = now
    batch.save(update_fields=["status", "cancelling_at"])
    # No runner has it (never taken, or given back; the row is locked: a runner's claim
    # waits, then finds it ended) and no line runs: nobody else would end it. A runner whose
    # lease lapsed may be alive, about to claim a line: it, or the sweep's next, ends it.
    if not batch.runner and not batch.requests.filter(status=BatchRequest.Status.RUNNING).exists():
        _end(batch, Batch.Status.CANCELLED)
    if actor is not None:
        audit_record(
            action=AuditEvent.Action.BATCH_CANCELLED, actor=actor, target=batch, tenant=batch.tenant
        )
    return batch


# --- running -------------------------------------------------------------------------------


def batch_claim(*, batch_id: str, runner: str, lease_seconds: float) -> Batch | None:
    """Take a batch that is not yet ended for ``runner`` until ``lease_seconds`` from now,
    unless another runner's lease on it still holds (None)."""
    now = timezone.now()
    is_taken = (
        Batch.objects.filter(pk=batch_id, status__in=ACTIVE_STATUSES)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .update(runner=runner, lease_until=now + timedelta(seconds=lease_seconds), queued_at=None)
    )
    return Batch.objects.select_related("tenant__plan").get(pk=batch_id) if is_taken else None


def batch_lease_renew(*, batch: Batch, runner: str, lease_seconds: float) -> str | None:
    """Extend the runner's lease; the batch's status, or None when the lease was lost."""
    until = timezone.now() + timedelta(seconds=lease_seconds)
    if not Batch.objects.filter(pk=batch.pk, runner=runner).update(lease_until=until):
        return None
    return Batch.objects.values_list("status", flat=True).get(pk=batch.pk)


def batch_release(*, batch: Batch, runner: str) -> None:
    Batch.objects.filter(pk=batch.pk, runner=runner).update(runner="", lease_until=None)


def batch_requests_resume(*, batch: Batch) -> int:
    """Lines a dead runner left running are pending again, keeping their request ids (see
    ``batch_request_next_id``). Call it holding the lease."""
    return BatchRequest.objects.filter(batch=batch, status=BatchRequest.Status.RUNNING).update(
        status=BatchRequest.Status.PENDING
    )


def batch_request_next_id(*, request: BatchRequest, fresh_id: str) -> str:
    """The request id a line runs under next: the one it ran under before while that run
    left no usage record (its runner died mid-run: nothing was metered) or a whole one (its
    runner died after the record, before the result: the answer is not charged twice), else
    ``fresh_id``. A run that was refused, failed or cancelled after its admission has a
    record of what it used, and the next is a request of its own, metered on its own."""
    if not request.request_id:
        return fresh_id
    status = (
        UsageRecord.objects.filter(tenant_id=request.tenant_id, request_id=request.request_id)
        .values_list("status", flat=True)
        .first()
    )
    if status is None or status == UsageRecord.Status.OK:
        return request.request_id
    return fresh_id


def batch_request_rename(*, request: BatchRequest, request_id: str) -> None:
    """A running line tries again under ``request_id`` (its last try was admitted and
    metered: see ``batch_request_next_id``)."""
    BatchRequest.objects.filter(pk=request.pk, status=BatchRequest.Status.RUNNING).update(
        request_id=request_id
    )


def batch_request_is_owed(*, request: BatchRequest) -> bool:
    """Whether the line's last run was metered whole (its runner died after the usage record,
    before the result): the tenant paid for an answer it has not had."""
    return bool(request.request_id) and (
        UsageRecord.objects.filter(
            tenant_id=request.tenant_id,
            request_id=request.request_id,
            status=UsageRecord.Status.OK,
        ).exists()
    )


def batch_request_claim(*, request: BatchRequest, request_id: str) -> bool:
    """Mark a pending line running under ``request_id``, if its batch still takes lines (in
    progress, not cancelled, within its window), or if the line is owed its answer
    (``batch_request_is_owed``) and runs again under the same id: a line in flight when its
    runner died runs to its end as lines in flight at a cancel or at the window's end do."""
    lines = BatchRequest.objects.filter(pk=request.pk, status=BatchRequest.Status.PENDING)
    if request_id == request.request_id and batch_request_is_owed(request=request):
        lines = lines.filter(batch__status__in=ACTIVE_STATUSES)
    else:
        lines = lines.filter(
            batch__status=Batch.Status.IN_PROGRESS, batch__expires_at__gt=timezone.now()
        )
    return bool(lines.update(status=BatchRequest.Status.RUNNING, request_id=request_id))


def batch_request_unclaim(*, request: BatchRequest) -> None:
    """A running line that never ran to an answer (its batch stopped) is pending again; not
    where another runner runs it now under another id (this one lost the lease)."""
    BatchRequest.objects.filter(
        pk=request.pk, status=BatchRequest.Status.RUNNING, request_id=request.request_id
    ).update(status=BatchRequest.Status.PENDING)


@transaction.atomic
def batch_request_finish(*, request: BatchRequest, response: dict) -> None:
    """Write a running line's response (``{"status_code", "request_id", "body"}``) and count
    it: completed for a 200, failed for any other status. Not where the line runs again under
    another id (its runner lost the lease meanwhile, and another runs it)."""
    is_ok = response["status_code"] == 200
    is_written = BatchRequest.objects.filter(
        pk=request.pk, status=BatchRequest.Status.RUNNING, request_id=response["request_id"]
    ).update(
        status=BatchRequest.Status.COMPLETED if is_ok else BatchRequest.Status.FAILED,
        response=msgspec.json.encode(response).decode(),
        finished_at=timezone.now(),
    )
    if is_written:
        counter = "num_completed" if is_ok else "num_failed"
        Batch.objects.filter(pk=request.batch_id).update(**{counter: F(counter) + 1})


@transaction.atomic
def batch_finish(*, batch: Batch, runner: str) -> Batch:
    """End a batch its runner takes no more lines of: ``cancelled`` if it was being
    cancelled, ``completed`` (through ``finalizing``) once every line has run, ``expired``
    past its window (each line left in the error file as ``batch_expired``), each with its
    output and error files. A batch with lines left within its window, or whose lease the
    runner lost, is left as it is, to be resumed."""
    batch = Batch.objects.select_for_update().get(pk=batch.pk)
    if batch.runner != runner or batch.status not in ACTIVE_STATUSES:
        return batch
    now = timezone.now()
    has_unfinished = BatchRequest.objects.filter(batch=batch, status__in=UNFINISHED).exists()
    if batch.status == Batch.Status.CANCELLING:
        final = Batch.Status.CANCELLED
    elif batch.status == Batch.Status.FINALIZING or (
        batch.status == Batch.Status.IN_PROGRESS and not has_unfinished
    ):
        final = Batch.Status.COMPLETED
    elif batch.expires_at <= now:
        final = Batch.Status.EXPIRED
    else:
        return batch
    if final == Batch.Status.COMPLETED and batch.status != Batch.Status.FINALIZING:
        batch.status, batch.finalizing_at = Batch.Status.FINALIZING, now
        batch.save(update_fields=["status", "finalizing_at"])
    _end(batch, final)
    return batch


def _end(batch: Batch, final: str) -> None:
    """Write a locked batch's results and give it its ``final`` status. Its lines go: their
    prompts and answers are in its files now, which the tenant may delete (a copy kept here
    outlived them, and every batch was stored twice for good)."""
    _results_write(batch, is_expired=final == Batch.Status.EXPIRED)
    BatchRequest.objects.filter(batch=batch).delete()
    batch.status = final
    setattr(batch, f"{final}_at", timezone.now())
    batch.save(update_fields=["status", f"{final}_at", "output_file", "error_file"])


def _results_write(batch: Batch, *, is_expired: bool) -> None:
    """The output file (lines answered 200) and the error file (every other answer, and the
    lines an expired batch never ran), in OpenAI's batch output format, by line number."""
    output, errors = [], []
    requests = BatchRequest.objects.filter(batch=batch).order_by("line_number")
    for request in requests.iterator(chunk_size=1000):
        line = {
            "id": f"batch_req_{request.pk}",
            "custom_id": request.custom_id,
            "response": None if request.response is None else msgspec.Raw(request.response),
            "error": request.error,
        }
        if request.status == BatchRequest.Status.COMPLETED:
            output.append(line)
        elif request.status == BatchRequest.Status.FAILED:
            errors.append(line)
        elif is_expired:
            errors.append({**line, "response": None, "error": EXPIRED_ERROR})
    if output and batch.output_file_id is None:
        batch.output_file = _result_file(batch, "output", output)
    if errors and batch.error_file_id is None:
        batch.error_file = _result_file(batch, "error", errors)


def _result_file(batch: Batch, suffix: str, lines: list[dict]) -> File:
    return file_create_generated(
        tenant=batch.tenant,
        purpose=File.Purpose.BATCH_OUTPUT,
        filename=f"{batch.id}_{suffix}.jsonl",
        content=encode_lines(lines),
    )
