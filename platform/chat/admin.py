"""Staff may read conversations (to answer a support request) and delete one, which the
tenant's audit log records; nobody moves a conversation to another user or tenant here."""

from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest

from chat import services
from chat.models import ChatPreference, Conversation, Message
from tenants.audit_admin import AuditedAdmin
from tenants.models import Tenant


class MessageInline(admin.TabularInline):
    model = Message
    extra = 0
    fields = ("role", "status", "content", "finish_reason", "error_code", "created_at")
    readonly_fields = fields
    can_delete = False


@admin.register(Conversation)
class ConversationAdmin(AuditedAdmin):
    audit_prefix = "conversation"
    audit_verbs = ("deleted",)
    list_display = ("__str__", "tenant", "user", "model", "updated_at")
    list_filter = ("tenant",)
    search_fields = ("title", "user__username")
    raw_id_fields = ("tenant", "user")
    inlines = [MessageInline]

    def audit_tenant(self, obj: Conversation) -> Tenant:
        return obj.tenant

    def audit_name(self, obj: Conversation) -> str:
        # not its title: the user's own words, and the tenant's admins read the log
        return f"conversation {obj.pk} of {obj.user.get_username()}"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def delete_model(self, request: HttpRequest, obj: Conversation) -> None:
        """As the page deletes one: a reply it is generating stops, its windows close."""
        with transaction.atomic():
            self._audit_deleted(request, obj)
            services.conversation_delete(conversation=obj)

    @transaction.atomic
    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for conversation in queryset.select_related("user"):
            self.delete_model(request, conversation)


@admin.register(ChatPreference)
class ChatPreferenceAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "updated_at")
    raw_id_fields = ("user", "tenant")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
