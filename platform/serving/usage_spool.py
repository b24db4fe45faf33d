"""Usage records the database could not take when their requests ended, kept on disk until
it can: every admitted request is metered, a database outage included.

The settlement (``serving.settlement``) writes a group's records in one transaction, and tries
once more on a new connection. Where the database is still out of reach, the group's records
are written here instead, one JSON document a line, into a file of their own that appears
whole (written aside, synced, then renamed), owner-only; the requests end as metered.
``spool_replay`` (the Celery task ``serving.replay_usage_spool``, every minute) saves each
file's records once the database answers, and removes the file. A record whose request id is
saved already (the commit that failed to answer had gone through) is skipped, as every save
skips one; a record whose tenant was deleted since is dropped with it. A replayed record is
created now, so the usage roll-ups (``tenants.rollups``) count it at their next run.

``USAGE_SPOOL_DIR`` (default ``var/usage-spool``) must be shared by the web processes and the
Celery worker where they run on other hosts (``deploy/compose.yaml`` mounts one volume).
"""

import logging
import os
import time
import uuid
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import msgspec
from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from config.private_files import PRIVATE_MODE
from tenants import services
from tenants.models import Tenant, UsageRecord

logger = logging.getLogger(__name__)

SUFFIX = ".jsonl"
# what the file holds of each record: its fields but its id and its creation, given at replay
_FIELDS = [
    field
    for field in UsageRecord._meta.concrete_fields
    if not field.primary_key and field.name != "created_at"
]


def spool_dir() -> Path:
    return Path(settings.USAGE_SPOOL_DIR)


def spool_write(records: list[UsageRecord]) -> Path:
    """Keep ``records`` on disk for ``spool_replay``; the file. Raises ``OSError`` where the
    disk refuses them (then nothing was kept)."""
    directory = spool_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex}"
    temporary, path = directory / f".{name}.tmp", directory / f"{name}{SUFFIX}"
    content = b"".join(msgspec.json.encode(_row(record)) + b"\n" for record in records)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def spool_replay() -> int:
    """Save the records of every spooled file, oldest first, and remove each file once its
    records are committed; the number of records saved or found saved already. A database
    still out of reach raises, leaving the rest for the next run."""
    num_records = 0
    for path in sorted(spool_dir().glob(f"*{SUFFIX}")):
        try:
            content = path.read_bytes()
        except FileNotFoundError:  # another replay (a run that overlapped) took it
            continue
        records = [_record(line) for line in content.splitlines() if line.strip()]
        _save(records, path)
        path.unlink(missing_ok=True)
        num_records += len(records)
        logger.info("saved %d usage records kept in %s", len(records), path.name)
    return num_records


def _save(records: list[UsageRecord], path: Path) -> None:
    try:
        with transaction.atomic():
            services.usage_records_save(records)
        return
    except IntegrityError:  # a tenant deleted meanwhile: save the others one by one
        pass
    for record in records:
        try:
            with transaction.atomic():
                services.usage_records_save([record])
        except IntegrityError:
            logger.warning(
                "dropped the kept usage record %s of %s: its tenant is gone",
                record.request_id,
                path.name,
            )


def _row(record: UsageRecord) -> dict:
    row = {}
    for field in _FIELDS:
        value = getattr(record, field.attname)
        row[field.attname] = value.isoformat() if isinstance(value, datetime) else value
    return row


def _record(line: bytes) -> UsageRecord:
    row = msgspec.json.decode(line)
    for field in _FIELDS:
        value = row.get(field.attname)
        if isinstance(field, models.DateTimeField) and value is not None:
            row[field.attname] = datetime.fromisoformat(value)
        elif isinstance(field, models.DecimalField) and value is not None:
            row[field.attname] = Decimal(value)
    record = UsageRecord(**row, created_at=timezone.now())
    if record.billed_tokens is None:
        record.billed_tokens = _billed_now(record)
    return record


def _billed_now(record: UsageRecord) -> Decimal:
    """What a record kept before records carried their billed tokens is billed as: at its
    tenant's plan of now, as the migration that added them billed the records saved by then
    (without it, the missing column failed the save, and the record was dropped as if its
    tenant were gone). A tenant gone since: one a token (the record is dropped with it)."""
    tenant = Tenant.objects.select_related("plan").filter(pk=record.tenant_id).first()
    if tenant is None:
        return Decimal(record.total_tokens)
    return services.billed_tokens(tenant=tenant, source=record.source, tokens=record.total_tokens)
