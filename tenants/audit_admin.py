"""The admin's own saves in the audit log: ``AuditedAdmin`` records what each add, change and
deletion of its model changed, as the services do for theirs."""

from django.contrib import admin
from django.db import models, transaction
from django.http import HttpRequest

from tenants.audit import audit_record, field_changes, model_values
from tenants.models import Tenant


class AuditedAdmin(admin.ModelAdmin):
    """A model admin whose saves and deletions write audit events ``<audit_prefix>.created``,
    ``.updated`` and ``.deleted`` (those in ``audit_verbs``: a model whose creation goes
    through a service that records it leaves "created" out). The event of a save is written
    after the form's many-to-many fields are saved and before its inlines, whose own changes
    (memberships) follow it."""

    audit_prefix: str = ""
    audit_verbs: tuple[str, ...] = ("created", "updated", "deleted")

    def audit_tenant(self, obj: models.Model) -> Tenant | None:
        """The tenant whose log the event is in; None: the platform's only."""
        return None

    def audit_name(self, obj: models.Model) -> str:
        """What the event calls ``obj``."""
        return str(obj)

    def _audited_fields(self, form, change: bool) -> list[str]:
        """The model's fields the form holds: on a change, those the editor changed (not
        what others wrote since the form was shown, nor what the widgets round)."""
        model_fields = {field.name for field in self.model._meta.get_fields()}
        names = form.changed_data if change else form.base_fields
        return [name for name in names if name in model_fields]

    def save_model(self, request: HttpRequest, obj: models.Model, form, change: bool) -> None:
        if change:  # the form changed ``obj`` already: what was is still in the database
            stored = type(obj)._default_manager.get(pk=obj.pk)
            form.audit_before = model_values(stored, self._audited_fields(form, change))
        super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form, formsets, change: bool) -> None:
        form.save_m2m()
        verb = "updated" if change else "created"
        obj = form.instance
        changes = field_changes(
            getattr(form, "audit_before", {}),
            model_values(obj, self._audited_fields(form, change)),
        )
        if verb in self.audit_verbs and (changes or not change):
            audit_record(
                action=f"{self.audit_prefix}.{verb}",
                actor=request.user,
                target=obj,
                target_name=self.audit_name(obj),
                tenant=self.audit_tenant(obj),
                changes=changes,
            )
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def delete_model(self, request: HttpRequest, obj: models.Model) -> None:
        self._audit_deleted(request, obj)
        super().delete_model(request, obj)

    @transaction.atomic
    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for obj in queryset:
            self._audit_deleted(request, obj)
        super().delete_queryset(request, queryset)

    def _audit_deleted(self, request: HttpRequest, obj: models.Model) -> None:
        if "deleted" in self.audit_verbs:
            audit_record(
                action=f"{self.audit_prefix}.deleted",
                actor=request.user,
                target=obj,
                target_name=self.audit_name(obj),
                tenant=self.audit_tenant(obj),
            )
