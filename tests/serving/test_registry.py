from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from serving.models import ModelDeployment
from serving.selectors import deployment_for_tenant, deployments_for_tenant, prefix_cache_salt
from tenants import services
from tenants.models import Plan

pytestmark = pytest.mark.django_db


def test_register_deployment_command_creates_and_updates():
    out = StringIO()
    call_command(
        "register_deployment", "qwen-7b", "--endpoint", "tcp://10.0.0.5:5555",
        "--endpoint", "ipc:///run/e.sock", "--max-context", "8192", stdout=out,
    )  # fmt: skip
    deployment = ModelDeployment.objects.get(name="qwen-7b")
    assert deployment.endpoints == ["tcp://10.0.0.5:5555", "ipc:///run/e.sock"]
    assert deployment.max_context == 8192 and deployment.is_enabled
    call_command("register_deployment", "qwen-7b", "--endpoint", "tcp://h:1", "--disabled")
    deployment.refresh_from_db()
    assert deployment.endpoints == ["tcp://h:1"] and not deployment.is_enabled
    assert ModelDeployment.objects.count() == 1


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [("bad name", "tcp://h:1"), ("ok", "http://h:1"), ("ok", ""), ("-x", "tcp://h:1")],
)
def test_register_deployment_refuses_bad_input(name, endpoint):
    with pytest.raises(CommandError):
        call_command("register_deployment", name, "--endpoint", endpoint)


def test_plans_and_allowed_models_both_gate_access():
    pro = Plan.objects.create(slug="pro", name="Pro")
    narrow = Plan.objects.create(slug="narrow", name="Narrow", allowed_models=["open"])
    pro_tenant = services.tenant_create(slug="a", plan=pro)
    narrow_tenant = services.tenant_create(slug="b", plan=narrow)
    open_model = ModelDeployment.objects.create(name="open", endpoints=["tcp://h:1"])
    pro_only = ModelDeployment.objects.create(name="pro-only", endpoints=["tcp://h:2"])
    pro_only.plans.add(pro)
    ModelDeployment.objects.create(name="off", endpoints=["tcp://h:3"], is_enabled=False)

    assert [d.name for d in deployments_for_tenant(tenant=pro_tenant)] == ["open", "pro-only"]
    assert [d.name for d in deployments_for_tenant(tenant=narrow_tenant)] == ["open"]
    assert deployment_for_tenant(tenant=narrow_tenant, name="pro-only") is None
    assert deployment_for_tenant(tenant=pro_tenant, name="off") is None
    assert deployment_for_tenant(tenant=pro_tenant, name="open") == open_model


@pytest.mark.parametrize("stored", [5, "open", {"x": 1}, [1, 2]])
def test_allowed_models_stored_before_they_were_checked_open_no_model(stored):
    """A number failed every request of the plan's tenants (a 500); now it opens no model
    until an admin corrects it (the plan form refuses anything but a list of names)."""
    plan = Plan.objects.create(slug="old", name="Old")
    Plan.objects.filter(pk=plan.pk).update(allowed_models=stored)
    tenant = services.tenant_create(slug="a", plan=Plan.objects.get(pk=plan.pk))
    ModelDeployment.objects.create(name="open", endpoints=["tcp://h:1"])

    assert list(deployments_for_tenant(tenant=tenant)) == []


@pytest.mark.parametrize(
    ("stored", "migrated"),
    [("open", ["open"]), (["open", 1], ["open"]), ([1, 2], [1, 2]), (5, 5), ([], [])],
)
def test_the_migration_makes_stored_names_lists(stored, migrated):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("tenants.migrations.0012_plan_allowed_models_as_names")
    plan = Plan.objects.create(slug="old", name="Old")
    Plan.objects.filter(pk=plan.pk).update(allowed_models=stored)

    migration.names_as_lists(apps, None)

    assert Plan.objects.get(pk=plan.pk).allowed_models == migrated


def test_each_tenant_has_its_own_prefix_cache_unless_the_deployment_shares_it():
    first, second = services.tenant_create(slug="acme"), services.tenant_create(slug="globex")
    deployment = ModelDeployment.objects.create(name="m", endpoints=["ipc:///tmp/m.sock"])
    salts = {prefix_cache_salt(tenant=t, deployment=deployment) for t in (first, second)}
    assert len(salts) == 2 and None not in salts

    # the chat's users of one tenant: each their own (their conversations are private)
    alice = User.objects.create_user("alice")
    bob = User.objects.create_user("bob")
    user_salts = {
        prefix_cache_salt(tenant=first, deployment=deployment, user=u) for u in (alice, bob)
    }
    assert len(user_salts | salts) == 4

    deployment.shares_prefix_cache = True
    assert prefix_cache_salt(tenant=first, deployment=deployment) is None
    assert prefix_cache_salt(tenant=first, deployment=deployment, user=alice) is None
