"""Writes to the deployment registry."""

from django.db import transaction

from serving.models import ModelDeployment


@transaction.atomic
def deployment_register(
    *,
    name: str,
    endpoints: list[str],
    description: str = "",
    max_context: int | None = None,
    is_enabled: bool = True,
) -> ModelDeployment:
    """Create or update the deployment called ``name``."""
    deployment = ModelDeployment.objects.filter(name=name).first() or ModelDeployment(name=name)
    deployment.endpoints = endpoints
    deployment.description = description or deployment.description
    deployment.max_context = max_context
    deployment.is_enabled = is_enabled
    deployment.full_clean()
    deployment.save()
    return deployment
