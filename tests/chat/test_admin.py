"""The chat's admin pages: staff read a conversation and may delete it, as the page does (a
reply it generates stops), in the tenant's audit log under no words of the user's; nobody
moves a conversation to another user or tenant, which nothing checked."""

import pytest
from django.core.cache import cache
from django.urls import reverse

from chat import claims, services
from chat.models import ChatPreference, Conversation
from tenants import services as tenant_services
from tenants.models import AuditEvent, Plan

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(django_user_model, client):
    plan = Plan.objects.create(slug="open", name="Open")
    alice = django_user_model.objects.create_user("alice", password="x")
    acme = tenant_services.tenant_create(slug="acme", plan=plan, owner=alice)
    globex = tenant_services.tenant_create(slug="globex", plan=plan, owner=alice)
    conversation = services.conversation_create(user=alice, tenant=acme, title="my diagnosis")
    root = django_user_model.objects.create_superuser("root", "", "pw-root-123")
    client.force_login(root)
    return {"alice": alice, "acme": acme, "globex": globex, "conversation": conversation}


def test_staff_read_a_conversation_and_cannot_change_or_move_it(client, world):
    conversation = world["conversation"]
    url = reverse("admin:chat_conversation_change", args=[conversation.pk])
    assert client.get(url).status_code == 200
    assert client.get(reverse("admin:chat_conversation_add")).status_code == 403

    client.post(url, {"tenant": world["globex"].pk, "user": world["alice"].pk, "title": "moved"})

    conversation.refresh_from_db()
    assert (conversation.tenant, conversation.title) == (world["acme"], "my diagnosis")


def test_a_deletion_is_audited_and_stops_the_reply(
    client, world, django_capture_on_commit_callbacks
):
    conversation = world["conversation"]
    url = reverse("admin:chat_conversation_delete", args=[conversation.pk])

    with django_capture_on_commit_callbacks(execute=True):
        assert client.post(url, {"post": "yes"}).status_code == 302

    assert not Conversation.objects.filter(pk=conversation.pk).exists()
    assert cache.get(claims.deleted_key(conversation)) is not None  # its reply's holder stops
    [event] = AuditEvent.objects.filter(action=AuditEvent.Action.CONVERSATION_DELETED)
    assert event.tenant == world["acme"] and event.actor.username == "root"
    assert event.target_name == f"conversation {conversation.pk} of alice"
    assert "diagnosis" not in event.target_name  # the tenant's admins read the log


def test_a_bulk_deletion_is_audited_each(client, world):
    second = services.conversation_create(user=world["alice"], tenant=world["globex"])
    changelist = reverse("admin:chat_conversation_changelist")
    ids = [world["conversation"].pk, second.pk]

    client.post(changelist, {"action": "delete_selected", "_selected_action": ids, "post": "yes"})

    assert not Conversation.objects.exists()
    events = AuditEvent.objects.filter(action=AuditEvent.Action.CONVERSATION_DELETED)
    assert sorted(e.tenant.slug for e in events) == ["acme", "globex"]


def test_a_users_chosen_tenant_is_not_changed_in_the_admin(client, world):
    services.preference_set_tenant(user=world["alice"], tenant=world["acme"])
    preference = ChatPreference.objects.get(user=world["alice"])

    page = client.get(reverse("admin:chat_chatpreference_change", args=[preference.pk]))

    assert page.status_code == 200 and b'name="_save"' not in page.content  # read only
    assert client.get(reverse("admin:chat_chatpreference_add")).status_code == 403
