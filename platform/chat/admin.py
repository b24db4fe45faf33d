from django.contrib import admin

from chat.models import ChatPreference, Conversation, Message


class MessageInline(admin.TabularInline):
    model = Message
    extra = 0
    fields = ("role", "status", "content", "finish_reason", "error_code", "created_at")
    readonly_fields = fields
    can_delete = False


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ("__str__", "tenant", "user", "model", "updated_at")
    list_filter = ("tenant",)
    search_fields = ("title", "user__username")
    raw_id_fields = ("tenant", "user")
    inlines = [MessageInline]


@admin.register(ChatPreference)
class ChatPreferenceAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "updated_at")
    raw_id_fields = ("user", "tenant")
