"""The Files and Batch APIs' bodies as msgspec structs, for the OpenAPI document
(``gateway.openapi``). The views build OpenAI's objects in ``batches.objects``; a test converts
those into these structs, so the document cannot drift from what the API returns."""

from typing import Annotated, Literal

import msgspec

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]


class FileObject(msgspec.Struct):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: str | None
    expires_at: int | None


class FileList(msgspec.Struct):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(msgspec.Struct):
    id: str
    object: Literal["file"]
    deleted: bool


class FileUpload(msgspec.Struct):
    """``multipart/form-data``: the JSONL file and its purpose."""

    file: Annotated[str, msgspec.Meta(extra_json_schema={"format": "binary"})]
    purpose: Literal["batch"] = "batch"


class BatchError(msgspec.Struct):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(msgspec.Struct):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class BatchObject(msgspec.Struct):
    id: str
    object: Literal["batch"]
    endpoint: Endpoint
    errors: BatchErrors | None
    input_file_id: str
    completion_window: Literal["24h"]
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(msgspec.Struct):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchCreateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


SCHEMAS = (
    FileObject,
    FileList,
    FileDeleted,
    FileUpload,
    BatchObject,
    BatchList,
    BatchCreateRequest,
)
