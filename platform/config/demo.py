"""The embedded mode's demo data: a tenant, a superuser and an API key that `make run`
makes sure exist, with credentials kept in ``var/`` (owner-only) so every run can print them.

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
from tenants.models import Membership, Tenant

DEMO_TENANT_SLUG = "demo"
DEMO_USERNAME = "admin"
CREATE_SUPERUSER_HINT = "create a superuser with `python manage.py createsuperuser`"


class DemoRefused(RuntimeError):
    """The demo bootstrap was asked for outside the embedded mode."""


@dataclass
class DemoCredentials:
    username: str
    password: str
    api_key: str


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
    """Make sure the demo tenant, its superuser owner and a working API key exist.

    Saved credentials are reused while they still work; a password or key that no longer
    works (changed, revoked) is replaced, never silently printed stale.
    """
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
    elif not password or not user.check_password(password):
        password = secrets.token_urlsafe(12)
        user.set_password(password)
        user.is_staff = user.is_superuser = user.is_active = True
        user.save()

    tenant = Tenant.objects.filter(slug=DEMO_TENANT_SLUG).first()
    if tenant is None:
        tenant = services.tenant_create(slug=DEMO_TENANT_SLUG, name="Demo", owner=user)
    else:
        services.membership_set(tenant=tenant, user=user, role=Membership.Role.OWNER, actor=None)

    raw_key = saved.get("api_key")
    if not raw_key or not _key_works(raw_key, tenant):
        _, raw_key = services.api_key_create(tenant=tenant, name="demo", created_by=user)

    credentials = DemoCredentials(username=DEMO_USERNAME, password=password, api_key=raw_key)
    _save(credentials)
    return credentials


def _key_works(raw_key: str, tenant: Tenant) -> bool:
    try:
        api_key = services.api_key_authenticate(raw_key=raw_key)
    except services.ApiKeyInvalid:
        return False
    return api_key.tenant_id == tenant.pk
