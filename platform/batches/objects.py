"""OpenAI's file and batch objects, as the API returns them."""

from datetime import datetime

from batches.models import Batch, File


def _seconds(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def file_object(file: File) -> dict:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _seconds(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(batch: Batch) -> dict:
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None if batch.errors is None else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _seconds(batch.created_at),
        "in_progress_at": _seconds(batch.in_progress_at),
        "expires_at": _seconds(batch.expires_at),
        "finalizing_at": _seconds(batch.finalizing_at),
        "completed_at": _seconds(batch.completed_at),
        "failed_at": _seconds(batch.failed_at),
        "expired_at": _seconds(batch.expired_at),
        "cancelling_at": _seconds(batch.cancelling_at),
        "cancelled_at": _seconds(batch.cancelled_at),
        "request_counts": {
            "total": batch.num_total,
            "completed": batch.num_completed,
            "failed": batch.num_failed,
        },
        "metadata": batch.metadata,
    }


def list_object(data: list[dict], *, has_more: bool) -> dict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
