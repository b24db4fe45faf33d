"""The console's Batches page (status, progress, counts, result files, cancel after a
confirmation) and batch usage in the dashboards, weighed by the plan's batch price factor."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from batches import services as batch_services
from batches.models import Batch
from console import batches_selectors, selectors
from tenants import rollups, services
from tenants.models import AuditEvent, Plan, UsageRecord
from tests.batches.conftest import jsonl, request_line
from tests.console.test_console import people  # noqa: F401 - fixture
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db


def _batch(tenant, num_lines: int = 4) -> Batch:
    file = batch_services.file_create(
        tenant=tenant,
        upload=SimpleUploadedFile(
            "in.jsonl", jsonl([request_line(f"r{n}") for n in range(num_lines)])
        ),
        purpose="batch",
    )
    return batch_services.batch_create(
        tenant=tenant,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )


def _finished(tenant) -> Batch:
    """A batch whose one line completed and one failed, with its output and error files."""
    batch = batch_services.batch_validate(batch=_batch(tenant, num_lines=2))
    first, second = batch.requests.order_by("line_number")
    for request, status in ((first, 200), (second, 400)):
        request_id = f"id-{request.pk}"
        batch_services.batch_request_claim(request=request, request_id=request_id)
        batch_services.batch_request_finish(
            request=request, response={"status_code": status, "request_id": request_id, "body": {}}
        )
    assert batch_services.batch_claim(batch_id=batch.id, runner="r", lease_seconds=60)
    return batch_services.batch_finish(batch=batch, runner="r")


@pytest.fixture
def file_storage_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path


@pytest.fixture
def manager(client, people):  # noqa: F811
    """A client logged in as one of the tenant's admins."""
    client.force_login(people["admin_a"])
    return client


def test_the_page_shows_each_batch_with_progress_counts_and_files(
    manager, tenant, other_tenant, file_storage_dir
):
    running = batch_services.batch_validate(batch=_batch(tenant))
    Batch.objects.filter(pk=running.pk).update(num_completed=2, num_failed=1)
    done = _finished(tenant)
    theirs = _batch(other_tenant)

    response = manager.get(reverse("console:batches", args=[tenant.slug]))

    assert response.status_code == 200
    page = response.content.decode()
    assert running.id in page and done.id in page and theirs.id not in page
    assert 'aria-valuenow="75"' in page and "3 / 4" in page and "2 completed · 1 failed" in page
    assert "job=nightly" in page
    assert reverse("console:batch-cancel", args=[tenant.slug, running.id]) in page
    assert reverse("console:batch-cancel", args=[tenant.slug, done.id]) not in page
    for file_id in (done.output_file_id, done.error_file_id):
        assert reverse("console:batch-file", args=[tenant.slug, file_id]) in page
    assert response.context["refresh_seconds"]  # it follows the running batch


def test_a_result_file_downloads_for_its_tenant_only(
    manager, tenant, other_tenant, file_storage_dir
):
    done = _finished(tenant)
    theirs = _finished(other_tenant)

    response = manager.get(reverse("console:batch-file", args=[tenant.slug, done.output_file_id]))

    assert response.status_code == 200
    assert f'filename="{done.id}_output.jsonl"' in response["Content-Disposition"]
    [line] = b"".join(response.streaming_content).splitlines()
    assert b'"custom_id":"r0"' in line
    for slug, file_id in (
        (tenant.slug, theirs.output_file_id),
        (other_tenant.slug, theirs.output_file_id),
    ):
        assert manager.get(reverse("console:batch-file", args=[slug, file_id])).status_code == 404


