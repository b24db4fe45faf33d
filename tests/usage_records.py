"""Usage records for tests, written the way a settled request writes them: built by
``usage_record_build``, saved by ``usage_records_save``."""

from tenants import services
from tenants.models import UsageRecord


def usage_record_add(**fields: object) -> UsageRecord:
    """Build and save one record from ``usage_record_build``'s arguments; the stored record
    (the first one, when its ``request_id`` was already there)."""
    record = services.usage_record_build(**fields)
    services.usage_records_save([record])
    return UsageRecord.objects.get(tenant=record.tenant, request_id=record.request_id)
