from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from chat.models import Conversation
from chat.services import EMPTY_CONVERSATION_GRACE


@shared_task(name="chat.purge_old_conversations")
def purge_old_conversations() -> int:
    """Delete conversations untouched for CHAT_RETENTION_DAYS (0 keeps them forever); the
    number deleted. Their messages go with them."""
    days = settings.CHAT_RETENTION_DAYS
    if not days:
        return 0
    cutoff = timezone.now() - timedelta(days=days)
    deleted, by_model = Conversation.objects.filter(updated_at__lt=cutoff).delete()
    return by_model.get(Conversation._meta.label, 0)


@shared_task(name="chat.purge_empty_conversations")
def purge_empty_conversations() -> int:
    """Delete conversations left without a message for an hour (created, never written in,
    and open in no window for the last hour); the number deleted."""
    cutoff = timezone.now() - EMPTY_CONVERSATION_GRACE
    empty = Conversation.objects.filter(created_at__lt=cutoff, messages__isnull=True).filter(
        Q(opened_at__isnull=True) | Q(opened_at__lt=cutoff)
    )
    deleted, by_model = empty.delete()
    return by_model.get(Conversation._meta.label, 0)
