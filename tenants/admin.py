from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.auth import admin as auth_admin
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserChangeForm
from django.core.exceptions import ValidationError
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from tenants import services
from tenants.audit import HIDDEN_VALUE, audit_record
from tenants.audit_admin import AuditedAdmin
from tenants.models import ApiKey, AuditEvent, Membership, Plan, Tenant, UsageRecord
from tenants.services import MembershipChange

LIMIT_FIELDSET = (
    "Limits (empty means the plan's value, or no limit on a plan)",
    {
        "fields": (
            "requests_per_minute",
            "tokens_per_minute",
            "max_concurrent_requests",
            "monthly_token_budget",
            "max_queued_batch_tokens",
            "max_file_storage_bytes",
        )
    },
)


@admin.register(Plan)
class PlanAdmin(AuditedAdmin):
    audit_prefix = "plan"
    list_display = (
        "name",
        "slug",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent_requests",
        "monthly_token_budget",
        "service_tier",
        "share",
    )
    prepopulated_fields = {"slug": ("name",)}
    fieldsets = (
        (None, {"fields": ("name", "slug", "allowed_models")}),
        LIMIT_FIELDSET,
        ("Scheduling in the engine", {"fields": ("service_tier", "share")}),
        ("Batches", {"fields": ("batch_price_factor",)}),
    )


# Memberships change through tenants.services here too, so the owner rules hold in the admin:
# forms run ``memberships_check`` (an error redisplays the form), saves ``memberships_apply``.


class MembershipFormSet(BaseInlineFormSet):
    actor = None  # the admin user, set by MembershipInline.get_formset

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        self.changes: list[MembershipChange] = []
        for form in self.forms:
            self.changes += self._changes(form)
        # a tenant being added has no owner to lose, and nothing to query yet
        if self.instance.pk is not None:
            services.memberships_check(tenant=self.instance, changes=self.changes, actor=self.actor)

    def _changes(self, form: forms.ModelForm) -> list[MembershipChange]:
        if not form.cleaned_data or not (form.has_changed() or self._should_delete_form(form)):
            return []
        previous = None
        if form.instance.pk is not None:
            previous = get_user_model().objects.get(pk=form.initial["user"])
        if self._should_delete_form(form):
            return [MembershipChange(previous, None)] if previous else []
        user, role = form.cleaned_data["user"], form.cleaned_data["role"]
        moved = [MembershipChange(previous, None)] if previous and previous != user else []
        return [*moved, MembershipChange(user, role)]


class MembershipInline(admin.TabularInline):
    model = Membership
    formset = MembershipFormSet
    fields = ("user", "role")
    extra = 0
    autocomplete_fields = ("user",)

    def get_formset(self, request: HttpRequest, obj=None, **kwargs):
        formset = super().get_formset(request, obj, **kwargs)
        return type(formset.__name__, (formset,), {"actor": request.user})


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    audit_prefix = "tenant"
    list_display = ("slug", "name", "plan", "is_active", "created_at")
    list_filter = ("is_active", "plan")
    search_fields = ("slug", "name")
    prepopulated_fields = {"slug": ("name",)}
    fieldsets = ((None, {"fields": ("name", "slug", "plan", "is_active")}), LIMIT_FIELDSET)
    inlines = (MembershipInline,)

    def audit_tenant(self, obj: Tenant) -> Tenant:
        return obj

    def save_formset(self, request: HttpRequest, form, formset, change: bool) -> None:
        if not isinstance(formset, MembershipFormSet):
            super().save_formset(request, form, formset, change)
            return
        formset.save(commit=False)  # writes nothing; lists the changes for the admin's log
        services.memberships_apply(
            tenant=form.instance, changes=formset.changes, actor=request.user
        )


class MembershipAdminForm(forms.ModelForm):
    actor = None  # the admin user, set by MembershipAdmin.get_form

    class Meta:
        model = Membership
        fields = ("user", "tenant", "role")

    def clean(self) -> dict:
        cleaned = super().clean()
        tenant = cleaned.get("tenant") or getattr(self.instance, "tenant", None)
        user = cleaned.get("user") or getattr(self.instance, "user", None)
        if tenant is not None and user is not None and cleaned.get("role"):
            services.memberships_check(
                tenant=tenant, changes=[MembershipChange(user, cleaned["role"])], actor=self.actor
            )
        return cleaned


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    form = MembershipAdminForm
    list_display = ("user", "tenant", "role", "created_at")
    list_filter = ("role",)
    search_fields = ("user__username", "tenant__slug")
    autocomplete_fields = ("user", "tenant")

    def get_form(self, request: HttpRequest, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"actor": request.user})

    def get_readonly_fields(self, request: HttpRequest, obj=None):
        # moving a membership to another user or tenant would be a removal in disguise
        return () if obj is None else ("user", "tenant")

    def save_model(self, request: HttpRequest, obj: Membership, form, change: bool) -> None:
        membership = services.membership_set(
            tenant=obj.tenant, user=obj.user, role=obj.role, actor=request.user
        )
        obj.pk = membership.pk

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        services.membership_remove(membership=obj, actor=request.user)

    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for tenant, removals in _removals_by_tenant(queryset).items():
            services.memberships_apply(tenant=tenant, changes=removals, actor=request.user)

    def get_deleted_objects(self, objs, request: HttpRequest):
        # The admin's own way to refuse a deletion: "protected" objects block the confirm page.
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        for tenant, removals in _removals_by_tenant(objs).items():
            try:
                services.memberships_check(tenant=tenant, changes=removals, actor=request.user)
            except ValidationError as exc:
                protected = [*protected, f"{tenant.slug}: {' '.join(exc.messages)}"]
        return deleted, counts, perms_needed, protected


