"""Tenants, their people, plans and keys, and the usage they are metered for.

Models stay thin: writes live in ``tenants.services``, reads in ``tenants.selectors``.
A limit left empty (NULL) means "no limit" everywhere.
"""

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone


def validate_model_names(value: object) -> None:
    """A list of served model names (any other JSON reached the deployments' lookup: a number
    failed every request of the plan's tenants, a string was taken letter by letter)."""
    if not isinstance(value, list) or not all(
        isinstance(name, str) and name.strip() for name in value
    ):
        raise ValidationError(
            'Give a list of served model names, such as ["demo-chat"]; [] allows every model.',
            code="invalid_model_names",
        )


class Plan(models.Model):
    """What a tenant may spend. Tenants may override any limit individually."""

    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    allowed_models = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_model_names],
        help_text="Served model names this plan may use; an empty list allows every model.",
    )

    class ServiceTier(models.TextChoices):
        INTERACTIVE = "interactive", "Interactive"
        STANDARD = "standard", "Standard"
        BATCH = "batch", "Batch"

    service_tier = models.CharField(
        max_length=16,
        choices=ServiceTier.choices,
        default=ServiceTier.STANDARD,
        help_text="The engine serves interactive before standard before batch requests.",
    )
    share = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
        help_text="Each tenant's weight under fair scheduling: 2 is served twice as much as 1 "
        "when both wait.",
    )
    batch_price_factor = models.DecimalField(
        max_digits=4,
        decimal_places=2,
        default=Decimal("0.50"),
        validators=[MinValueValidator(Decimal("0")), MaxValueValidator(Decimal("1"))],
        help_text="What a batch token costs against an online one (OpenAI's Batch API: 0.50); "
        "the console's billed tokens weigh batch usage by it.",
    )
    max_queued_batch_tokens = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="The most input tokens the tenant's unfinished batches may hold; a batch "
        "that would pass it is refused. Empty: no limit.",
    )
    max_file_storage_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="The most bytes the tenant's files (batch inputs and results) may take; an "
        "upload that would pass it is refused until files are deleted. Empty: no limit.",
    )

    def __str__(self) -> str:
        return self.name


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    is_active = models.BooleanField(default=True)
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="tenants")
    # Per-tenant overrides of the plan's limits; NULL means "use the plan's".
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    max_queued_batch_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    max_file_storage_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        ADMIN = "admin", "Admin"
        MEMBER = "member", "Member"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="unique_membership"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"


class Invitation(models.Model):
    """An invitation to join a tenant in ``role``: a link, shown once to whoever made it
    (only its SHA-256 is kept), that a signed-in user opens to accept. It is used once, and
    gives the role only while its maker still may give it (``tenants.invitations``)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    role = models.CharField(max_length=16, choices=Membership.Role.choices)
    # whom it is for, in its maker's words (a link is anyone's who holds it)
    note = models.CharField(max_length=200, blank=True)
    code_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        related_name="invitations_made",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="invitations_accepted",
    )
    accepted_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        for_whom = f" ({self.note})" if self.note else ""
        return f"invitation to {self.tenant} as {self.role}{for_whom}"

    def is_open(self, now=None) -> bool:
        """Neither used, revoked nor expired."""
        return (
            self.accepted_at is None
            and self.revoked_at is None
            and self.expires_at > (now or timezone.now())
        )


class ApiKey(models.Model):
    """A tenant's API key. The plaintext is shown once; only its SHA-256 is kept."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="created_api_keys",
    )
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Optional per-key limits, applied on top of the tenant's.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["tenant", "created_at"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"sk-{self.prefix}…"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now=None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


class UsageRecord(models.Model):
    """Exactly one row per admitted request, written when the request ends."""

    class Source(models.TextChoices):
        API = "api", "API"
        CHAT = "chat", "Chat"
        BATCH = "batch", "Batch"

    class Status(models.TextChoices):
        OK = "ok", "OK"
        CANCELLED = "cancelled", "Cancelled"
        ERROR = "error", "Error"
        REJECTED = "rejected", "Rejected"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_records"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="usage_records",
    )
    model = models.CharField(max_length=200)
    source = models.CharField(max_length=8, choices=Source.choices)
    status = models.CharField(max_length=16, choices=Status.choices)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    # what its tokens are billed as, in online tokens, fixed when it is written: a batch
    # line's weigh its plan's ``batch_price_factor`` then, so a later plan change re-bills
    # nothing (no default: whoever writes a record must say)
    billed_tokens = models.DecimalField(max_digits=14, decimal_places=2)
    time_to_first_token_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)
    # the tenant's own labels, as the API request gave them: its end user (OpenAI's `user`)
    # and up to 16 string pairs (`metadata`)
    end_user = models.CharField(max_length=256, blank=True)
    metadata = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "started_at"], name="usage_tenant_time"),
            models.Index(
                fields=["tenant", "end_user", "started_at"], name="usage_tenant_end_user_time"
            ),
            models.Index(fields=["tenant", "api_key", "started_at"], name="usage_tenant_key_time"),
            models.Index(fields=["tenant", "model", "started_at"], name="usage_tenant_model_time"),
            models.Index(fields=["created_at"], name="usage_created"),
            # every tenant's records of a period: the roll-ups, the platform's usage page
            models.Index(fields=["started_at"], name="usage_time"),
        ]

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageRollup(models.Model):
    """Usage aggregated per hour or day and per (tenant, key, user, model, source), which the
    dashboards read. Latencies are kept as fixed-bucket histograms so periods merge and
    percentiles can still be estimated over any range."""

    class Period(models.TextChoices):
        HOUR = "hour", "Hour"
        DAY = "day", "Day"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_rollups")
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    model = models.CharField(max_length=200)
    source = models.CharField(max_length=8, choices=UsageRecord.Source.choices)
    period = models.CharField(max_length=4, choices=Period.choices)
    period_start = models.DateTimeField()
    requests = models.PositiveIntegerField(default=0)
    ok = models.PositiveIntegerField(default=0)
    cancelled = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    rejected = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    # the sum of its records' ``billed_tokens``: an hour may mix the factors of two plans
    billed_tokens = models.DecimalField(max_digits=22, decimal_places=2, default=0)
    ttft_histogram = models.JSONField(default=list)
    latency_histogram = models.JSONField(default=list)
    # time per output token after the first (rollups.TPOT_BUCKETS_MS); [] in rows rolled up
    # before it was kept
    tpot_histogram = models.JSONField(default=list)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "period", "period_start"], name="rollup_tenant_period"),
            models.Index(fields=["period", "period_start"], name="rollup_period"),
        ]


