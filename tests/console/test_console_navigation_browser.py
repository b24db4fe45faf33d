"""The console as a newcomer meets it, in headless Chromium: a staff user reaches a tenant's
usage, keys and members from /console/ by clicking only; the dashboard shows a request
finished a second ago; destructive actions ask first and cancelling changes nothing; the new
key copies; the pages fit a 390 px phone. Screenshots at 1280 and 390 px go to
test-artifacts/console/. Skips, saying why, without Playwright or Chromium."""

from datetime import UTC, datetime, timedelta

import pytest

from serving.models import ModelDeployment
from tenants import rollups, services
from tenants.models import ApiKey, Membership, UsageRecord
from tests.chat.test_browser import CHROMIUM_ARGS, _in_thread, chromium  # noqa: F401  (fixture)
from tests.conftest import ROOT
from tests.gateway.conftest import Daphne
from tests.usage_records import usage_record_add

pytestmark = pytest.mark.django_db(transaction=True)

ARTIFACTS = ROOT / "test-artifacts" / "console"
PASSWORD = "console-pass-123"
TIMEOUT_MS = 30_000


def _record(tenant, key, n: int, started_at: datetime) -> None:
    usage_record_add(
        request_id=f"req-{n}", tenant=tenant, api_key=key, model="demo-chat",
        source=UsageRecord.Source.API, status="ok", started_at=started_at,
        finished_at=started_at + timedelta(milliseconds=900), prompt_tokens=1200,
        completion_tokens=40, time_to_first_token_ms=60.0 + n, latency_ms=900.0 + 10 * n,
    )  # fmt: skip


@pytest.fixture
def world(django_user_model, tenant):
    staff = django_user_model.objects.create_user(
        "root", password=PASSWORD, is_staff=True, is_superuser=True
    )
    member = django_user_model.objects.create_user("bob", password=PASSWORD)
    services.membership_set(tenant=tenant, user=member, role="member", actor=None)
    key = services.api_key_create(tenant=tenant, name="prod")[0]
    now = datetime.now(UTC)
    for n in range(12):
        _record(tenant, key, n, now - timedelta(hours=n + 1))
    rollups.rollup_pending()  # the past is rolled up...
    _record(tenant, key, 99, datetime.now(UTC) - timedelta(seconds=1))  # ...this one is not
    ModelDeployment.objects.create(
        name="demo-chat", endpoints=["tcp://10.0.0.5:5555"], health="ready",
        replicas={"tcp://10.0.0.5:5555": {"ready": True, "state": "ready"}},
    )  # fmt: skip
    return {"staff": staff, "member": member, "key": key}


@pytest.fixture
def browser(chromium, tmp_path):  # noqa: F811
    sync_api, executable = chromium
    server = Daphne(tmp_path)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=executable, headless=True, args=CHROMIUM_ARGS
            )
            try:
                yield browser, server.base
            finally:
                browser.close()
    finally:
        server.stop()


def _signed_in(browser, base: str, width: int):
    context = browser.new_context(viewport={"width": width, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{base}/console/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_url("**/console/platform/")
    return page


def _dismissing(page, questions: list[str]) -> None:
    def dismiss(dialog) -> None:
        questions.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", dismiss)


def test_a_staff_user_clicks_to_a_tenants_pages_and_nothing_is_destroyed_unasked(
    world, tenant, browser
):
    chromium_browser, base = browser
    page = _signed_in(chromium_browser, base, 1280)
    page.screenshot(path=str(ARTIFACTS / "platform-1280.png"), full_page=True)

    # one click from the platform page to the tenant's usage, then the tenant's nav
    page.click(f"#tenants a[href='/console/t/{tenant.slug}/']")
    page.wait_for_url(f"**/console/t/{tenant.slug}/")
    # 13 requests: 12 rolled up, and the one finished a second ago, read live
    assert page.inner_text("#total-requests") == "13"
    assert "As of" in page.inner_text("main")
    assert page.locator("svg.chart").count() == 6
    page.screenshot(path=str(ARTIFACTS / "dashboard-1280.png"), full_page=True)

    page.click("header nav >> text=API keys")
    page.wait_for_url(f"**/console/t/{tenant.slug}/keys/")
    questions: list[str] = []
    _dismissing(page, questions)
    page.click("button:has-text('Revoke')")
    assert questions and "Revoke" in questions[0]
    assert _in_thread(lambda: ApiKey.objects.get(pk=world["key"].pk).revoked_at) is None

    page.fill("input[name=name]", "ci")
    page.click("button:has-text('Create key')")
    page.wait_for_selector("#new-key")
    assert "Created the key" in page.inner_text("main")
    page.click("#copy-key")
    page.wait_for_function("() => document.getElementById('copy-key').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == page.inner_text("#new-key")

    page.click("header nav >> text=Members")
    page.wait_for_url(f"**/console/t/{tenant.slug}/members/")
    _dismissing(page, questions)
    page.click("tr:has-text('bob') button:has-text('Remove')")
    assert "Remove bob" in questions[-1]
    assert _in_thread(Membership.objects.filter(user=world["member"], tenant=tenant).exists)
    page.click("button:has-text('Make an invitation link')")
    page.wait_for_selector("#new-link")
    page.click("#copy-link")
    page.wait_for_function("() => document.getElementById('copy-link').textContent === 'Copied'")
    link = page.evaluate("navigator.clipboard.readText()")
    assert link == page.inner_text("#new-link") and "/console/join/inv_" in link

    page.click("header nav >> text=Platform")
    page.wait_for_url("**/console/platform/")
    for button in ("Unload", "Disable"):
        _dismissing(page, questions)
        page.click(f"button:has-text('{button}')")
        assert button in questions[-1]
    assert _in_thread(lambda: ModelDeployment.objects.get(name="demo-chat").is_enabled)
    assert len(questions) == 4

    # and the one the user means goes through, with a message
    page.click(f"#tenants a[href='/console/t/{tenant.slug}/keys/']")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("tr:has-text('prod') button:has-text('Revoke')")
    page.wait_for_selector(".msg.success")
    assert _in_thread(lambda: ApiKey.objects.get(pk=world["key"].pk).revoked_at) is not None


def test_the_console_fits_a_phone(world, tenant, browser):
    chromium_browser, base = browser
    page = _signed_in(chromium_browser, base, 390)
    for path, shot in (
        ("/console/platform/", "platform-390.png"),
        (f"/console/t/{tenant.slug}/", "dashboard-390.png"),
        (f"/console/t/{tenant.slug}/keys/", "keys-390.png"),
    ):
        page.goto(f"{base}{path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
        assert width <= 390, (path, width)


def test_the_pickers_work_under_the_content_security_policy(world, tenant, browser):
    """The pages' policy runs no inline handler: the tenant picker and a member's role picker
    were ``onchange`` attributes, and would have done nothing."""
    chromium_browser, base = browser
    page = _signed_in(chromium_browser, base, 1280)
    violations: list[str] = []
    page.on(
        "console",
        lambda message: (
            violations.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    page.reload()

    page.select_option("#tenant-switcher", f"/console/t/{tenant.slug}/")
    page.wait_for_url(f"**/console/t/{tenant.slug}/")
    page.click("header nav >> text=Members")
    page.wait_for_url(f"**/console/t/{tenant.slug}/members/")
    page.select_option("tr:has-text('bob') select[name=role]", "admin")
    page.wait_for_selector(".msg.success")
    membership = _in_thread(lambda: Membership.objects.get(user=world["member"], tenant=tenant))
    assert membership.role == "admin"
    assert violations == []
