"""The chat pages: sign-in, choosing a tenant, the conversation list, and that nobody sees
another user's or another tenant's conversations."""

import json
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from chat import claims, selectors, services
from chat.models import Conversation, Message
from serving.services import deployment_register
from tenants import services as tenant_services
from tenants.models import Plan

PASSWORD = "correct horse battery"


@pytest.fixture
def plan(db):
    return Plan.objects.create(slug="open", name="Open")


@pytest.fixture
def models(db, plan):
    deployment_register(name="small-chat", endpoints=["ipc:///tmp/small.sock"])
    deployment_register(name="big-chat", endpoints=["ipc:///tmp/big.sock"])
    return ["big-chat", "small-chat"]


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password=PASSWORD)


@pytest.fixture
def acme(plan, alice, models):
    return tenant_services.tenant_create(slug="acme", name="Acme", plan=plan, owner=alice)


def login(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def state_of(response) -> dict:
    content = response.content.decode()
    start = content.index('<script id="chat-state" type="application/json">')
    end = content.index("</script>", start)
    return json.loads(content[content.index(">", start) + 1 : end])


def test_chat_requires_sign_in(client, db):
    response = client.get("/chat/")
    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/chat/"


def test_sign_in_and_out(client, alice, acme):
    assert client.get("/accounts/login/").status_code == 200
    response = client.post("/accounts/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/chat/"
    assert client.get("/chat/").status_code == 200
    response = client.post("/accounts/logout/")
    assert response.status_code == 302 and response["Location"] == "/accounts/login/"
    assert client.get("/chat/").status_code == 302


def test_a_wrong_password_is_refused(client, alice):
    response = client.post("/accounts/login/", {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content


def test_a_user_without_a_tenant_is_told_so(alice):
    response = login(alice).get("/chat/")
    assert response.status_code == 200
    assert b'id="no-tenant"' in response.content
    assert b"not a member of" in response.content


def test_a_user_in_several_tenants_chooses_and_the_choice_sticks(alice, acme, plan):
    globex = tenant_services.tenant_create(slug="globex", name="Globex", plan=plan, owner=alice)
    client = login(alice)
    response = client.get("/chat/")
    assert b'id="choose-tenant"' in response.content
    assert b"Acme" in response.content and b"Globex" in response.content

    response = client.post("/chat/tenant/", {"tenant": globex.pk})
    assert response.status_code == 302
    response = client.get("/chat/")
    assert response.context["tenant"] == globex

    # A new session (another browser, after signing out) remembers the choice.
    assert login(alice).get("/chat/").context["tenant"] == globex
    # Switching back works the same way.
    login(alice).post("/chat/tenant/", {"tenant": acme.pk})
    assert login(alice).get("/chat/").context["tenant"] == acme


def test_a_user_cannot_choose_a_tenant_they_are_not_in(alice, acme, plan):
    other = tenant_services.tenant_create(slug="globex", plan=plan)
    assert login(alice).post("/chat/tenant/", {"tenant": other.pk}).status_code == 404
    assert login(alice).post("/chat/tenant/", {"tenant": "x"}).status_code == 404
    # str.isdigit() says yes to these, int() says no (over 4,300 digits): a 404, not a 500
    for value in ("²", "١٢", str(10**30), "1" * 5000):
        assert login(alice).post("/chat/tenant/", {"tenant": value}).status_code == 404


def test_new_rename_search_and_delete(alice, acme):
    client = login(alice)
    response = client.post("/chat/new/", HTTP_ACCEPT="application/json")
    assert response.status_code == 201
    first = Conversation.objects.get(pk=response.json()["id"])
    assert (first.tenant, first.user, first.model) == (acme, alice, "big-chat")
    response = client.post("/chat/new/", {"model": "small-chat"})
    second = Conversation.objects.exclude(pk=first.pk).get()
    assert response["Location"] == f"/chat/{second.pk}/"
    assert second.model == "small-chat"

    response = client.post(
        f"/chat/{first.pk}/rename/", {"title": "  Trip   to Rome "}, HTTP_ACCEPT="application/json"
    )
    assert response.json() == {"id": first.pk, "title": "Trip to Rome"}
    services.conversation_rename(conversation=second, title="Tax questions")
    for conversation in (first, second):  # an empty conversation is not listed
        conversation.refresh_from_db()
        services.message_send(conversation=conversation, content="hello")

    page = client.get("/chat/", {"q": "rome"})
    assert [c.pk for c in page.context["conversations"]] == [first.pk]
    assert len(client.get("/chat/").context["conversations"]) == 2

    assert client.post(f"/chat/{first.pk}/delete/").status_code == 302
    assert not Conversation.objects.filter(pk=first.pk).exists()
    assert client.get(f"/chat/{first.pk}/").status_code == 404


def test_new_chats_never_written_in_are_few_whatever_is_posted(alice, acme):
    """Each ``POST /chat/new`` made a row, so a script signed in as any user could fill the
    database with empty conversations (the hourly purge takes only those an hour old).
    Past a few, the newest empty one is opened as new again, on the model asked for."""
    client = login(alice)
    ids = [client.post("/chat/new/", HTTP_ACCEPT="application/json").json()["id"] for _ in range(3)]
    assert len(set(ids)) == 3  # a few new chats at once, in tabs of their own, as ever
    for _ in range(services.MAX_EMPTY_CONVERSATIONS + 5):
        response = client.post(
            "/chat/new/", {"model": "small-chat"}, HTTP_ACCEPT="application/json"
        )
        assert response.status_code == 201
    assert Conversation.objects.filter(user=alice).count() == services.MAX_EMPTY_CONVERSATIONS
    # each set up, and left empty
    Conversation.objects.filter(user=alice).update(
        system_prompt="Answer only in French.", temperature=1.9, max_tokens=5
    )
    response = client.post("/chat/new/", {"model": "small-chat"}, HTTP_ACCEPT="application/json")
    reused = Conversation.objects.get(pk=response.json()["id"])
    assert reused.model == "small-chat" and reused.created_at > timezone.now() - timedelta(
        minutes=1
    )
    # a new chat: nothing of what the reopened one was set to
    assert (reused.system_prompt, reused.temperature, reused.max_tokens) == ("", 0.7, None)

    written = Conversation.objects.get(pk=ids[0])
    services.message_send(conversation=written, content="hello")  # no longer empty: a new one
    fresh = client.post("/chat/new/", HTTP_ACCEPT="application/json").json()["id"]
    assert (
        fresh not in ids and Conversation.objects.filter(pk=fresh, messages__isnull=True).exists()
    )


def test_only_models_the_plan_allows_are_offered(alice, acme, plan):
    Plan.objects.filter(pk=plan.pk).update(allowed_models=["small-chat"])
    client = login(alice)
    response = client.get("/chat/")
    assert response.context["models"] == ["small-chat"]
    conversation = Conversation.objects.get(
        pk=client.post("/chat/new/", HTTP_ACCEPT="application/json").json()["id"]
    )
    assert conversation.model == "small-chat"
    response = client.post("/chat/new/", {"model": "big-chat"}, HTTP_ACCEPT="application/json")
    assert response.status_code == 400
    state = state_of(client.get(f"/chat/{conversation.pk}/"))
    assert state["models"] == ["small-chat"]
    assert b'<option value="big-chat"' not in client.get(f"/chat/{conversation.pk}/").content


def test_the_conversation_page_carries_its_messages(alice, acme):
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.message_send(conversation=conversation, content="</script><script>alert(1)</script>")
    response = login(alice).get(f"/chat/{conversation.pk}/")
    assert response.status_code == 200
    # json_script escapes <, > and &: the message cannot close the script element.
    assert b"</script><script>alert(1)" not in response.content
    state = state_of(response)
    assert state["conversation_id"] == conversation.pk
    assert state["messages"][0]["content"] == "</script><script>alert(1)</script>"
    assert state["settings"]["title"] == "</script><script>alert(1)</script>"


def test_a_reply_nobody_is_writing_shows_as_interrupted(alice, acme):
    """A reply saved as streaming while nobody holds the conversation's claim was left by a
    process that died: the page shows it failed (with its actions), not typing forever."""
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.message_send(conversation=conversation, content="Hello?")
    live = services.reply_start(conversation=conversation, request_id="chat-live")
    cache.add(claims.claim_key(conversation), "live-claim", 60)
    streaming = state_of(login(alice).get(f"/chat/{conversation.pk}/"))["messages"][1]
    assert (streaming["id"], streaming["status"]) == (live.pk, "streaming")

    cache.delete(claims.claim_key(conversation))  # its process died: the lease ran out
    interrupted = state_of(login(alice).get(f"/chat/{conversation.pk}/"))["messages"][1]
    assert (interrupted["status"], interrupted["error_code"]) == ("error", "interrupted")


def test_a_reply_started_as_the_page_looks_at_the_claim_is_not_marked_interrupted(
    alice, acme, monkeypatch
):
    """The page finds the claim free, and another window claims the conversation and starts a
    reply before the page marks the replies left streaming: that new reply keeps streaming."""
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.message_send(conversation=conversation, content="Hello?")
    orphan = services.reply_start(conversation=conversation, request_id="chat-orphan")
    started = []
    is_claimed = claims.is_claimed

    def claimed_just_after_the_look(looked_at):
        answer = is_claimed(looked_at)
        if not started:  # the other window, between the look and the marking
            started.append(services.reply_start(conversation=conversation, request_id="chat-new"))
            cache.add(claims.claim_key(conversation), "new-claim", 60)
        return answer

    monkeypatch.setattr(claims, "is_claimed", claimed_just_after_the_look)
    login(alice).get(f"/chat/{conversation.pk}/")
    [live] = started
    statuses = dict(Message.objects.filter(role="assistant").values_list("id", "status"))
    assert statuses == {orphan.pk: "error", live.pk: "streaming"}


def test_nobody_sees_another_users_or_tenants_conversations(alice, acme, plan, django_user_model):
    mine = services.conversation_create(user=alice, tenant=acme, title="Mine")
    bob = django_user_model.objects.create_user("bob", password=PASSWORD)
    tenant_services.membership_set(tenant=acme, user=bob, role="owner", actor=None)
    bobs = services.conversation_create(user=bob, tenant=acme, title="Bob's")
    globex = tenant_services.tenant_create(slug="globex", plan=plan, owner=alice)
    elsewhere = services.conversation_create(user=alice, tenant=globex, title="Elsewhere")
    services.preference_set_tenant(user=alice, tenant=acme)
    for conversation in (mine, bobs, elsewhere):  # an empty conversation is not listed
        services.message_send(conversation=conversation, content="hello")
    client = login(alice)

    assert [c.pk for c in client.get("/chat/").context["conversations"]] == [mine.pk]
    for other in (bobs, elsewhere):
        assert client.get(f"/chat/{other.pk}/").status_code == 404
        assert client.post(f"/chat/{other.pk}/rename/", {"title": "x"}).status_code == 404
        assert client.post(f"/chat/{other.pk}/delete/").status_code == 404
    assert Conversation.objects.filter(pk__in=[bobs.pk, elsewhere.pk]).count() == 2
    assert selectors.conversation_get(user=alice, tenant=acme, conversation_id=bobs.pk) is None
    assert selectors.conversation_list(user=bob, tenant=globex).count() == 0


def test_engine_messages_put_the_system_prompt_first_and_skip_failed_replies(alice, acme):
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.conversation_configure(conversation=conversation, system_prompt="Be brief.")
    services.message_send(conversation=conversation, content="Hi")
    failed = services.reply_start(conversation=conversation, request_id="chat-1")
    services.reply_finish(message=failed, content="", status=Message.Status.ERROR)
    services.reply_prepare_regenerate(conversation=conversation)
    reply = services.reply_start(conversation=conversation, request_id="chat-2")
    services.reply_finish(message=reply, content="Hello!", status=Message.Status.STOPPED)
    services.message_send(conversation=conversation, content="More")
    # failed midway, its partial text saved (and shown): not the model's to read on from
    broken = services.reply_start(conversation=conversation, request_id="chat-3")
    services.reply_finish(message=broken, content="Half an ans", status=Message.Status.ERROR)
    services.message_send(conversation=conversation, content="Go on")
    pending = services.reply_start(conversation=conversation, request_id="chat-4")

    messages = selectors.engine_messages(conversation=conversation, before_id=pending.pk)
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        # one turn: chat templates that want roles to alternate (Llama 2's, Mistral's)
        # refused the two in a row, and every later message of the conversation failed
        ("user", "More\n\nGo on"),
    ]
    assert conversation.title == "Hi"


def test_engine_messages_alternate_after_a_stopped_reply_with_no_text(alice, acme):
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.message_send(conversation=conversation, content="Hi")
    stopped = services.reply_start(conversation=conversation, request_id="chat-1")
    services.reply_finish(message=stopped, content="", status=Message.Status.STOPPED)
    services.message_send(conversation=conversation, content="Hello?")
    pending = services.reply_start(conversation=conversation, request_id="chat-2")

    messages = selectors.engine_messages(conversation=conversation, before_id=pending.pk)

    assert [(m.role, m.content) for m in messages] == [("user", "Hi\n\nHello?")]


def test_the_landing_page_links_to_the_chat(client, db):
    assert b'href="/chat/"' in client.get("/").content


def test_nul_characters_are_dropped_before_saving(alice, acme):
    # PostgreSQL's text fields refuse NUL; a tiny or broken model may well emit one.
    conversation = services.conversation_create(user=alice, tenant=acme)
    message = services.message_send(conversation=conversation, content="a\x00b")
    reply = services.reply_start(conversation=conversation, request_id="chat-nul")
    services.reply_finish(message=reply, content="c\x00d", status=Message.Status.COMPLETE)
    services.conversation_configure(conversation=conversation, system_prompt="e\x00f")
    message.refresh_from_db()
    reply.refresh_from_db()
    conversation.refresh_from_db()
    assert (message.content, reply.content, conversation.system_prompt) == ("ab", "cd", "ef")


def test_deleting_a_conversation_tells_the_holder_of_its_reply(
    alice, acme, django_capture_on_commit_callbacks
):
    """Its reply, if one runs, stops on the mark (chat.claims); a reply that ends before its
    holder looks finds nothing to save (a save would have inserted it again, into nothing)."""
    conversation = services.conversation_create(user=alice, tenant=acme)
    services.message_send(conversation=conversation, content="hi")
    reply = services.reply_start(conversation=conversation, request_id="chat-gone")
    key = claims.deleted_key(conversation)
    with django_capture_on_commit_callbacks(execute=True):
        services.conversation_delete(conversation=conversation)
    assert cache.get(key) is not None
    with pytest.raises(services.ConversationDeleted):
        services.reply_finish(message=reply, content="late", status=Message.Status.COMPLETE)
    assert not Message.objects.filter(pk=reply.pk).exists()


def test_nul_characters_in_a_model_title_or_search_are_refused_or_taken_out(alice, acme):
    client = login(alice)
    response = client.post("/chat/new/", {"model": "big-chat\x00"}, HTTP_ACCEPT="application/json")
    assert response.status_code == 400
    conversation = services.conversation_create(user=alice, tenant=acme, model="big-chat")
    response = client.post(
        f"/chat/{conversation.pk}/rename/", {"title": "a\x00b"}, HTTP_ACCEPT="application/json"
    )
    assert response.json()["title"] == "ab"  # control characters are taken out of a title
    assert client.get("/chat/", {"q": "a\x00"}).status_code == 200


def test_a_conversation_opens_with_the_cache_out_of_reach(alice, acme, monkeypatch):
    """Looking for a reply being generated read the cache unguarded: every conversation
    page was a 500 while Redis was down (the socket says "unavailable" and syncs later)."""
    from django.core.cache import cache
    from redis.exceptions import ConnectionError as RedisConnectionError

    conversation = services.conversation_create(user=alice, tenant=acme, model="small-chat")
    services.message_send(conversation=conversation, content="hi")
    client = login(alice)

    def down(*args, **kwargs):
        raise RedisConnectionError("redis is down")

    monkeypatch.setattr(cache, "get", down)
    response = client.get(f"/chat/{conversation.pk}/")
    assert response.status_code == 200
    assert b"hi" in response.content


def test_settings_refused_in_part_change_nothing_not_even_in_memory(alice, acme):
    """A valid model beside an invalid temperature: the refusal saved nothing, but the
    socket's conversation had its model changed, and its next reply used the unsaved one."""
    conversation = services.conversation_create(user=alice, tenant=acme, model="small-chat")
    before = (conversation.model, conversation.temperature, conversation.system_prompt)
    with pytest.raises(services.ValidationError):
        services.conversation_configure(
            conversation=conversation, model="big-chat", system_prompt="New.", temperature=5
        )
    assert (conversation.model, conversation.temperature, conversation.system_prompt) == before
    conversation.refresh_from_db()
    assert (conversation.model, conversation.temperature, conversation.system_prompt) == before


def test_the_page_holds_no_more_text_than_the_socket_takes(alice, acme):
    """A system prompt past its limit was refused by the socket after it was typed (past
    64 KiB, as a frame too large to read, which told the user nothing)."""
    conversation = services.conversation_create(user=alice, tenant=acme, model="small-chat")
    page = login(alice).get(f"/chat/{conversation.pk}/").content.decode()
    assert f'id="setting-system" rows="5" maxlength="{services.MAX_SYSTEM_PROMPT_CHARS}"' in page
    assert f'id="input" rows="1" maxlength="{services.MAX_CONTENT_CHARS}"' in page


def test_a_regenerate_left_streaming_by_a_dead_process_changes_nothing(alice, acme):
    """A process that died while a regenerate's or an edit's reply ran left that reply beside
    the answer it was to replace (an edit's, answering a text that was never saved): the page
    showed the question, its answer, and an interrupted reply after it. Like a reply that
    fails, it goes, and the conversation is as it was."""
    conversation = services.conversation_create(user=alice, tenant=acme)
    question = services.message_send(conversation=conversation, content="Hello?")
    old = services.reply_start(conversation=conversation, request_id="chat-old")
    services.reply_finish(message=old, content="Hi!", status="complete")
    services.reply_start(conversation=conversation, request_id="chat-dead", is_replacement=True)

    messages = state_of(login(alice).get(f"/chat/{conversation.pk}/"))["messages"]

    assert [(m["id"], m["status"], m["content"]) for m in messages] == [
        (question.pk, "complete", "Hello?"),
        (old.pk, "complete", "Hi!"),
    ]