def test_cancel_asks_first_then_cancels(manager, tenant, file_storage_dir):
    batch = _batch(tenant)
    url = reverse("console:batch-cancel", args=[tenant.slug, batch.id])

    asked = manager.get(url)
    assert asked.status_code == 200 and b"Cancel the batch" in asked.content
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.VALIDATING

    answered = manager.post(url, follow=True)  # no worker held it: cancelled at once
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.CANCELLED
    assert f"Cancelled {batch.id}." in answered.content.decode()

    again = manager.post(url, follow=True)  # ended already: said so, nothing changes
    assert again.status_code == 200 and "Cannot cancel" in again.content.decode()
    # in the tenant's audit log, once, with who cancelled it
    [event] = AuditEvent.objects.filter(action=AuditEvent.Action.BATCH_CANCELLED)
    assert (event.tenant, event.target_id, event.actor.is_authenticated) == (tenant, batch.id, True)


def test_an_ended_batch_cannot_be_cancelled(manager, tenant, file_storage_dir):
    done = _finished(tenant)

    answered = manager.post(
        reverse("console:batch-cancel", args=[tenant.slug, done.id]), follow=True
    )

    assert "Cannot cancel a batch with status" in answered.content.decode()
    assert Batch.objects.get(pk=done.pk).status == Batch.Status.COMPLETED


def test_another_tenants_batch_is_a_404(client, people, tenant, other_tenant, file_storage_dir):  # noqa: F811
    theirs = _batch(other_tenant)
    client.force_login(people["admin_a"])

    assert (
        client.post(reverse("console:batch-cancel", args=[tenant.slug, theirs.id])).status_code
        == 404
    )
    assert client.get(reverse("console:batches", args=[other_tenant.slug])).status_code == 404
    client.force_login(people["member"])
    assert client.get(reverse("console:batches", args=[tenant.slug])).status_code == 404
    assert Batch.objects.get(pk=theirs.pk).status == Batch.Status.VALIDATING


def _usage(tenant, source: str, tokens: int, n: int, at: datetime | None = None) -> None:
    api_key, _ = services.api_key_create(tenant=tenant, name=f"{source}-{n}")
    now = at or datetime.now(UTC)
    usage_record_add(
        request_id=f"{tenant.slug}-{source}-{n}",
        tenant=tenant,
        api_key=api_key,
        model="m",
        source=source,
        status="ok",
        started_at=now,
        finished_at=now,
        prompt_tokens=tokens // 2,
        completion_tokens=tokens - tokens // 2,
    )


@pytest.mark.parametrize("rolled_up", ["all", "some", "none"])
def test_batch_usage_is_billed_at_the_plans_factor(tenant, other_tenant, rolled_up):
    """Read as the usage report reads: the roll-ups, then the records not rolled up yet. It
    read the roll-ups alone: the panel lagged the totals above it by up to a roll-up's
    period, and said 0 where the roll-up task did not run."""
    tenant.plan.batch_price_factor = Decimal("0.50")
    tenant.plan.save()
    other_plan = Plan.objects.create(slug="full", name="Full", batch_price_factor=Decimal("1"))
    other_tenant.plan = other_plan
    other_tenant.save()
    _usage(tenant, UsageRecord.Source.BATCH, 1000, 1)
    _usage(tenant, UsageRecord.Source.BATCH, 500, 2)
    if rolled_up == "some":
        rollups.rollup_pending()
    _usage(tenant, UsageRecord.Source.API, 300, 3)
    _usage(tenant, UsageRecord.Source.CHAT, 100, 4)
    _usage(other_tenant, UsageRecord.Source.BATCH, 200, 5)
    if rolled_up == "all":
        rollups.rollup_pending()
    today = datetime.now(UTC).date()
    date_range = selectors.DateRange(today, today)

    mine = batches_selectors.batch_usage(date_range=date_range, tenant=tenant)
    everyone = batches_selectors.batch_usage(date_range=date_range)

    assert (mine.batch_requests, mine.batch_tokens, mine.other_tokens) == (2, 1500, 400)
    assert mine.billed_tokens == 400 + 750 and mine.price_factor == Decimal("0.50")
    assert everyone.batch_tokens == 1700 and everyone.billed_tokens == 400 + 750 + 200


