"""The cap on a user's empty conversations holds against new chats posted at once, on
PostgreSQL, where each runs in a transaction of its own."""

import contextlib
import threading

import pytest
from django.db import connection

from chat import services
from chat.models import Conversation

pytestmark = pytest.mark.django_db(transaction=True)


def test_new_chats_posted_at_once_stay_under_the_cap(django_user_model, monkeypatch):
    """Each counted the empty ones, then created one: ten tabs opening a chat at once all
    counted nine and all created, and the cap was the number of tabs."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite runs one writing transaction at a time")
    from tenants import services as tenant_services
    from tenants.models import Plan

    alice = django_user_model.objects.create_user("alice", password="x-password-1")
    acme = tenant_services.tenant_create(
        slug="acme", plan=Plan.objects.create(slug="open", name="Open"), owner=alice
    )
    for _ in range(services.MAX_EMPTY_CONVERSATIONS - 1):
        services.conversation_create(user=alice, tenant=acme)
    tabs = 5
    # every tab reaches its insert before any commits, where nothing keeps them apart
    at_the_insert = threading.Barrier(tabs, timeout=2)
    create = Conversation.objects.create

    def create_together(**fields):
        with contextlib.suppress(threading.BrokenBarrierError):
            at_the_insert.wait()  # broken: the others wait on a lock this tab holds
        return create(**fields)

    monkeypatch.setattr(Conversation.objects, "create", create_together)
    failures: list[BaseException] = []

    def open_tab() -> None:
        try:
            services.conversation_create(user=alice, tenant=acme)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=open_tab) for _ in range(tabs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert not failures
    assert Conversation.objects.filter(user=alice).count() == services.MAX_EMPTY_CONVERSATIONS
