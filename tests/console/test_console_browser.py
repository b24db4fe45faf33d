"""Headless-Chromium screenshots of the tenant dashboard and the platform console with data
in them (test-artifacts/console/). Skips, saying why, without Playwright or Chromium."""

from datetime import UTC, datetime, timedelta

import pytest

from serving.models import ModelDeployment
from tenants import rollups, services
from tenants.models import UsageRecord
from tests.chat.test_browser import CHROMIUM_ARGS, chromium  # noqa: F401  (fixture)
from tests.conftest import ROOT
from tests.gateway.conftest import Daphne
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db(transaction=True)

ARTIFACTS = ROOT / "test-artifacts" / "console"
PASSWORD = "console-pass-123"


def _fill_usage(tenant) -> None:
    keys = [services.api_key_create(tenant=tenant, name=name)[0] for name in ("prod", "staging")]
    now = datetime.now(UTC)
    for n in range(90):
        key = keys[n % 2]
        usage_record_add(
            request_id=f"req-{n}",
            tenant=tenant,
            api_key=key,
            model=("demo-chat", "qwen2.5-7b", "llama-3-8b")[n % 3],
            source=UsageRecord.Source.API,
            status="error" if n % 17 == 0 else "ok",
            started_at=now - timedelta(days=n % 11, hours=n % 5),
            finished_at=now - timedelta(days=n % 11, hours=n % 5),
            prompt_tokens=200 + 13 * n,
            completion_tokens=80 + 7 * (n % 11),
            cached_tokens=n,
            time_to_first_token_ms=40.0 + 9 * (n % 13),
            latency_ms=900.0 + 50 * (n % 9),
        )
    rollups.rollup_pending()


def test_dashboards_in_chromium(chromium, django_user_model, tenant, other_tenant, tmp_path):  # noqa: F811
    sync_api, executable = chromium
    owner = django_user_model.objects.create_user("owner", password=PASSWORD)
    django_user_model.objects.create_user(
        "root", password=PASSWORD, is_staff=True, is_superuser=True
    )
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    _fill_usage(tenant)
    ModelDeployment.objects.create(
        name="demo-chat",
        endpoints=["tcp://10.0.0.5:5555"],
        health="ready",
        replicas={
            "tcp://10.0.0.5:5555": {
                "ready": True,
                "state": "ready",
                "num_requests_running": 7,
                "num_requests_waiting": 2,
                "kv_cache_usage": 0.37,
                "tokens_per_second": 412.5,
            }
        },
    )
    server = Daphne(tmp_path)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=executable, headless=True, args=CHROMIUM_ARGS
            )
            try:
                for username, path, shot in (
                    ("owner", f"/console/t/{tenant.slug}/", "tenant-dashboard.png"),
                    ("root", "/console/platform/", "platform-console.png"),
                ):
                    page = browser.new_page(viewport={"width": 1280, "height": 900})
                    page.goto(f"{server.base}/accounts/login/?next={path}")
                    page.fill("#id_username", username)
                    page.fill("#id_password", PASSWORD)
                    page.click("button[type=submit], input[type=submit]")
                    page.wait_for_url(f"**{path}")
                    assert page.locator("svg.chart").count() >= 1
                    page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
                    text = page.inner_text("main")
                    assert "qwen2.5-7b" in text or "Acme" in text
                    page.close()
            finally:
                browser.close()
    finally:
        server.stop()
    assert (ARTIFACTS / "tenant-dashboard.png").stat().st_size > 10_000
    assert (ARTIFACTS / "platform-console.png").stat().st_size > 10_000
