"""Background work on usage: roll-ups for the dashboards and retention of old rows (usage
and the audit log)."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from tenants.models import AuditEvent, RefusalCount, UsageRecord, UsageRollup
from tenants.rollups import rollup_pending


@shared_task(name="tenants.rollup_usage")
def rollup_usage() -> int:
    """Roll up what changed since the last run; the number of hours rolled."""
    return len(rollup_pending())


@shared_task(name="tenants.purge_old_usage")
def purge_old_usage() -> dict[str, int]:
    """Delete raw usage records past USAGE_RETENTION_DAYS and roll-ups past
    ROLLUP_RETENTION_DAYS (roll-ups and refusal counts are small and kept longer by
    default)."""
    now = timezone.now()
    records, _ = UsageRecord.objects.filter(
        started_at__lt=now - timedelta(days=settings.USAGE_RETENTION_DAYS)
    ).delete()
    rollups, _ = UsageRollup.objects.filter(
        period_start__lt=now - timedelta(days=settings.ROLLUP_RETENTION_DAYS)
    ).delete()
    refusals, _ = RefusalCount.objects.filter(
        hour__lt=now - timedelta(days=settings.ROLLUP_RETENTION_DAYS)
    ).delete()
    return {"usage_records": records, "usage_rollups": rollups, "refusal_counts": refusals}


@shared_task(name="tenants.purge_old_audit_events")
def purge_old_audit_events() -> int:
    """Delete audit events older than AUDIT_RETENTION_DAYS (0 keeps them forever); the number
    deleted."""
    days = settings.AUDIT_RETENTION_DAYS
    if not days:
        return 0
    deleted, _ = AuditEvent.objects.filter(
        created_at__lt=timezone.now() - timedelta(days=days)
    ).delete()
    return deleted
