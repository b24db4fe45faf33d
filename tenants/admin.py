from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from tenants import services
from tenants.models import ApiKey, Membership, Plan, Tenant, UsageRecord

LIMIT_FIELDSET = (
    "Limits (empty means the plan's value, or no limit on a plan)",
    {
        "fields": (
            "requests_per_minute",
            "tokens_per_minute",
            "max_concurrent_requests",
            "monthly_token_budget",
        )
    },
)


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "slug",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent_requests",
        "monthly_token_budget",
        "is_prefix_cache_isolated",
        "service_tier",
        "share",
    )
    prepopulated_fields = {"slug": ("name",)}
    fieldsets = (
        (None, {"fields": ("name", "slug", "allowed_models", "is_prefix_cache_isolated")}),
        LIMIT_FIELDSET,
        ("Scheduling in the engine", {"fields": ("service_tier", "share")}),
    )


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ("user",)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "plan", "is_active", "created_at")
    list_filter = ("is_active", "plan")
    search_fields = ("slug", "name")
    prepopulated_fields = {"slug": ("name",)}
    fieldsets = ((None, {"fields": ("name", "slug", "plan", "is_active")}), LIMIT_FIELDSET)
    inlines = (MembershipInline,)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("role",)
    search_fields = ("user__username", "tenant__slug")
    autocomplete_fields = ("user", "tenant")


class ApiKeyCreationForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = (
            "tenant",
            "name",
            "expires_at",
            "requests_per_minute",
            "tokens_per_minute",
            "max_concurrent_requests",
            "monthly_token_budget",
        )


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "display_prefix",
        "tenant",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    )
    list_filter = ("tenant",)
    search_fields = ("name", "prefix", "tenant__slug")
    readonly_fields = ("display_prefix", "created_by", "created_at", "last_used_at")
    autocomplete_fields = ("tenant",)
    actions = ("revoke_selected",)

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyCreationForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ApiKeyCreationForm.Meta.fields
        return (
            "tenant",
            "name",
            "display_prefix",
            "created_by",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked_at",
            *ApiKeyCreationForm.Meta.fields[3:],
        )

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else (*self.readonly_fields, "tenant")

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        data = form.cleaned_data
        api_key, raw_key = services.api_key_create(
            tenant=data["tenant"],
            name=data["name"],
            created_by=request.user,
            expires_at=data["expires_at"],
            **{name: data[name] for name in ApiKeyCreationForm.Meta.fields[3:]},
        )
        obj.pk, obj.prefix, obj.key_hash = api_key.pk, api_key.prefix, api_key.key_hash
        messages.warning(request, f"New API key (copy it now, it is not shown again): {raw_key}")

    @admin.action(description="Revoke selected keys")
    def revoke_selected(self, request: HttpRequest, queryset) -> None:
        for api_key in queryset:
            services.api_key_revoke(api_key=api_key)
        messages.success(request, f"Revoked {queryset.count()} key(s).")


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = (
        "started_at",
        "tenant",
        "model",
        "source",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "time_to_first_token_ms",
        "latency_ms",
    )
    list_filter = ("source", "status", "model", "tenant")
    date_hierarchy = "started_at"
    search_fields = ("request_id", "tenant__slug")
    list_select_related = ("tenant",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
