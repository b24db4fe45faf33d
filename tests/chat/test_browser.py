"""End to end in headless Chromium (Debian's ``chromium``, driven by Playwright for Python):
sign in, start a conversation, watch the reply stream, stop it, reload and find the
conversation saved; Markdown stays inert. Screenshots go to test-artifacts/chat/.

Skips, saying why, when Playwright or a Chromium binary is missing (``make test`` installs
both when it can: Playwright from requirements-test.txt, Chromium with
scripts/ensure_chromium.sh when running as root).
"""

import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connections

from chat import services as chat_services
from serving.services import deployment_register
from tenants import services
from tenants.models import Plan, Tenant
from tests.chat.conftest import MODEL_NAME, engine_paused
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

ARTIFACTS = ROOT / "test-artifacts" / "chat"
PASSWORD = "correct horse battery"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000
MALICIOUS = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script>'


def chromium_path() -> str | None:
    candidates = [os.environ.get("CHROMIUM_PATH"), "/usr/bin/chromium"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser")]
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture
def chromium():
    """(Playwright's sync API, the Chromium binary), or a skip that says what is missing;
    checked first, so that a skip costs no server start."""
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="Playwright for Python is not installed (pip install -r requirements-test.txt)",
    )
    executable = chromium_path()
    if executable is None:
        pytest.skip(
            "No Chromium binary: install Debian's chromium (scripts/ensure_chromium.sh as root) "
            "or set CHROMIUM_PATH"
        )
    return sync_api, executable


@pytest.fixture
def browser(chromium, live_chat):
    """Chromium, started after the database is set up and stopped before it is flushed:
    Playwright's sync API runs an event loop, and Django refuses ORM calls beside one."""
    sync_api, executable = chromium
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(
                executable_path=executable, headless=True, args=CHROMIUM_ARGS
            )
        except sync_api.Error as exc:
            pytest.skip(f"Chromium at {executable} would not start: {exc}")
        yield browser
        browser.close()


@pytest.fixture
def live_chat(daphne_server, ready_engine, django_user_model):
    plan = Plan.objects.create(slug="open", name="Open")
    alice = django_user_model.objects.create_user("alice", password=PASSWORD)
    services.tenant_create(slug="acme", name="Acme", plan=plan, owner=alice)
    deployment_register(name=MODEL_NAME, endpoints=[ready_engine.endpoint])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return daphne_server


def _in_thread(work):
    """Run ORM work beside Playwright's event loop, on a thread of its own."""

    def run():
        try:
            return work()
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def _reply_text(page) -> str:
    return page.locator(".message.assistant .body").last.inner_text()


