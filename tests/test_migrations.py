"""Every model change has its migration: one left out (a validator, an audit action's new
choice) is written by the next person's makemigrations, into their unrelated change."""

import importlib
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.apps import apps
from django.core.management import call_command

from tenants import rollups, services
from tenants.models import Plan, UsageRecord, UsageRollup
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db


def test_no_model_change_lacks_its_migration():
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:
        pytest.fail(f"models changed without a migration (exit {exc.code}):\n{out.getvalue()}")


def test_usage_saved_before_records_kept_their_billing_is_billed_at_the_current_plans(
    tenant, other_tenant
):
    """The backfill of 0018: batch tokens at each tenant's plan of now, the rest one a token,
    the roll-ups with their records' sum."""
    other_tenant.plan = Plan.objects.create(slug="full", name="Full", batch_price_factor=1)
    other_tenant.save()
    at = datetime(2024, 3, 10, 9, tzinfo=UTC)
    for n, (owner, source) in enumerate(
        [(tenant, "batch"), (tenant, "api"), (other_tenant, "batch"), (other_tenant, "chat")]
    ):
        key = services.api_key_create(tenant=owner, name=f"k{n}")[0]
        usage_record_add(
            request_id=f"r{n}", tenant=owner, api_key=key, model="m", source=source,
            status="ok", started_at=at, finished_at=at, prompt_tokens=7, completion_tokens=4,
        )  # fmt: skip
    rollups.rollup_pending()
    UsageRecord.objects.update(billed_tokens=0)
    UsageRollup.objects.update(billed_tokens=0)

    backfill = importlib.import_module("tenants.migrations.0018_backfill_billed_tokens")
    backfill.bill_at_the_current_plans(apps, None)

    billed = dict(UsageRecord.objects.values_list("request_id", "billed_tokens"))
    assert billed == {"r0": Decimal("5.50"), "r1": 11, "r2": 11, "r3": 11}
    for period in (UsageRollup.Period.HOUR, UsageRollup.Period.DAY):
        rows = UsageRollup.objects.filter(period=period)
        assert sorted(rows.values_list("billed_tokens", flat=True)) == [
            Decimal("5.50"), 11, 11, 11
        ]  # fmt: skip
