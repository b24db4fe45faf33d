"""Writes to the deployment registry, and requests to load or unload a replica's model.

Each change, and each request, goes to the audit log as ``actor``'s (None: the platform
itself, as ``make run`` registering its engine)."""

import logging
import re

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from serving.models import ModelDeployment, served_name_validator, validate_endpoints
from serving.tasks import control_engine
from tenants.audit import audit_record, field_changes, model_values
from tenants.models import AuditEvent

CONTROL_ACTIONS = {
    "load": AuditEvent.Action.REPLICA_LOAD,
    "unload": AuditEvent.Action.REPLICA_UNLOAD,
}
DEPLOYMENT_AUDITED_FIELDS = ("name", "endpoints", "description", "max_context", "is_enabled")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")

logger = logging.getLogger(__name__)


class Kept:
    """A setting a registration leaves as it is (a new deployment: its default)."""


KEPT = Kept()


@transaction.atomic
def deployment_register(
    *,
    name: str,
    endpoints: list[str],
    description: str = "",
    max_context: int | None | Kept = KEPT,
    is_enabled: bool | Kept = KEPT,
    actor: AbstractBaseUser | None = None,
) -> ModelDeployment:
    """Create or update the deployment called ``name``. Its health is unknown until the next
    poll: what was polled before (say, before ``make run`` restarted its engine) no longer
    says anything about these endpoints. A registration that changes nothing (``make run``
    starting again) is not in the audit log. ``max_context`` and ``is_enabled`` not given
    are kept (a new deployment's: the engine's context, enabled): ``make run`` registers its
    engine at each start, and re-enabled a deployment an admin had closed, and dropped its
    context limit."""
    served_name_validator(name)  # before the look-up: the database refuses a NUL in it
    validate_endpoints(endpoints)
    existing = ModelDeployment.objects.select_for_update().filter(name=name).first()
    deployment = existing or ModelDeployment(name=name)
    before = {} if deployment.pk is None else model_values(deployment, DEPLOYMENT_AUDITED_FIELDS)
    action = (
        AuditEvent.Action.DEPLOYMENT_UPDATED if before else AuditEvent.Action.DEPLOYMENT_CREATED
    )
    deployment.endpoints = endpoints
    deployment.health = ModelDeployment.Health.UNKNOWN
    deployment.replicas = {}
    deployment.checked_at = None
    deployment.description = description or deployment.description
    if not isinstance(max_context, Kept):
        deployment.max_context = max_context
    if not isinstance(is_enabled, Kept):
        deployment.is_enabled = is_enabled
    deployment.full_clean()
    deployment.save()
    changes = field_changes(before, model_values(deployment, DEPLOYMENT_AUDITED_FIELDS))
    if changes:
        audit_record(action=action, actor=actor, target=deployment, changes=changes)
    return deployment


@transaction.atomic
def deployment_set_enabled(
    *, deployment_id: int | None, is_enabled: bool, actor: AbstractBaseUser | None = None
) -> ModelDeployment:
    """Open the deployment to requests or close it; raises ``ModelDeployment.DoesNotExist``
    for no such deployment."""
    deployment = ModelDeployment.objects.select_for_update().get(pk=deployment_id)
    if deployment.is_enabled != is_enabled:
        deployment.is_enabled = is_enabled
        deployment.save(update_fields=["is_enabled"])
        audit_record(
            action=AuditEvent.Action.DEPLOYMENT_UPDATED,
            actor=actor,
            target=deployment,
            changes={"is_enabled": [not is_enabled, is_enabled]},
        )
    return deployment


class ControlNotQueued(Exception):
    """A load or unload the task broker did not take: nothing was asked of the replica."""


def deployment_control_request(
    *,
    deployment_id: int | None,
    endpoint: str,
    action: str,
    model: str | None = None,
    actor: AbstractBaseUser | None = None,
) -> ModelDeployment:
    """Queue ``action`` ("load" the model directory ``model``, or "unload") for the replica at
    ``endpoint``; the ``serving.control_engine`` task sends it and records how it goes.

    Raises ``ModelDeployment.DoesNotExist`` for no such deployment, ``ValidationError`` for an
    unknown action, an endpoint that is not one of the deployment's replicas, or a load
    without a model, and ``ControlNotQueued`` where the broker did not take the task.
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
    # sent first, and outside any transaction: a request the broker did not take leaves no
    # event, and a task run at once (eagerly, or by a quick worker) finds no write waiting
    try:
        control_engine.delay(deployment.pk, endpoint, action, model)
    except Exception as exc:  # the broker (Redis) out of reach: nothing was asked
        logger.warning("could not queue %s on %s: %s", action, endpoint, exc)
        raise ControlNotQueued(
            f"The {action} could not be queued (the task broker is out of reach): nothing was "
            "asked of the replica. Try again in a moment."
        ) from exc
    audit_record(
        action=CONTROL_ACTIONS[action],
        actor=actor,
        target=deployment,
        changes=field_changes({}, {"endpoint": endpoint, "model": model}),
    )
    return deployment