class RefusalCount(models.Model):
    """Requests refused before admission (no usage record: a quota's 429, an unknown model's
    404, a request too large), counted per hour, so the dashboards can show refusal rates.
    Rows are summed, never read one by one: two that a race created for the same hour and
    group count as one."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="refusal_counts")
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    model = models.CharField(max_length=200, blank=True)  # empty: not a served model
    source = models.CharField(max_length=8, choices=UsageRecord.Source.choices)
    code = models.CharField(max_length=64)
    hour = models.DateTimeField()
    count = models.PositiveIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["tenant", "hour"], name="refusal_tenant_hour")]


class MonthCounterGeneration(models.Model):
    """How many times a tenant's month counters were recounted from the usage records (a
    seed or a rebuild, ``tenants.month_locks``). Each counter keeps the generation that
    counted it; a settle tried again after its record was written (the cache was down then)
    adds nothing to a counter recounted since, which read the record."""

    tenant = models.OneToOneField(
        Tenant, on_delete=models.CASCADE, primary_key=True, related_name="+"
    )
    value = models.PositiveBigIntegerField(default=0)


class RollupCursor(models.Model):
    """How far the roll-up task has read the usage records (by their ``created_at``)."""

    name = models.CharField(max_length=32, primary_key=True)
    position = models.DateTimeField()


class AuditEvent(models.Model):
    """One change to what a tenant or the platform is set up to do: who did what to which
    object, from where, and what changed. Written in the change's own transaction (a change
    that rolls back leaves no event) and never edited.

    ``changes`` maps each field to ``[before, after]``: ``before`` is null for what was created
    or asked for, ``after`` for what was deleted. The names (tenant, actor, target) are copies,
    so an event still reads right after its tenant, user or key is gone."""

    class Action(models.TextChoices):
        TENANT_CREATED = "tenant.created", "Tenant created"
        TENANT_UPDATED = "tenant.updated", "Tenant changed"
        TENANT_DELETED = "tenant.deleted", "Tenant deleted"
        MEMBER_ADDED = "member.added", "Member added"
        MEMBER_ROLE_CHANGED = "member.role_changed", "Member's role changed"
        MEMBER_REMOVED = "member.removed", "Member removed"
        INVITATION_CREATED = "invitation.created", "Invitation made"
        INVITATION_REVOKED = "invitation.revoked", "Invitation revoked"
        API_KEY_CREATED = "api_key.created", "API key created"
        API_KEY_UPDATED = "api_key.updated", "API key changed"
        API_KEY_REVOKED = "api_key.revoked", "API key revoked"
        API_KEY_DELETED = "api_key.deleted", "API key deleted"
        PLAN_CREATED = "plan.created", "Plan created"
        PLAN_UPDATED = "plan.updated", "Plan changed"
        PLAN_DELETED = "plan.deleted", "Plan deleted"
        DEPLOYMENT_CREATED = "deployment.created", "Deployment registered"
        DEPLOYMENT_UPDATED = "deployment.updated", "Deployment changed"
        DEPLOYMENT_DELETED = "deployment.deleted", "Deployment deleted"
        REPLICA_LOAD = "deployment.load_requested", "Model load requested"
        REPLICA_UNLOAD = "deployment.unload_requested", "Model unload requested"
        USER_CREATED = "user.created", "User created"
        USER_UPDATED = "user.updated", "User changed"
        USER_DELETED = "user.deleted", "User deleted"
        USER_SIGNED_IN = "user.signed_in", "Signed in"
        USER_SIGN_IN_FAILED = "user.sign_in_failed", "Sign-in failed"
        BATCH_CANCELLED = "batch.cancelled", "Batch cancelled"
        CONVERSATION_DELETED = "conversation.deleted", "Conversation deleted"

    created_at = models.DateTimeField(default=timezone.now)
    action = models.CharField(max_length=48, choices=Action.choices)
    # null: a platform-wide change (a plan, a deployment, a user), which only staff see
    tenant = models.ForeignKey(
        Tenant, on_delete=models.SET_NULL, null=True, blank=True, related_name="audit_events"
    )
    tenant_slug = models.CharField(max_length=64, blank=True)
    # null with an empty name: the platform itself (a management command, start-up)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="audit_events",
    )
    actor_name = models.CharField(max_length=150, blank=True)
    ip_address = models.GenericIPAddressField(null=True, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    target_name = models.CharField(max_length=300, blank=True)
    changes = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="audit_tenant_time"),
            models.Index(fields=["created_at"], name="audit_time"),
        ]

    def __str__(self) -> str:
        return f"{self.get_action_display()}: {self.target_name}"
