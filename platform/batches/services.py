"""Writes: files uploaded and deleted, batches created, validated and cancelled. Every
service takes the tenant's object (or the tenant) explicitly; reads live in ``selectors``."""

from datetime import timedelta

from django.core.files import File as DjangoFile
from django.core.files.base import ContentFile
from django.db import transaction
from django.utils import timezone

from batches.jsonl import ENDPOINTS, InputLineError, parse_lines
from batches.models import Batch, BatchRequest, File
from batches.storage import file_storage, max_file_bytes
from tenants.models import Tenant

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
CANCELLABLE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)


class InvalidRequest(Exception):
    """A request the client must change; ``param`` names the field at fault."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class FileTooLarge(InvalidRequest):
    pass


class Conflict(InvalidRequest):
    """The object's state forbids the change (cancelling a finished batch)."""


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
    try:
        lines = parse_lines(upload)
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
        num_lines=len(lines),
    )
    return _file_save(file, upload)


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


def _file_save(file: File, content: DjangoFile) -> File:
    storage = file_storage()
    file.storage_name = storage.save(f"{file.tenant_id}/{file.id}.jsonl", content)
    try:
        file.save(force_insert=True)
    except BaseException:
        storage.delete(file.storage_name)
        raise
    return file


@transaction.atomic
def file_delete(*, file: File) -> None:
    """Forget the file, and remove its bytes once that is committed."""
    storage_name = file.storage_name
    file.delete()
    transaction.on_commit(lambda: file_storage().delete(storage_name))


def _check_metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs.",
            param="metadata",
        )
    for key, value in metadata.items():
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


def batch_create(
    *,
    tenant: Tenant,
    input_file_id: object,
    endpoint: object,
    completion_window: object,
    metadata: object = None,
) -> Batch:
    """A batch over one of the tenant's input files, left ``validating`` for the worker."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
    checked_metadata = _check_metadata(metadata)
    if not isinstance(input_file_id, str):
        raise InvalidRequest("'input_file_id' must be a file id.", param="input_file_id")
    input_file = File.objects.filter(tenant=tenant, pk=input_file_id).first()
    if input_file is None or input_file.purpose != File.Purpose.BATCH:
        raise InvalidRequest(
            f"No batch input file with id '{input_file_id}'.",
            param="input_file_id",
            code="invalid_input_file",
        )
    now = timezone.now()
    return Batch.objects.create(
        tenant=tenant,
        endpoint=endpoint,
        input_file_id=input_file.id,
        completion_window=completion_window,
        metadata=checked_metadata,
        num_total=input_file.num_lines,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )


def _fail(batch: Batch, errors: list[dict]) -> Batch:
    batch.status = Batch.Status.FAILED
    batch.errors = errors
    batch.failed_at = timezone.now()
    batch.save(update_fields=["status", "errors", "failed_at"])
    return batch


@transaction.atomic
def batch_validate(*, batch: Batch) -> Batch:
    """Turn a ``validating`` batch's input file into one pending request per line and start
    it, or fail it with OpenAI's ``errors`` when a line calls another endpoint. Does nothing to
    a batch past validating, so a worker may call it again after a crash."""
    batch = Batch.objects.select_for_update().get(pk=batch.pk)
    if batch.status != Batch.Status.VALIDATING:
        return batch
    input_file = File.objects.filter(tenant=batch.tenant, pk=batch.input_file_id).first()
    if input_file is None:
        return _fail(
            batch,
            [
                {
                    "code": "invalid_input_file",
                    "message": "The input file was deleted.",
                    "param": "input_file_id",
                    "line": None,
                }
            ],
        )
    with file_storage().open(input_file.storage_name, "rb") as stream:
        lines = parse_lines(stream)
    for line in lines:
        if line.url != batch.endpoint:
            return _fail(
                batch,
                [
                    {
                        "code": "mismatched_endpoint",
                        "message": f"The line's url {line.url} is not the batch's endpoint "
                        f"{batch.endpoint}.",
                        "param": "url",
                        "line": line.line_number,
                    }
                ],
            )
    BatchRequest.objects.bulk_create(
        [
            BatchRequest(
                tenant=batch.tenant,
                batch=batch,
                custom_id=line.custom_id,
                line_number=line.line_number,
                body=line.body,
            )
            for line in lines
        ],
        batch_size=1000,
    )
    batch.status = Batch.Status.IN_PROGRESS
    batch.num_total = len(lines)
    batch.in_progress_at = timezone.now()
    batch.save(update_fields=["status", "num_total", "in_progress_at"])
    return batch


@transaction.atomic
def batch_cancel(*, batch: Batch) -> Batch:
    """Stop a batch from starting new lines; the worker finishes it as ``cancelled``."""
    batch = Batch.objects.select_for_update().get(pk=batch.pk)
    if batch.status == Batch.Status.CANCELLING:
        return batch
    if batch.status not in CANCELLABLE:
        raise Conflict(
            f"Cannot cancel a batch with status '{batch.status}'.", code="batch_not_cancellable"
        )
    batch.status = Batch.Status.CANCELLING
    batch.cancelling_at = timezone.now()
    batch.save(update_fields=["status", "cancelling_at"])
    return batch
