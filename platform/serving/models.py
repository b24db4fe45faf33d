"""Model deployments: a served model name and the engine endpoints that serve it."""

import re

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from tenants.models import Plan

served_name_validator = RegexValidator(
    r"\A[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}\Z",
    "Use letters, digits and . _ : / - (OpenAI-style model ids).",
)

# a ZeroMQ endpoint: no spaces or control characters (NUL included: the database refuses it)
_ENDPOINT = re.compile(r"\A(tcp|ipc)://[^\s\x00-\x1f\x7f]+\Z")


def validate_endpoints(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise ValidationError("Give at least one engine endpoint.")
    for endpoint in value:
        if not isinstance(endpoint, str) or not _ENDPOINT.match(endpoint):
            raise ValidationError(f"{endpoint!r} is not a tcp:// or ipc:// ZeroMQ endpoint.")
    if len(set(value)) != len(value):
        raise ValidationError("Endpoints must be distinct.")


class ModelDeployment(models.Model):
    """A model as tenants see it (``name`` is the API's ``model``), served by one or more
    engine replicas. The gateway routes each request to the least-loaded ready replica.
    ``health`` and ``replicas`` are written by the health-polling task."""

    class Health(models.TextChoices):
        UNKNOWN = "unknown", "Unknown"
        READY = "ready", "Ready"
        DEGRADED = "degraded", "Degraded"
        DOWN = "down", "Down"

    name = models.CharField(max_length=200, unique=True, validators=[served_name_validator])
    description = models.TextField(blank=True)
    endpoints = models.JSONField(
        validators=[validate_endpoints],
        help_text='Engine replicas, e.g. ["tcp://10.0.0.5:5555", "ipc:///run/engine.sock"].',
    )
    is_enabled = models.BooleanField(default=True)
    max_context = models.PositiveIntegerField(
        null=True, blank=True, help_text="Context length; empty means the engine's own."
    )
    plans = models.ManyToManyField(
        Plan,
        blank=True,
        related_name="deployments",
        help_text="Plans that may use this model; none selected means every plan.",
    )
    owned_by = models.CharField(max_length=100, default="platform")
    shares_prefix_cache = models.BooleanField(
        default=False,
        help_text=(
            "Let every tenant's requests reuse each other's cached prompt prefixes. Only for a "
            "model whose prompts are public (e.g. one shared system prompt): a tenant can tell "
            "from the cached token count whether another tenant sent a text."
        ),
    )
    created_at = models.DateTimeField(default=timezone.now)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    # endpoint -> the engine's last STATS (or {"error": ...}), as the console shows them
    replicas = models.JSONField(default=dict, blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
