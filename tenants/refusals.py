"""Counting requests refused before admission, per hour (``RefusalCount``)."""

from datetime import UTC, datetime

from django.db.models import F
from django.utils import timezone

from tenants.models import RefusalCount


def refusal_record(
    *,
    tenant_id: int,
    code: str,
    source: str,
    api_key_id: int | None = None,
    model: str = "",
    at: datetime | None = None,
) -> None:
    """Count one refusal in its hour: one UPDATE, and an INSERT for an hour's first."""
    hour = (at or timezone.now()).astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    group = {
        "tenant_id": tenant_id,
        "api_key_id": api_key_id,
        "model": model,
        "source": source,
        "code": code,
        "hour": hour,
    }
    if not RefusalCount.objects.filter(**group).update(count=F("count") + 1):
        RefusalCount.objects.create(**group, count=1)
