"""What the chat page shows and sends, in headless Chromium, when frames arrive in an awkward
order: the real page as the view renders it, its scripts from platform/chat/static, and a fake
WebSocket in place of the server's, whose frames a test delivers by hand (another window's
edit, a socket that drops before its answer, a sync after reconnecting).

Skips like tests/chat/test_browser.py when Playwright or a Chromium binary is missing.
"""

from dataclasses import dataclass

import pytest

from chat import services
from chat.payloads import message_payload, settings_payload
from tests.chat.test_browser import CHROMIUM_ARGS, chromium  # noqa: F401  (fixture)
from tests.chat.test_views import acme, alice, login, models, plan  # noqa: F401  (fixtures)
from tests.conftest import ROOT

STATIC = ROOT / "platform" / "chat" / "static"
TIMEOUT_MS = 10_000

# Runs before the page's scripts: a WebSocket that opens at once, records what the page sends
# (window.__sent) and takes frames from deliver(); drop() closes it as a lost connection does.
# fetch records its calls (window.__posts) and never answers.
FAKES = """
window.__sent = [];
window.__sockets = [];
window.__posts = [];
class FakeSocket extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.readyState = 0;
    window.__sockets.push(this);
    setTimeout(() => { this.readyState = 1; this.dispatchEvent(new Event('open')); }, 0);
  }
  send(data) { window.__sent.push(JSON.parse(data)); }
  close() {}
}
FakeSocket.OPEN = 1;
window.WebSocket = FakeSocket;
window.deliver = function (frame) {
  const socket = window.__sockets[window.__sockets.length - 1];
  socket.dispatchEvent(new MessageEvent('message', { data: JSON.stringify(frame) }));
};
window.drop = function () {
  const socket = window.__sockets[window.__sockets.length - 1];
  socket.readyState = 3;
  const event = new Event('close');
  event.code = 1006;
  socket.dispatchEvent(event);
};
window.fetch = function (url, options) {
  window.__posts.push(String(url));
  return new Promise(() => {});
};
"""


@dataclass
class ChatPage:
    """The page of a conversation with one exchange, ``question`` then ``answer`` (as the
    server sends messages), its socket open."""

    page: object
    conversation_id: int
    question: dict
    answer: dict
    settings: dict

    def deliver(self, frame: dict) -> None:
        self.page.evaluate("(frame) => deliver(frame)", frame)

    def sent(self, frame_type: str) -> list[dict]:
        return [f for f in self.page.evaluate("window.__sent") if f["type"] == frame_type]

    def reconnect(self) -> None:
        """The socket drops (the server's answers to what was sent are lost) and the page
        opens a new one, which asks for a sync."""
        syncs = len(self.sent("sync"))
        self.page.evaluate("drop()")
        self.page.wait_for_function(
            "(syncs) => window.__sent.filter((f) => f.type === 'sync').length > syncs", arg=syncs
        )

    def sync(self, *messages: dict) -> None:
        self.deliver(
            {
                "type": "sync",
                "messages": list(messages),
                "settings": self.settings,
                "generating": None,
            }
        )


def _user_message(message_id: int, content: str) -> dict:
    return {
        "id": message_id,
        "role": "user",
        "content": content,
        "status": "complete",
        "finish_reason": "",
        "error_code": "",
        "error_message": "",
        "model": "",
    }


def _reply(message_id: int, content: str, status: str = "complete") -> dict:
    return {**_user_message(message_id, content), "role": "assistant", "status": status}


def _serve(page, html: str) -> None:
    """Every page request answers ``html``; the page's static files come from the checkout."""

    def answer(route):
        url = route.request.url
        if "/static/" not in url:
            route.fulfill(body=html, content_type="text/html")
            return
        path = STATIC / url.split("/static/", 1)[1]
        kind = "text/css" if path.suffix == ".css" else "application/javascript"
        route.fulfill(body=path.read_bytes(), content_type=kind)

    page.route("**/*", answer)


@pytest.fixture
def headless(chromium):  # noqa: F811
    """A Chromium page with the fakes in place, and the script errors it raised (none, at the
    end of each test)."""
    sync_api, executable = chromium
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.add_init_script(FAKES)
        yield page
        browser.close()
        assert errors == []


