"""Conversations of end users with the models their tenant's plan allows.

Models stay thin: writes live in ``chat.services``, reads in ``chat.selectors``. Every row
carries its tenant, and a conversation its owner; nobody else ever sees it.
"""

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models import Tenant

DEFAULT_TEMPERATURE = 0.7


class Conversation(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="conversations")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations"
    )
    title = models.CharField(max_length=200, blank=True)
    model = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField(blank=True)
    temperature = models.FloatField(default=DEFAULT_TEMPERATURE)
    # the most tokens a reply may have; None: up to the model's context length
    max_tokens = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # when a window last had it open (renewed while one does): the hourly purge of empty
    # conversations spares one that a page still shows (``chat.tasks``)
    opened_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "user", "-updated_at"], name="chat_conv_recent")]

    def __str__(self) -> str:
        return self.title or f"Conversation {self.pk}"


class Message(models.Model):
    class Role(models.TextChoices):
        USER = "user", "User"
        ASSISTANT = "assistant", "Assistant"

    class Status(models.TextChoices):
        COMPLETE = "complete", "Complete"
        STREAMING = "streaming", "Streaming"
        STOPPED = "stopped", "Stopped"
        ERROR = "error", "Error"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="chat_messages")
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="messages"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COMPLETE)
    # for replies: the engine's finish reason, and why a reply failed
    finish_reason = models.CharField(max_length=16, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    model = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    # a regenerate's or an edit's reply: what it replaces goes only once it holds an answer,
    # and one left streaming by a process that died goes as a failed one would (``chat.services``)
    is_replacement = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["conversation", "id"], name="chat_msg_order")]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:40]}"


class ChatPreference(models.Model):
    """The tenant a user last chose to chat as, so the choice sticks across sessions."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chat_preference"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    updated_at = models.DateTimeField(default=timezone.now)