@pytest.mark.parametrize("rolled_up", [True, False])
def test_a_plan_change_leaves_past_batch_usage_billed_as_it_was(tenant, rolled_up):
    """Each batch token is billed at the factor of the plan it was used under: the factor
    was read once, from the tenant's plan now, and a move to a dearer plan re-billed every
    earlier day (1,000 batch tokens billed 500 showed 1,000 after it). A plan changed within
    an hour leaves that hour's roll-up billing each record at its own factor."""
    tenant.plan.batch_price_factor = Decimal("0.50")
    tenant.plan.save()
    _usage(tenant, UsageRecord.Source.BATCH, 1000, 1, at=datetime(2024, 3, 10, 9, 5, tzinfo=UTC))
    tenant.plan = Plan.objects.create(slug="full", name="Full", batch_price_factor=Decimal("1"))
    tenant.save()
    _usage(tenant, UsageRecord.Source.BATCH, 200, 2, at=datetime(2024, 3, 10, 9, 40, tzinfo=UTC))
    if rolled_up:
        rollups.rollup_pending()
    day = selectors.DateRange(datetime(2024, 3, 10).date(), datetime(2024, 3, 10).date())

    billed = batches_selectors.batch_usage(date_range=day, tenant=tenant)
    everyone = batches_selectors.batch_usage(date_range=day)

    assert (billed.batch_tokens, billed.billed_tokens) == (1200, 500 + 200)
    assert billed.price_factor is None  # "batch at 100%" would not be what the figure holds
    assert everyone.billed_tokens == 500 + 200


def test_the_dashboards_show_batch_usage_and_group_by_source(client, people, tenant):  # noqa: F811
    _usage(tenant, UsageRecord.Source.BATCH, 1000, 1)
    _usage(tenant, UsageRecord.Source.API, 300, 2)
    rollups.rollup_pending()
    client.force_login(people["admin_a"])

    dashboard = client.get(reverse("console:dashboard", args=[tenant.slug]), {"group": "source"})

    assert dashboard.status_code == 200
    assert dashboard.context["batch_usage"].billed_tokens == 300 + 500
    assert set(dashboard.context["summary"].tokens_by) == {"Batch", "API"}
    assert "batch at 50%" in dashboard.content.decode()
    client.force_login(people["staff"])
    platform = client.get(reverse("console:platform"))
    assert platform.context["batch_usage"].batch_tokens == 1000


def test_metadata_named_like_a_dict_method_shows_as_written(manager, tenant, file_storage_dir):
    """Any key of the tenant's may set a batch's metadata: a key "items" hid the dict's
    method from the template, and the page was a 500 for the tenant's admins."""
    file = batch_services.file_create(
        tenant=tenant,
        upload=SimpleUploadedFile("in.jsonl", jsonl([request_line("r0")])),
        purpose="batch",
    )
    batch_services.batch_create(
        tenant=tenant,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"keys": "y", "items": "x"},
    )

    response = manager.get(reverse("console:batches", args=[tenant.slug]))

    assert response.status_code == 200
    assert "items=x, keys=y" in response.content.decode()


def test_batches_past_the_newest_page_are_on_the_next(
    manager, tenant, file_storage_dir, monkeypatch
):
    """The page showed the newest 50 and nothing older: an older batch could be neither
    cancelled nor downloaded from the console."""
    monkeypatch.setattr(batches_selectors, "PAGE_SIZE", 2)
    oldest, middle, newest = (_batch(tenant, num_lines=1) for _ in range(3))
    url = reverse("console:batches", args=[tenant.slug])

    first = manager.get(url).content.decode()
    second = manager.get(url, {"page": 2}).content.decode()

    assert newest.id in first and middle.id in first and oldest.id not in first
    assert "older →" in first and "page 1 of 2" in first
    assert oldest.id in second and newest.id not in second


def test_a_result_file_whose_bytes_are_gone_is_a_404(manager, tenant, file_storage_dir):
    from batches.storage import file_storage

    done = _finished(tenant)
    file_storage().delete(done.output_file.storage_name)
    url = reverse("console:batch-file", args=[tenant.slug, done.output_file_id])
    assert manager.get(url).status_code == 404