@pytest.fixture
def rendered(alice, acme):  # noqa: F811
    """A conversation's page as the view renders it, rendered before Chromium starts (Django
    refuses ORM calls beside Playwright's event loop)."""
    conversation = services.conversation_create(user=alice, tenant=acme, model="small-chat")
    services.conversation_rename(conversation=conversation, title="Old title")
    question = services.message_send(conversation=conversation, content="Original question")
    answer = services.reply_start(conversation=conversation, request_id="r1")
    services.reply_finish(message=answer, content="An answer", status="complete")
    answer.refresh_from_db()
    html = login(alice).get(f"/chat/{conversation.pk}/").content.decode()
    return html, conversation, message_payload(question), message_payload(answer)


@pytest.fixture
def chat_page(rendered, headless) -> ChatPage:
    html, conversation, question, answer = rendered
    _serve(headless, html)
    headless.goto(f"http://testserver/chat/{conversation.pk}/")
    headless.wait_for_function("window.__sent.some((f) => f.type === 'sync')")
    return ChatPage(headless, conversation.pk, question, answer, settings_payload(conversation))


def test_max_tokens_written_as_an_exponent_or_a_fraction_is_read_as_a_number(chat_page):
    """The field was read with parseInt: "1e3" went out as max_tokens 1 and "2.5" as 2,
    silently. Now 1e3 is 1000, and a fraction is refused in the banner, sending nothing."""
    page = chat_page.page
    page.click("#toggle-settings")
    page.fill("#setting-max-tokens", "1e3")
    page.press("#setting-max-tokens", "Tab")
    page.wait_for_function("window.__sent.some((f) => f.type === 'settings')")
    assert chat_page.sent("settings") == [{"type": "settings", "max_tokens": 1000}]

    page.fill("#setting-max-tokens", "2.5")
    page.press("#setting-max-tokens", "Tab")
    assert "Max tokens must be a whole number" in page.inner_text("#banner-text")
    page.fill("#input", "Hello")
    page.press("#input", "Enter")  # settings waiting for a pause go out before a send
    assert chat_page.sent("send") == [{"type": "send", "content": "Hello"}]
    assert chat_page.sent("settings") == [{"type": "settings", "max_tokens": 1000}]


def test_a_title_cleared_in_another_window_is_cleared_in_the_sidebar_and_the_tab(chat_page):
    """A relayed rename to the empty title changed the header only: the sidebar and the
    browser tab went on showing the old title (only a non-empty title was applied there)."""
    page = chat_page.page
    chat_page.deliver({"type": "settings", "settings": {"title": ""}, "relayed": True})
    item = f'.conversation-item[data-id="{chat_page.conversation_id}"]'
    assert page.inner_text("#conversation-title") == "New conversation"
    assert page.inner_text(f"{item} .conversation-link") == "New conversation"
    assert page.get_attribute(item, "data-title") == ""
    assert page.title() == "New conversation · LLM Platform"


def test_an_open_edit_ends_when_another_window_edits_the_message(chat_page):
    """A message being edited here and edited in another window showed the other window's
    text, but stayed marked as being edited: its Edit button did nothing from then on, and
    later syncs passed it by."""
    page = chat_page.page
    question_id, answer_id = chat_page.question["id"], chat_page.answer["id"]
    page.click(".message.user .edit")
    assert page.is_visible(".edit-area")
    edited = _user_message(question_id, "Edited elsewhere")
    chat_page.deliver({"type": "message", "message": edited, "relayed": True})
    chat_page.deliver(
        {"type": "start", "message_id": answer_id + 1, "after_id": question_id, "relayed": True}
    )
    new_answer = _reply(answer_id + 1, "A new answer")
    chat_page.deliver(
        {
            "type": "done",
            "message_id": answer_id + 1,
            "status": "complete",
            "finish_reason": "stop",
            "usage": {},
            "message": new_answer,
            "relayed": True,
        }
    )
    assert page.inner_text(".message.user .body") == "Edited elsewhere"
    assert page.locator(".edit-area").count() == 0

    page.click(".message.user .edit")
    assert page.input_value(".edit-area") == "Edited elsewhere"
    page.click(".edit-row .ghost")  # cancel
    chat_page.sync(_user_message(question_id, "Edited again"), new_answer)
    assert page.inner_text(".message.user .body") == "Edited again"