def _run_engine_until(page, engine, condition, slice_seconds: float = 0.01) -> None:
    """Inside ``engine_paused``: let the engine run in slices until ``condition()`` holds on
    the page, and leave it paused."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not condition():
        assert time.monotonic() < deadline, "the page never showed it"
        engine.process.send_signal(signal.SIGCONT)
        time.sleep(slice_seconds)
        engine.process.send_signal(signal.SIGSTOP)
        page.wait_for_timeout(50)  # for the page to take what came


def test_sign_in_stream_stop_and_reload(chromium, live_chat, browser, ready_engine):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{live_chat}/chat/")
        assert "/accounts/login/" in page.url
        page.fill("#id_username", "alice")
        page.fill("#id_password", PASSWORD)
        _shot(page, "01-sign-in.png")
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_chat}/chat/")
        page.wait_for_selector("#empty-state")

        # A first message from the empty page starts a conversation and streams the reply. The
        # engine is held still from the message on, but for short slices: the tiny random model
        # may end its reply at any token, and a loaded machine's page showed the reply growing
        # only once it had ended.
        page.fill("#input", "Write a long story about a fox")
        page.keyboard.press("Enter")
        page.wait_for_url(f"{live_chat}/chat/*/")
        page.wait_for_selector(".message.user")
        with engine_paused(ready_engine):
            _run_engine_until(page, ready_engine, lambda: len(_reply_text(page).strip()) > 0)
            first = len(_reply_text(page))
            _run_engine_until(page, ready_engine, lambda: len(_reply_text(page)) > first)
            assert page.is_visible("#stop") and not page.is_visible("#send")
            _shot(page, "02-streaming.png")
            page.click("#stop")
            page.wait_for_selector(".message.assistant .badge.stopped")
        page.wait_for_selector("#send", state="visible")
        stopped_text = _reply_text(page).strip()
        assert stopped_text
        _shot(page, "03-stopped.png")

        page.reload()
        page.wait_for_selector(".message.assistant .badge.stopped")
        page.wait_for_function("() => document.body.dataset.socket === 'open'")
        assert page.locator(".message.user .body").first.inner_text() == (
            "Write a long story about a fox"
        )
        assert _reply_text(page).strip() == stopped_text
        assert "Write a long story about a fox" in page.inner_text(".conversation-item.active")
        assert page.inner_text("#conversation-title") == "Write a long story about a fox"
        _shot(page, "04-reloaded.png")

        # Settings apply to the next reply: a short one, regenerated in place of the stopped.
        page.click("#toggle-settings")
        assert page.locator("#model-picker option").all_inner_texts() == [MODEL_NAME]
        page.fill("#setting-system", "You are a poet.")
        page.fill("#setting-max-tokens", "12")
        page.press("#setting-max-tokens", "Tab")
        page.wait_for_function(
            "() => document.getElementById('settings-status').textContent.startsWith('Saved')"
        )
        # A slider stepped with the keyboard fires a change at every step: the page saves the
        # last value once it pauses, inside the socket's frame budget (20 at once).
        page.focus("#setting-temperature")
        for _ in range(30):
            page.keyboard.press("ArrowRight")
        stepped = float(page.input_value("#setting-temperature"))
        assert stepped > 1.0

        def saved_temperature() -> float:
            from chat.models import Conversation

            return Conversation.objects.filter(user__username="alice").latest("pk").temperature

        for _ in range(50):
            if _in_thread(saved_temperature) == pytest.approx(stepped):
                break
            page.wait_for_timeout(100)
        assert _in_thread(saved_temperature) == pytest.approx(stepped)
        assert page.locator("#banner").is_hidden()
        page.click(".message.assistant .regenerate")
        page.wait_for_selector(".message.assistant[data-status=complete]")
        assert page.locator(".message.assistant").count() == 1
        assert page.locator(".message.assistant .copy-reply").count() == 1
        _shot(page, "05-settings-regenerated.png")
        page.click("#toggle-settings")

        # Neither the user's text nor Markdown from a model can run script.
        page.fill("#input", MALICIOUS)
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.querySelectorAll('.message.user').length === 2")
        page.wait_for_selector(".message.assistant[data-status=complete] >> nth=1")
        assert page.locator(".message.user .body").last.inner_text() == MALICIOUS
        rendered = page.evaluate(
            """(source) => {
                const el = document.createElement('div');
                el.id = 'markdown-probe';
                document.body.append(el);
                ChatMarkdown.render(el, source);
                const all = [...el.querySelectorAll('*')];
                return {
                    text: el.textContent,
                    dangerous: el.querySelectorAll('script, iframe, img, object, embed').length,
                    handlers: all.flatMap((n) => [...n.attributes])
                        .filter((a) => a.name.startsWith('on')).length,
                    scriptLinks: all.filter((n) => /^\\s*javascript:/i.test(
                        n.getAttribute('href') || '')).length,
                    hrefs: [...el.querySelectorAll('a[href]')].map((a) => a.getAttribute('href')),
                    copyButtons: el.querySelectorAll('.code-block .copy-code').length,
                };
            }""",
            MALICIOUS + "\n\n[click](javascript:window.__pwned=3)\n\n<iframe src=x></iframe>\n\n"
            "```python\nprint('hi')\n```\n\n[web](https://example.com/) [mail](mailto:a@b.c) "
            "[here](/admin/) [file](ftp://example.com/x) [data](data:text/html,hi)\n",
        )
        assert rendered["dangerous"] == rendered["handlers"] == rendered["scriptLinks"] == 0
        # links lead to the web or to mail only, never to a page of this site dressed up
        assert rendered["hrefs"] == ["https://example.com/", "mailto:a@b.c"]
        assert "<img src=x" in rendered["text"]  # raw HTML is shown as text
        assert rendered["copyButtons"] == 1 and "print('hi')" in rendered["text"]
        page.wait_for_timeout(300)
        assert page.evaluate("() => window.__pwned") is None
        assert page.locator(".message img").count() == 0
        _shot(page, "06-sanitised.png")
        page.evaluate("() => document.getElementById('markdown-probe').remove()")

        # A quota refusal says why and when to retry.
        _in_thread(lambda: Tenant.objects.filter(slug="acme").update(requests_per_minute=1))
        page.fill("#input", "One more, please")  # admitted: the first of this minute
        page.keyboard.press("Enter")
        page.wait_for_selector(".message.assistant[data-status=complete] >> nth=2")
        page.fill("#input", "And another")
        page.keyboard.press("Enter")
        page.wait_for_selector("#banner:not([hidden])")
        banner = page.inner_text("#banner-text")
        assert "requests per minute" in banner and "retry in" in banner, banner
        assert page.locator(".message.assistant .badge.error").count() == 1
        # one countdown, the banner's: the failed reply shows none of its own
        assert "try again in" not in page.inner_text(".message.assistant .badge.error")
        _shot(page, "07-rate-limited.png")
        assert errors == []
    except Exception:
        _shot(page, "failure.png")
        raise
    finally:
        context.close()


_CLOSE_CODE_JS = """(path) => new Promise((resolve) => {
    const socket = new WebSocket('ws://' + location.host + path);
    socket.addEventListener('close', (event) => resolve(event.code));
})"""


def test_a_refused_socket_reaches_the_browser_with_its_close_code(chromium, live_chat, browser):
    """Through Daphne to Chromium: signed out is 4401 and someone else's conversation 4403
    (the codes the page turns into "sign in again" and "no access"), not a bare 1006 that it
    can only answer by reconnecting."""

    def alices_conversation_and_mallory():
        acme = Tenant.objects.get(slug="acme")
        mallory = get_user_model().objects.create_user("mallory", password=PASSWORD)
        services.tenant_create(slug="globex", plan=acme.plan, owner=mallory)
        return chat_services.conversation_create(user=acme.memberships.get().user, tenant=acme)

    conversation = _in_thread(alices_conversation_and_mallory)
    socket_path = f"/ws/chat/{conversation.pk}/"
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(f"{live_chat}/accounts/login/")  # the site's origin, with no session
        assert page.evaluate(_CLOSE_CODE_JS, socket_path) == 4401

        page.fill("#id_username", "mallory")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_chat}/chat/")
        assert page.evaluate(_CLOSE_CODE_JS, socket_path) == 4403
    finally:
        context.close()


def _conversation_with_one_exchange() -> int:
    alice = get_user_model().objects.get(username="alice")
    conversation = chat_services.conversation_create(
        user=alice, tenant=Tenant.objects.get(slug="acme")
    )
    chat_services.conversation_configure(conversation=conversation, max_tokens=200)
    chat_services.message_send(conversation=conversation, content="Original question")
    reply = chat_services.reply_start(conversation=conversation, request_id="chat-seed")
    chat_services.reply_finish(message=reply, content="An answer.", status="complete")
    return conversation.pk


def _signed_in_page(context, base: str, conversation_id: int):
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{base}/chat/{conversation_id}/")
    if "/accounts/login/" in page.url:
        page.fill("#id_username", "alice")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(f"{base}/chat/{conversation_id}/")
    page.wait_for_function("() => document.body.dataset.socket === 'open'")
    return page


def test_what_the_server_refuses_stays_as_the_user_wrote_it(
    chromium, live_chat, browser, ready_engine
):
    """An edit refused (too long) kept showing the refused text as if saved; a message written
    while another window's reply streams was gone from the composer (refused as busy; now the
    window shows that reply streaming, and keeps the message until it can go)."""
    conversation_id = _in_thread(_conversation_with_one_exchange)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    first = _signed_in_page(context, live_chat, conversation_id)
    first.click(".message.user .edit")
    first.fill(".edit-area", "y" * 33_000)  # past the server's 32,000 characters
    first.click(".edit-row .primary")
    first.wait_for_selector("#banner:not([hidden])")
    assert first.locator(".message.user .body").first.inner_text() == "Original question"

    second = _signed_in_page(context, live_chat, conversation_id)
    with engine_paused(ready_engine):
        first.click(".message.assistant .regenerate")
        first.wait_for_selector(".message.assistant[data-status=streaming]")
        second.wait_for_selector(".message.assistant[data-status=streaming]")
        second.fill("#input", "My carefully typed follow-up")
        second.keyboard.press("Enter")
        assert second.is_visible("#stop") and not second.is_visible("#send")
        assert second.input_value("#input") == "My carefully typed follow-up"
    first.wait_for_selector(".message.assistant:not([data-status=streaming])")
    second.wait_for_selector(".message.assistant:not([data-status=streaming])")
    assert second.input_value("#input") == "My carefully typed follow-up"
    context.close()


def test_two_windows_stay_in_step(chromium, live_chat, browser, ready_engine):
    """A second window on a conversation showed the typing dots of a reply streaming in the
    first until it was reloaded, never saw a message sent there, and learned of a deletion
    only when it next sent something."""
    conversation_id = _in_thread(_conversation_with_one_exchange)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    first = _signed_in_page(context, live_chat, conversation_id)
    second = _signed_in_page(context, live_chat, conversation_id)
    with engine_paused(ready_engine):
        first.fill("#input", "Tell me a story")
        first.keyboard.press("Enter")
        second.wait_for_selector(".message.user >> text=Tell me a story")
        second.wait_for_selector(".message.assistant[data-status=streaming]")
        # the text grows in the second window as the first receives it (the engine let run
        # a slice at a time, so the reply is certainly still running after)
        has_text = (
            "() => document.querySelectorAll('.message.assistant')[1]"
            ".querySelector('.body').textContent.length > 0"
        )
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not second.evaluate(has_text):
            assert time.monotonic() < deadline, "no text reached the second window"
            ready_engine.process.send_signal(signal.SIGCONT)
            time.sleep(0.01)
            ready_engine.process.send_signal(signal.SIGSTOP)
            second.wait_for_timeout(200)
        second.click("#stop")  # the stop of a window that is not generating stops the reply
        first.wait_for_selector(".message.assistant[data-status=stopped]")
        second.wait_for_selector(".message.assistant[data-status=stopped]")
    assert _reply_text(second) == _reply_text(first)
    _shot(second, "second-window.png")

    third = _signed_in_page(context, live_chat, conversation_id)  # opened afterwards
    assert _reply_text(third) == _reply_text(first)
    first.on("dialog", lambda dialog: dialog.accept())
    first.click(f'.conversation-item[data-id="{conversation_id}"] .delete-form button')
    second.wait_for_selector("#banner:not([hidden])")
    assert "deleted" in second.inner_text("#banner-text")
    context.close()
