"""Files and batches with OpenAI's ids (``file-…``, ``batch_…``), and one row per request
line of a batch, keyed by ``(batch, custom_id)``, so that running a batch can resume where it
stopped and never runs a line twice.

Models stay thin: writes live in ``batches.services``, reads in ``batches.selectors``."""

import json
import secrets

from django.db import models
from django.utils import timezone

from batches.jsonl import MAX_CUSTOM_ID_CHARS
from tenants.models import ApiKey, Tenant


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class File(models.Model):
    """An uploaded or generated file; its bytes live in the files storage under
    ``storage_name``, never under a name the client chose."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "Batch input"
        BATCH_OUTPUT = "batch_output", "Batch output"

    id = models.CharField(primary_key=True, max_length=40, default=new_file_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    num_lines = models.PositiveIntegerField(default=0)
    # an input file's likely input tokens (batches.estimate), for the queued batch tokens limit
    num_input_tokens = models.PositiveBigIntegerField(default=0)
    storage_name = models.CharField(max_length=255)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at", "-id"])]

    def __str__(self) -> str:
        return self.id


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=40, default=new_batch_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    # the key that created it, which its lines are metered under (None: it was deleted)
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    endpoint = models.CharField(max_length=64)
    # a plain id, not a key: OpenAI lets a tenant delete the input file of a batch
    input_file_id = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    metadata = models.JSONField(null=True, blank=True)
    # validation errors, as OpenAI's ``errors.data`` list
    errors = models.JSONField(null=True, blank=True)
    output_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # the worker running the batch holds it until ``lease_until``, renewing it as it goes; a
    # lease left to expire (a killed worker) lets the sweep start another
    runner = models.CharField(max_length=32, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # when a runner was last queued for it and none has claimed it since: the sweep queues
    # another only once that one has waited ``selectors.REQUEUE_AFTER`` (it may be lost)
    queued_at = models.DateTimeField(null=True, blank=True)
    num_total = models.PositiveIntegerField(default=0)
    num_completed = models.PositiveIntegerField(default=0)
    num_failed = models.PositiveIntegerField(default=0)
    # its input file's, held against the tenant's queued batch tokens until the batch ends
    num_input_tokens = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "-created_at", "-id"])]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.id


# a batch not yet ended: a runner has work left on it
ACTIVE_STATUSES = (
    Batch.Status.VALIDATING,
    Batch.Status.IN_PROGRESS,
    Batch.Status.CANCELLING,
    Batch.Status.FINALIZING,
)


class BatchRequest(models.Model):
    """One line of a batch's input: pending until it is run, then its response or error in
    the shape of a line of OpenAI's output or error file."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"  # sent to the engine; one a dead worker left is run again
        COMPLETED = "completed"
        FAILED = "failed"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="requests")
    custom_id = models.CharField(max_length=MAX_CUSTOM_ID_CHARS)
    line_number = models.PositiveIntegerField()
    # the request's JSON text as the line held it: jsonb would sort its keys, and the engine
    # would see another JSON schema (or tools) than the online API gives it for the same body
    body = models.TextField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    # the usage record's (and the response's id), kept when a line is run again after a
    # worker died: a record the dead run already wrote is not written twice
    request_id = models.CharField(max_length=64, blank=True)
    # {"status_code", "request_id", "body"} as JSON text: jsonb refuses a NUL (which a model
    # may emit, and JSON spells \u0000) and would sort the answer's keys
    response = models.TextField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)  # {"code", "message"}
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_request_custom_id")
        ]
        indexes = [models.Index(fields=["batch", "status", "line_number"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id}"

    def body_bytes(self) -> bytes:
        """The request's body, as the API's parsers take it."""
        return self.body.encode()

    def response_object(self) -> dict | None:
        """The line's response, parsed; None before it has one."""
        return None if self.response is None else json.loads(self.response)