def test_an_edit_lost_with_the_socket_shows_the_saved_text_after_reconnecting(chat_page):
    """An edit sent just before the socket dropped (never read by the server) kept showing
    after the reconnect's sync, which held the original: the page compared the sync with the
    text before the edit, found it unchanged, and left the unsaved edit on screen."""
    page = chat_page.page
    page.click(".message.user .edit")
    page.fill(".edit-area", "Edited, never saved")
    page.click(".edit-row .primary")
    assert chat_page.sent("edit") == [
        {"type": "edit", "message_id": chat_page.question["id"], "content": "Edited, never saved"}
    ]
    chat_page.reconnect()
    chat_page.sync(chat_page.question, chat_page.answer)
    assert page.inner_text(".message.user .body") == "Original question"


def test_an_edit_saved_before_the_socket_dropped_shows_after_reconnecting(chat_page):
    """The other outcome of the test above: the edit the server saved shows, with the reply
    it started in place of the old one."""
    page = chat_page.page
    page.click(".message.user .edit")
    page.fill(".edit-area", "Edited and saved")
    page.click(".edit-row .primary")
    chat_page.reconnect()
    question = {**chat_page.question, "content": "Edited and saved"}
    chat_page.sync(question, _reply(chat_page.answer["id"] + 1, "", "stopped"))
    assert page.inner_text(".message.user .body") == "Edited and saved"
    assert page.locator(".message.assistant").count() == 1


def test_a_message_saved_before_the_socket_dropped_leaves_the_composer(chat_page):
    """A message the server saved just before the socket dropped stayed in the composer (only
    its own "message" frame, lost with the socket, emptied it), so the next Enter sent it a
    second time."""
    page = chat_page.page
    page.fill("#input", "Follow-up")
    page.press("#input", "Enter")
    chat_page.reconnect()
    answer_id = chat_page.answer["id"]
    chat_page.sync(
        chat_page.question,
        chat_page.answer,
        _user_message(answer_id + 1, "Follow-up"),
        _reply(answer_id + 2, "", "stopped"),
    )
    assert page.input_value("#input") == ""
    assert page.locator(".message.user .body").all_inner_texts() == [
        "Original question",
        "Follow-up",
    ]


def test_a_message_lost_with_the_socket_stays_in_the_composer_to_send_again(chat_page):
    """The other outcome: a message the server never read stays in the composer after the
    reconnect's sync, and Enter sends it again (a send still waiting for its answer blocks a
    second one, so the lost one must not wait for ever)."""
    page = chat_page.page
    page.fill("#input", "Follow-up")
    page.press("#input", "Enter")
    chat_page.reconnect()
    chat_page.sync(chat_page.question, chat_page.answer)
    assert page.input_value("#input") == "Follow-up"
    page.press("#input", "Enter")
    assert chat_page.sent("send") == [{"type": "send", "content": "Follow-up"}] * 2


def test_a_double_enter_or_a_double_click_sends_the_message_once(chat_page):
    """A second Enter (or click on Send) before the server answered the first sent the message
    again: the composer checked only for a reply being generated, which shows only once the
    server has started one."""
    page = chat_page.page
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    page.press("#input", "Enter")
    assert chat_page.sent("send") == [{"type": "send", "content": "Hello"}]

    answer_id = chat_page.answer["id"]
    chat_page.deliver({"type": "message", "message": _user_message(answer_id + 1, "Hello")})
    assert page.input_value("#input") == ""
    page.fill("#input", "Again")
    page.dblclick("#send")
    assert chat_page.sent("send") == [
        {"type": "send", "content": "Hello"},
        {"type": "send", "content": "Again"},
    ]


@pytest.fixture
def home_html(alice, acme) -> str:  # noqa: F811
    """The page without a conversation, rendered before Chromium starts."""
    return login(alice).get("/chat/").content.decode()


def test_a_double_enter_on_the_empty_page_starts_one_conversation(home_html, headless):
    """On the page without a conversation the first message creates one: a second Enter while
    that request was out created a second conversation."""
    _serve(headless, home_html)
    headless.goto("http://testserver/chat/")
    headless.fill("#input", "Hello")
    headless.press("#input", "Enter")
    headless.press("#input", "Enter")
    assert headless.evaluate("window.__posts") == ["http://testserver/chat/new/"]
