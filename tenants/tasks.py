"""Background work on usage: roll-ups for the dashboards and retention of old rows."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from tenants.models import RefusalCount, UsageRecord, UsageRollup
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
