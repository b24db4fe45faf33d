from django.contrib import admin

from serving.models import ModelDeployment
from tenants.audit_admin import AuditedAdmin


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(AuditedAdmin):
    audit_prefix = "deployment"
    list_display = (
        "name",
        "is_enabled",
        "max_context",
        "shares_prefix_cache",
        "endpoint_list",
        "created_at",
    )
    list_filter = ("is_enabled", "shares_prefix_cache")
    search_fields = ("name", "description")
    filter_horizontal = ("plans",)
    # what the health poll writes, shown: a form saved a minute after it was opened wrote
    # back the health it had shown
    readonly_fields = ("health", "replicas", "checked_at", "created_at")

    @admin.display(description="Endpoints")
    def endpoint_list(self, obj: ModelDeployment) -> str:
        return ", ".join(obj.endpoints or [])
