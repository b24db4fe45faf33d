from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import Conversation, Message
from chat.tasks import purge_old_conversations
from config import celery_app

pytestmark = pytest.mark.django_db


def test_old_conversations_are_purged_by_the_task(user, tenant, settings):
    old = Conversation.objects.create(tenant=tenant, user=user, title="old", model="m")
    Message.objects.create(conversation=old, tenant=tenant, role="user", content="hi")
    Conversation.objects.filter(pk=old.pk).update(updated_at=timezone.now() - timedelta(days=40))
    fresh = Conversation.objects.create(tenant=tenant, user=user, title="fresh", model="m")

    celery_app.conf.task_always_eager = True
    try:
        settings.CHAT_RETENTION_DAYS = 0
        assert purge_old_conversations.delay().get() == 0
        settings.CHAT_RETENTION_DAYS = 30
        assert purge_old_conversations.delay().get() == 1
    finally:
        celery_app.conf.task_always_eager = False
    assert list(Conversation.objects.all()) == [fresh]
    assert not Message.objects.filter(conversation_id=old.pk).exists()
