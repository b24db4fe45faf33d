"""The chat's rough edges for a newcomer: a title that follows an edited first question, no
pile of empty conversations, a styled 404, example prompts for the bundled model, a model
picker at the top, links to the console and admin, and a favicon."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from chat import selectors, services
from chat.models import Conversation
from chat.tasks import purge_empty_conversations
from serving.services import deployment_register
from tenants import services as tenant_services
from tenants.models import Plan

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="correct horse battery")


@pytest.fixture
def acme(alice, settings):
    plan = Plan.objects.create(slug="open", name="Open")
    deployment_register(name=settings.SERVED_MODEL_NAME, endpoints=["ipc:///tmp/demo.sock"])
    deployment_register(name="other-chat", endpoints=["ipc:///tmp/other.sock"])
    return tenant_services.tenant_create(slug="acme", name="Acme", plan=plan, owner=alice)


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _conversation(alice, acme, *contents: str) -> Conversation:
    conversation = services.conversation_create(user=alice, tenant=acme)
    for content in contents:
        services.message_send(conversation=conversation, content=content)
    return conversation


def test_the_title_follows_an_edited_first_question(alice, acme):
    conversation = _conversation(alice, acme, "What does json.dumps do?", "And json.loads?")
    first, second = selectors.conversation_messages(conversation=conversation)

    services.message_edit(conversation=conversation, message_id=second.pk, content="Other")
    assert conversation.title == "What does json.dumps do?"  # not the first question
    services.message_edit(conversation=conversation, message_id=first.pk, content="What is re?")
    conversation.refresh_from_db()
    assert conversation.title == "What is re?"


def test_a_title_the_user_chose_stays_after_an_edit(alice, acme):
    conversation = _conversation(alice, acme, "What does json.dumps do?")
    services.conversation_rename(conversation=conversation, title="JSON notes")
    [first] = selectors.conversation_messages(conversation=conversation)
    services.message_edit(conversation=conversation, message_id=first.pk, content="What is re?")
    conversation.refresh_from_db()
    assert conversation.title == "JSON notes"


def test_empty_conversations_are_not_listed_and_are_purged(alice, acme):
    written = _conversation(alice, acme, "hello")
    empty = _conversation(alice, acme)
    assert list(selectors.conversation_list(user=alice, tenant=acme)) == [written]
    # the one open stays in the list while it is still empty
    listed = selectors.conversation_list(user=alice, tenant=acme, keep_id=empty.pk)
    assert set(listed) == {written, empty}

    assert purge_empty_conversations() == 0  # a fresh one may be about to get its message
    Conversation.objects.filter(pk=empty.pk).update(created_at=timezone.now() - timedelta(hours=2))
    assert purge_empty_conversations() == 1
    assert list(Conversation.objects.all()) == [written]


def test_the_purge_spares_an_empty_conversation_a_window_has_open(alice, acme):
    empty = _conversation(alice, acme)
    long_ago = timezone.now() - timedelta(hours=2)
    Conversation.objects.filter(pk=empty.pk).update(created_at=long_ago)
    services.conversation_hold(conversation_id=empty.pk)  # a page shows it now
    assert purge_empty_conversations() == 0
    Conversation.objects.filter(pk=empty.pk).update(opened_at=long_ago)  # closed since
    assert purge_empty_conversations() == 1


def test_the_new_chat_button_creates_nothing(alice, acme):
    page = _client(alice).get("/chat/").content.decode()
    assert 'id="new-chat"' in page and 'href="/chat/"' in page
    assert not Conversation.objects.exists()


def test_an_unknown_conversation_is_a_styled_404(alice, acme, settings):
    settings.DEBUG = True  # as make run serves it: Django would show its debug page
    response = _client(alice).get("/chat/999999/")
    assert response.status_code == 404
    assert 'id="not-found"' in response.content.decode()
    assert "Back to the chat" in response.content.decode()


def test_the_empty_state_offers_the_demo_models_sample_questions(alice, acme):
    page = _client(alice).get("/chat/").content.decode()
    assert 'class="example"' in page and "What does json.dumps do?" in page
    assert page.count('class="example"') <= 4


def test_no_examples_for_a_model_the_platform_knows_nothing_of(alice, acme, settings):
    settings.SERVED_MODEL_NAME = "someone-elses-model"
    assert 'class="example"' not in _client(alice).get("/chat/").content.decode()


def test_the_model_picker_is_at_the_top(alice, acme, settings):
    conversation = _conversation(alice, acme, "hi")
    page = _client(alice).get(f"/chat/{conversation.pk}/").content.decode()
    picker = page[
        page.index('id="model-picker"') : page.index("</select>", page.index('id="model-picker"'))
    ]
    assert settings.SERVED_MODEL_NAME in picker and "other-chat" in picker
    assert page.index('id="model-picker"') < page.index('id="thread"')


def test_links_to_the_console_and_admin_for_those_who_may_open_them(alice, acme, django_user_model):
    page = _client(alice).get("/chat/").content.decode()  # alice owns acme
    assert 'href="/console/"' in page and 'href="/admin/"' not in page
    member = django_user_model.objects.create_user("bob", password="pw-bob-12345")
    tenant_services.membership_set(tenant=acme, user=member, role="member", actor=None)
    assert 'href="/console/"' not in _client(member).get("/chat/").content.decode()


def test_the_favicon(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response["Location"].endswith("favicon.svg")
