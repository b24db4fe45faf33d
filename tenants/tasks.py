"""Background work on usage: roll-ups for the dashboards and retention of old rows (usage
and the audit log)."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from tenants.invitations import invitations_purge_closed
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
    default); 0 keeps them forever, as the other retentions. A record of this month is kept
    whatever the setting: a monthly budget's counter is built again from them (a setting of
    0 deleted every record, and one under a month, part of what the month had used)."""
    now = timezone.now()
    deleted = {"usage_records": 0, "usage_rollups": 0, "refusal_counts": 0}
    if days := settings.USAGE_RETENTION_DAYS:
        month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        cutoff = min(now - timedelta(days=days), month_start)
        deleted["usage_records"], _ = UsageRecord.objects.filter(started_at__lt=cutoff).delete()
    if days := settings.ROLLUP_RETENTION_DAYS:
        cutoff = now - timedelta(days=days)
        deleted["usage_rollups"], _ = UsageRollup.objects.filter(period_start__lt=cutoff).delete()
        deleted["refusal_counts"], _ = RefusalCount.objects.filter(hour__lt=cutoff).delete()
    return deleted


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


@shared_task(name="tenants.purge_closed_invitations")
def purge_closed_invitations() -> int:
    """Delete invitations used, revoked or expired a while ago (the audit log keeps their
    story); the number deleted."""
    return invitations_purge_closed()
