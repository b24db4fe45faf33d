from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from tenants import selectors, services
from tenants.models import Membership

pytestmark = pytest.mark.django_db


def _run(*args: str) -> list[str]:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue().strip().splitlines()


def test_create_tenant_prints_a_working_key_alone_on_its_last_line(user):
    lines = _run(
        "create_tenant",
        "acme",
        "--name",
        "Acme Inc",
        "--owner",
        "alice",
        "--rpm",
        "30",
        "--tpm",
        "9000",
        "--max-concurrent",
        "2",
        "--monthly-tokens",
        "500000",
    )

    api_key = services.api_key_authenticate(raw_key=lines[-1])
    tenant = api_key.tenant
    assert (tenant.slug, tenant.name) == ("acme", "Acme Inc")
    assert selectors.tenant_limits(tenant=tenant) == selectors.Limits(30, 9000, 2, 500000)
    assert selectors.user_role(user=user, tenant=tenant) == Membership.Role.OWNER


def test_create_api_key_prints_a_working_key_alone_on_its_last_line(tenant):
    lines = _run("create_api_key", "acme", "--name", "ci", "--expires-in-days", "30")

    api_key = services.api_key_authenticate(raw_key=lines[-1])
    assert api_key.tenant == tenant
    assert api_key.name == "ci"
    assert api_key.expires_at is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("create_tenant", "acme", "--owner", "nobody"), "No user named"),
        (("create_tenant", "acme", "--plan", "nope"), "No plan"),
        (("create_tenant", "bad slug"), "slug"),
        (("create_tenant", "acme", "--rpm", "-1"), "zero or more"),
        (("create_api_key", "nope"), "No tenant"),
        (("create_api_key", "acme", "--expires-in-days", "0"), "from 1 to 3650"),
        (("create_api_key", "acme", "--expires-in-days", "99999999999"), "from 1 to 3650"),
    ],
)
def test_commands_refuse_bad_input_clearly(tenant, args, message):
    if args[:2] == ("create_tenant", "acme"):
        args = ("create_tenant", "fresh", *args[2:])
    with pytest.raises(CommandError, match=message):
        _run(*args)


def test_create_tenant_refuses_an_existing_slug(tenant):
    with pytest.raises(CommandError, match="slug"):
        _run("create_tenant", tenant.slug)
