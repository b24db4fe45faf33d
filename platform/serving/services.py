"""Writes to the deployment registry, and requests to load or unload a replica's model."""

import re

from django.core.exceptions import ValidationError
from django.db import transaction

from serving.models import ModelDeployment, served_name_validator, validate_endpoints
from serving.tasks import control_engine

CONTROL_ACTIONS = ("load", "unload")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


@transaction.atomic
def deployment_register(
    *,
    name: str,
    endpoints: list[str],
    description: str = "",
    max_context: int | None = None,
    is_enabled: bool = True,
) -> ModelDeployment:
    """Create or update the deployment called ``name``. Its health is unknown until the next
    poll: what was polled before (say, before ``make run`` restarted its engine) no longer
    says anything about these endpoints."""
    served_name_validator(name)  # before the look-up: the database refuses a NUL in it
    validate_endpoints(endpoints)
    deployment = ModelDeployment.objects.filter(name=name).first() or ModelDeployment(name=name)
    deployment.endpoints = endpoints
    deployment.health = ModelDeployment.Health.UNKNOWN
    deployment.replicas = {}
    deployment.checked_at = None
    deployment.description = description or deployment.description
    deployment.max_context = max_context
    deployment.is_enabled = is_enabled
    deployment.full_clean()
    deployment.save()
    return deployment


def deployment_set_enabled(*, deployment_id: int | None, is_enabled: bool) -> ModelDeployment:
    """Open the deployment to requests or close it; raises ``ModelDeployment.DoesNotExist``
    for no such deployment."""
    deployment = ModelDeployment.objects.get(pk=deployment_id)
    deployment.is_enabled = is_enabled
    deployment.save(update_fields=["is_enabled"])
    return deployment


def deployment_control_request(
    *, deployment_id: int | None, endpoint: str, action: str, model: str | None = None
) -> ModelDeployment:
    """Queue ``action`` ("load" the model directory ``model``, or "unload") for the replica at
    ``endpoint``; the ``serving.control_engine`` task sends it and records how it goes.

    Raises ``ModelDeployment.DoesNotExist`` for no such deployment, and ``ValidationError``
    for an unknown action, an endpoint that is not one of the deployment's replicas, or a
    load without a model.
    """
    if action not in CONTROL_ACTIONS:
        raise ValidationError(f"Unknown action {action!r}.")
    deployment = ModelDeployment.objects.get(pk=deployment_id)
    if endpoint not in deployment.endpoints:
        raise ValidationError(f"{endpoint!r} is not a replica of {deployment.name}.")
    model = (model or "").strip() or None
    if action == "load" and model is None:
        raise ValidationError("Give the model directory to load.")
    if model is not None and _CONTROL_CHARACTER.search(model):
        raise ValidationError("A model directory's path holds no control characters.")
    control_engine.delay(deployment.pk, endpoint, action, model)
    return deployment
