"""Which deployments a tenant may use."""

from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import Q, QuerySet

from serving.models import ModelDeployment
from tenants.models import Tenant


def deployments_for_tenant(*, tenant: Tenant) -> QuerySet[ModelDeployment]:
    """Enabled deployments open to the tenant's plan (the deployment's plans and the plan's
    allowed models must both admit it)."""
    deployments = ModelDeployment.objects.filter(is_enabled=True).filter(
        Q(plans=None) | Q(plans=tenant.plan_id)
    )
    allowed = tenant.plan.allowed_models
    if allowed:
        # a list of names (``validate_model_names``); anything else, stored before the plan
        # form checked it, opens no model (a number failed every request with a 500)
        names = (
            [name for name in allowed if isinstance(name, str)] if isinstance(allowed, list) else []
        )
        deployments = deployments.filter(name__in=names)
    return deployments.distinct().order_by("name")


def prefix_cache_salt(
    *, tenant: Tenant, deployment: ModelDeployment, user: AbstractBaseUser | None = None
) -> str | None:
    """The engine's cache salt for the tenant's requests: each tenant its own prefix cache
    (another tenant's cached tokens, or how soon its first token comes, would reveal what it
    sent), and in the chat each user their own (a member's conversations are private from the
    other members), unless the deployment shares its cache (None)."""
    if deployment.shares_prefix_cache:
        return None
    return f"tenant-{tenant.pk}" if user is None else f"tenant-{tenant.pk}-user-{user.pk}"


def deployment_for_tenant(*, tenant: Tenant, name: str) -> ModelDeployment | None:
    return deployments_for_tenant(tenant=tenant).filter(name=name).first()
