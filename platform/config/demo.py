"""The embedded mode's demo data: a tenant, a superuser and an API key that `make run`
creates when they do not exist, with credentials kept in ``var/`` (owner-only) so every run
can print them.

Once created, they are the operator's: a later run never resets the ``admin`` password,
never restores its staff, superuser or active flags, never adds it back to the demo tenant
and never replaces a demo key that was revoked or has expired. It prints what it still
knows to be true (a password changed since is "not shown"). Only what is missing is created
again: the ``admin`` user if it was deleted, the demo tenant with its owner, a key if none
was ever made.

Never in production (``DATABASE_URL`` set): a superuser with a password printed to the
console and kept in a file is a demo's convenience, not an operator's account.
"""

import json
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from config.private_files import private_file_write
from tenants import services
from tenants.audit import audit_record, field_changes, model_values
from tenants.models import AuditEvent, Tenant

DEMO_TENANT_SLUG = "demo"
DEMO_USERNAME = "admin"
CREATE_SUPERUSER_HINT = "create a superuser with `python manage.py createsuperuser`"


class DemoRefused(RuntimeError):
    """The demo bootstrap was asked for outside the embedded mode."""


@dataclass
class DemoCredentials:
    username: str
    password: str | None  # None: changed since it was made, so not known here
    api_key: str | None  # None: the demo key was revoked or has expired

    @property
    def login(self) -> str:
        if self.password is None:
            return f"{self.username} (its password was changed since; not shown)"
        return f"{self.username} / {self.password}"

    @property
    def api_key_shown(self) -> str:
        return self.api_key or "(the demo key was revoked or expired; make one in the console)"


def _credentials_path() -> Path:
    return Path(settings.VAR_DIR) / "demo-credentials.json"


def _load_saved() -> dict:
    path = _credentials_path()
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _save(credentials: DemoCredentials) -> None:
    private_file_write(_credentials_path(), json.dumps(asdict(credentials), indent=2))


@transaction.atomic
def demo_bootstrap() -> DemoCredentials:
    """Create what is missing of the demo tenant, its superuser owner and its API key, and
    return the credentials as far as they still work (see the module docstring)."""
    if not settings.IS_EMBEDDED:
        raise DemoRefused(
            f"The demo admin is for the embedded mode only (no DATABASE_URL); "
            f"{CREATE_SUPERUSER_HINT}."
        )
    saved = _load_saved()
    user_model = get_user_model()
    user = user_model.objects.filter(username=DEMO_USERNAME).first()
    password = saved.get("password")
    if user is None:
        password = secrets.token_urlsafe(12)
        user = user_model.objects.create_superuser(DEMO_USERNAME, "", password)
        audit_record(
            action=AuditEvent.Action.USER_CREATED,
            actor=None,
            target=user,
            changes=field_changes({}, model_values(user, ("username", "is_staff", "is_superuser"))),
        )
    elif not password or not user.check_password(password):
        password = None  # the operator's now

    tenant = Tenant.objects.filter(slug=DEMO_TENANT_SLUG).first()
    if tenant is None:
        tenant = services.tenant_create(slug=DEMO_TENANT_SLUG, name="Demo", owner=user)

    raw_key = saved.get("api_key")
    reason = _key_refusal(raw_key, tenant) if raw_key else "unknown"
    if reason in ("unknown", "malformed", "mismatch", "another_tenant"):  # never made here
        _, raw_key = services.api_key_create(tenant=tenant, name="demo", created_by=user)
    elif reason is not None:  # revoked or expired: the operator's decision
        raw_key = None

    credentials = DemoCredentials(username=DEMO_USERNAME, password=password, api_key=raw_key)
    _save(
        DemoCredentials(
            username=DEMO_USERNAME,
            password=password or saved.get("password"),
            api_key=raw_key or saved.get("api_key"),
        )
    )
    return credentials


def _key_refusal(raw_key: str, tenant: Tenant) -> str | None:
    """Why the saved key does not work for the demo tenant (``ApiKeyInvalid``'s reason, or
    ``another_tenant``); None when it does."""
    try:
        api_key = services.api_key_authenticate(raw_key=raw_key)
    except services.ApiKeyInvalid as exc:
        return exc.reason
    return None if api_key.tenant_id == tenant.pk else "another_tenant"
