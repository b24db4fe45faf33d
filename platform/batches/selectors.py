"""Reads. Every selector of a tenant's objects takes the tenant and filters by it: another
tenant's id is ``DoesNotExist``, exactly like an id that never existed. The runner's reads
(``batches_unattended``, ``batch_requests_pending``, ``batch_requests_owed``) are the
platform's own, across tenants."""

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import BinaryIO

from asgiref.sync import sync_to_async
from django.db.models import Model, Q, QuerySet, Sum
from django.utils import timezone

from batches.models import ACTIVE_STATUSES, Batch, BatchRequest, File
from batches.storage import file_storage
from config.json_text import NUL
from tenants.models import UsageRecord

READ_CHUNK_BYTES = 256 * 1024


def file_get(*, tenant_id: int, file_id: str) -> File:
    return _get(File.objects.filter(tenant_id=tenant_id), file_id)


def batch_get(*, tenant_id: int, batch_id: str) -> Batch:
    return _get(Batch.objects.filter(tenant_id=tenant_id), batch_id)


def _get(queryset: QuerySet, object_id: str) -> Model:
    """The object with id ``object_id``; DoesNotExist also for an id no object can have (one
    with a NUL, which the database would refuse to compare)."""
    if NUL in object_id:
        raise queryset.model.DoesNotExist
    return queryset.get(pk=object_id)


def _page(
    queryset: QuerySet,
    *,
    after: str | None,
    limit: int,
    newest_first: bool = True,
    cursors: QuerySet | None = None,
) -> tuple[list[Model], bool]:
    """One page of ``queryset`` in creation order, starting after the object with id
    ``after`` (OpenAI's cursor: one of ``cursors``, by default ``queryset``'s), and whether
    more follow. Unknown cursor: DoesNotExist."""
    sign = "-" if newest_first else ""
    queryset = queryset.order_by(f"{sign}created_at", f"{sign}id")
    if after is not None:
        cursor = _get(queryset if cursors is None else cursors, after)
        op = "lt" if newest_first else "gt"
        queryset = queryset.filter(
            Q(**{f"created_at__{op}": cursor.created_at})
            | Q(created_at=cursor.created_at, **{f"id__{op}": cursor.id})
        )
    items = list(queryset[: limit + 1])
    return items[:limit], len(items) > limit


def stored_file_bytes(*, tenant_id: int) -> int:
    """What the tenant's files take, in bytes."""
    return File.objects.filter(tenant_id=tenant_id).aggregate(total=Sum("bytes"))["total"] or 0


def files_list(
    *, tenant_id: int, purpose: str | None, after: str | None, limit: int, newest_first: bool
) -> tuple[list[File], bool]:
    tenants_files = queryset = File.objects.filter(tenant_id=tenant_id)
    if purpose:
        # a purpose with a NUL, which the database would refuse to compare, is no file's
        queryset = queryset.none() if NUL in purpose else queryset.filter(purpose=purpose)
    # the cursor may be any of the tenant's files, of this purpose or not
    return _page(
        queryset, after=after, limit=limit, newest_first=newest_first, cursors=tenants_files
    )


def batches_list(*, tenant_id: int, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    return _page(Batch.objects.filter(tenant_id=tenant_id), after=after, limit=limit)


def file_open(*, file: File) -> BinaryIO:
    """The file's bytes, open for reading; ``File.DoesNotExist`` where they are gone (deleted
    as it was asked for: its bytes go when the deletion commits; or lost from storage)."""
    try:
        return file_storage().open(file.storage_name, "rb")
    except FileNotFoundError:
        raise File.DoesNotExist(f"the bytes of {file.id} are gone") from None


async def file_chunks(*, file: File) -> AsyncIterator[bytes]:
    """The file's bytes, read a chunk at a time off the event loop; opened at once (before a
    response commits to them), ``File.DoesNotExist`` where they are gone."""
    stream = await sync_to_async(file_open, thread_sensitive=False)(file=file)
    return _chunks(stream)


async def _chunks(stream: BinaryIO) -> AsyncIterator[bytes]:
    read = sync_to_async(stream.read, thread_sensitive=False)
    try:
        while chunk := await read(READ_CHUNK_BYTES):
            yield chunk
    finally:
        await sync_to_async(stream.close, thread_sensitive=False)()


# How long a queued runner may wait for a worker before the sweep takes its task for lost
# and queues another (one that was not lost then finds the batch held, and stops).
REQUEUE_AFTER = timedelta(minutes=10)


def batches_unattended() -> list[str]:
    """Batches not yet ended that no runner holds and none waits to: new ones whose task was
    lost, and those of a worker that died (its lease ran out). A runner queued and not yet
    started counts as waiting for ``REQUEUE_AFTER``: while the batch workers are busy, the
    sweep adds no copies of it each minute."""
    now = timezone.now()
    return list(
        Batch.objects.filter(status__in=ACTIVE_STATUSES)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .filter(Q(queued_at__isnull=True) | Q(queued_at__lt=now - REQUEUE_AFTER))
        .order_by("created_at")
        .values_list("id", flat=True)
    )


def batch_requests_owed(*, batch: Batch) -> list[BatchRequest]:
    """The batch's pending lines whose last run was metered whole (``batch_request_is_owed``),
    by line number."""
    metered = UsageRecord.objects.filter(
        tenant_id=batch.tenant_id, status=UsageRecord.Status.OK
    ).values("request_id")
    return list(
        BatchRequest.objects.filter(batch=batch, status=BatchRequest.Status.PENDING)
        .exclude(request_id="")
        .filter(request_id__in=metered)
        .order_by("line_number")
    )


def batch_requests_pending(*, batch: Batch, after_line: int, limit: int) -> list[BatchRequest]:
    """The batch's next pending lines after ``after_line``, by line number."""
    return list(
        BatchRequest.objects.filter(
            batch=batch, status=BatchRequest.Status.PENDING, line_number__gt=after_line
        ).order_by("line_number")[:limit]
    )
