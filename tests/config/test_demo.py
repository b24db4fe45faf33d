"""The demo bootstrap: the embedded mode only, and its credentials kept private."""

import io
import stat

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.core.management.base import OutputWrapper

from config import demo
from config.management.commands import runplatform
from tenants.models import ApiKey, Tenant

pytestmark = pytest.mark.django_db


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def var_dir(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    return tmp_path


@pytest.fixture
def production(settings, var_dir):
    settings.IS_EMBEDDED = False
    settings.RUN_ENGINE = settings.RUN_WORKER = False
    return settings


def _runplatform(monkeypatch, *args: str) -> str:
    """`manage.py runplatform` up to the point where it would start its children."""
    monkeypatch.setattr(runplatform.Supervisor, "run", lambda self: 0)
    out = io.StringIO()
    call_command("runplatform", *args, stdout=out)
    return out.getvalue()


def test_production_gets_no_demo_user_and_is_told_how_to_make_one(production, monkeypatch):
    output = _runplatform(monkeypatch)

    assert "Mode: production" in output
    assert "manage.py createsuperuser" in output
    assert "login:" not in output and "sk-" not in output
    assert not get_user_model().objects.filter(username=demo.DEMO_USERNAME).exists()
    assert not Tenant.objects.filter(slug=demo.DEMO_TENANT_SLUG).exists()
    assert not ApiKey.objects.exists()
    assert not (production.VAR_DIR / "demo-credentials.json").exists()


def test_production_never_resets_an_existing_admin(production, monkeypatch, django_user_model):
    admin = django_user_model.objects.create_superuser(demo.DEMO_USERNAME, "", "their-own-pw-1")
    _runplatform(monkeypatch)
    admin.refresh_from_db()
    assert admin.check_password("their-own-pw-1")


def test_the_bootstrap_refuses_to_run_in_production(production):
    with pytest.raises(demo.DemoRefused, match="createsuperuser"):
        demo.demo_bootstrap()
    with pytest.raises(CommandError, match="createsuperuser"):
        call_command("bootstrap_demo", stdout=OutputWrapper(io.StringIO()))
    assert not get_user_model().objects.exists()


def test_the_embedded_mode_bootstraps_and_keeps_the_credentials_private(
    settings, var_dir, monkeypatch
):
    settings.IS_EMBEDDED = True  # whatever DATABASE_URL this suite runs with
    settings.RUN_ENGINE = settings.RUN_WORKER = False
    saved = var_dir / "demo-credentials.json"
    saved.write_text("{}")
    saved.chmod(0o644)  # left readable by an older version

    output = _runplatform(monkeypatch)

    assert "Mode: embedded" in output and "login: admin / " in output
    assert _mode(saved) == 0o600
    assert demo.demo_bootstrap().password in saved.read_text()
    assert _mode(saved) == 0o600


@pytest.fixture
def embedded(settings, var_dir):
    settings.IS_EMBEDDED = True  # whatever DATABASE_URL this suite runs with
    settings.RUN_ENGINE = settings.RUN_WORKER = False
    return settings


def test_the_bootstrap_never_resets_or_re_enables_the_operators_admin(embedded, monkeypatch):
    """An operator changed admin's password and took its staff and superuser flags (and then
    its login): the next run restores none of it and prints no new password."""
    first = demo.demo_bootstrap()
    admin = get_user_model().objects.get(username=demo.DEMO_USERNAME)
    admin.set_password("the-operators-own-1")
    admin.is_staff = admin.is_superuser = admin.is_active = False
    admin.save()

    output = _runplatform(monkeypatch)
    again = demo.demo_bootstrap()

    admin.refresh_from_db()
    assert admin.check_password("the-operators-own-1")
    assert not (admin.is_staff or admin.is_superuser or admin.is_active)
    assert again.password is None and "not shown" in again.login
    assert first.password not in output and "login: admin (" in output
    assert again.api_key == first.api_key and first.api_key in output


def test_the_bootstrap_leaves_a_revoked_demo_key_and_a_removed_membership_alone(embedded):
    from tenants import services
    from tenants.models import Membership

    first = demo.demo_bootstrap()
    key = services.api_key_authenticate(raw_key=first.api_key)
    services.api_key_revoke(api_key=key)
    Membership.objects.filter(user__username=demo.DEMO_USERNAME).delete()

    again = demo.demo_bootstrap()

    assert again.api_key is None and "revoked" in again.api_key_shown
    assert ApiKey.objects.count() == 1
    assert not Membership.objects.filter(user__username=demo.DEMO_USERNAME).exists()
    assert again.password == first.password  # still true, so still shown


def test_the_bootstrap_creates_only_what_is_missing(embedded):
    first = demo.demo_bootstrap()
    assert demo.demo_bootstrap() == first  # nothing changed: the same login and key
    get_user_model().objects.filter(username=demo.DEMO_USERNAME).delete()

    again = demo.demo_bootstrap()

    admin = get_user_model().objects.get(username=demo.DEMO_USERNAME)
    assert admin.is_superuser and admin.check_password(again.password)
    assert again.password != first.password