def _removals_by_tenant(memberships) -> dict[Tenant, list[MembershipChange]]:
    removals: dict[Tenant, list[MembershipChange]] = {}
    for membership in memberships:
        removals.setdefault(membership.tenant, []).append(MembershipChange(membership.user, None))
    return removals


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
class ApiKeyAdmin(AuditedAdmin):
    audit_prefix = "api_key"
    audit_verbs = ("updated", "deleted")  # api_key_create records a creation
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
    # revocation cannot be undone: the action revokes, and nothing clears it
    readonly_fields = ("display_prefix", "created_by", "created_at", "last_used_at", "revoked_at")
    autocomplete_fields = ("tenant",)
    actions = ("revoke_selected",)

    def audit_tenant(self, obj: ApiKey) -> Tenant:
        return obj.tenant

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
            actor=request.user,
            **{name: data[name] for name in ApiKeyCreationForm.Meta.fields[3:]},
        )
        obj.pk, obj.prefix, obj.key_hash = api_key.pk, api_key.prefix, api_key.key_hash
        request.new_api_key = raw_key  # for response_add, this request only

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue=None):
        """The new key on a page of its own, which no cache keeps: not through a message,
        which the session (a database row) would hold until the next page, or for good."""
        raw_key = getattr(request, "new_api_key", None)
        if raw_key is None:
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "API key created",
            "api_key": obj,
            "raw_key": raw_key,
        }
        response = TemplateResponse(request, "admin/tenants/apikey/created.html", context)
        add_never_cache_headers(response)
        return response

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_selected(self, request: HttpRequest, queryset) -> None:
        for api_key in queryset:
            services.api_key_revoke(api_key=api_key, actor=request.user)
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
        "billed_tokens",
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

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        # the billing record: kept for USAGE_RETENTION_DAYS (``tasks.purge_old_usage``); a
        # deletion here would leave the dashboards' roll-ups counting it
        return False


class OwnerKeepingUserChangeForm(UserChangeForm):
    def clean(self) -> dict:
        cleaned = super().clean()
        if self.instance.is_active and cleaned.get("is_active") is False:
            services.users_removal_check(users=[self.instance])
        return cleaned


User = get_user_model()
if admin.site.is_registered(User):
    admin.site.unregister(User)


@admin.register(User)
class UserAdmin(AuditedAdmin, auth_admin.UserAdmin):
    """Django's user admin, except that a tenant's last owner is neither deactivated nor
    deleted, and that its changes (a staff or superuser flag given, permissions) are in the
    audit log."""

    audit_prefix = "user"
    form = OwnerKeepingUserChangeForm
    # what makes one staff, superuser or holder of a permission: a superuser's to give (Django
    # lets any staff who may change users give them, themselves included)
    POWERS = ("is_superuser", "is_staff", "user_permissions", "groups")

    def get_readonly_fields(self, request: HttpRequest, obj=None):
        readonly = super().get_readonly_fields(request, obj)
        if obj is not None and not request.user.is_superuser:
            return (*readonly, *self.POWERS)
        return readonly

    def user_change_password(self, request: HttpRequest, id: str, form_url: str = ""):
        """Django's page that sets a user's password (a view of its own, past ``save_model``):
        a password set is a change in the audit log, its value hidden."""
        response = super().user_change_password(request, id, form_url)
        if request.method == "POST" and response.status_code == 302:
            user = self.get_object(request, unquote(id))
            audit_record(
                action=AuditEvent.Action.USER_UPDATED,
                actor=request.user,
                target=user,
                changes={"password": [HIDDEN_VALUE, HIDDEN_VALUE]},
            )
        return response

    def save_model(self, request: HttpRequest, obj, form, change: bool) -> None:
        was_active = form.initial.get("is_active", True)
        super().save_model(request, obj, form, change)
        if change and was_active and not obj.is_active:  # deactivated: their keys go too
            services.api_keys_revoke_made_by(user=obj, tenant=None, actor=request.user)

    def _audit_deleted(self, request: HttpRequest, obj) -> None:
        """A user deleted leaves the tenants they were in, and the keys they made stop: each
        tenant's log says so."""
        services.api_keys_revoke_made_by(user=obj, tenant=None, actor=request.user)
        for membership in Membership.objects.filter(user=obj).select_related("tenant"):
            audit_record(
                action=AuditEvent.Action.MEMBER_REMOVED,
                actor=request.user,
                target=obj,
                tenant=membership.tenant,
                changes={"role": [membership.role, None]},
            )
        super()._audit_deleted(request, obj)

    def get_deleted_objects(self, objs, request: HttpRequest):
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        try:
            services.users_removal_check(users=list(objs))
        except ValidationError as exc:
            protected = [*protected, " ".join(exc.messages)]
        return deleted, counts, perms_needed, protected


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """The audit log, to read: nobody adds, changes or deletes an event here."""

    list_display = (
        "created_at", "action", "tenant_slug", "actor_name", "target_name", "ip_address"
    )  # fmt: skip
    list_filter = ("action",)
    date_hierarchy = "created_at"
    search_fields = ("tenant_slug", "actor_name", "target_name", "ip_address")
    readonly_fields = (
        "created_at", "action", "tenant", "tenant_slug", "actor", "actor_name", "ip_address",
        "target_id", "target_name", "changes",
    )  # fmt: skip

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
