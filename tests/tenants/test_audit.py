"""The audit log's writes: each change to a tenant's or the platform's set-up, from the services,
the console and the admin, is one event with its actor, address and changes; a change that
does not happen (refused, rolled back, a no-op) leaves none."""

import io
import json
from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from serving import services as serving_services
from serving.models import ModelDeployment
from tenants import services
from tenants.audit import HIDDEN_VALUE, client_ip
from tenants.models import ApiKey, AuditEvent, Plan
from tenants.tasks import purge_old_audit_events

pytestmark = pytest.mark.django_db

Action = AuditEvent.Action


def _events(**filters) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(**filters).order_by("id"))


@pytest.fixture
def owner(django_user_model, tenant):
    owner = django_user_model.objects.create_user("olive", password="pw-olive-123")
    services.membership_set(tenant=tenant, user=owner, role="owner", actor=None)
    return owner


@pytest.fixture
def staff_client(client, admin_user):
    client.force_login(admin_user)
    return client


def test_a_tenant_made_with_its_owner_is_two_events_by_the_platform(django_user_model):
    founder = django_user_model.objects.create_user("founder", password="pw-founder-123")
    tenant = services.tenant_create(slug="initech", name="Initech", owner=founder)

    created, added = _events(tenant=tenant)
    assert (created.action, added.action) == (Action.TENANT_CREATED, Action.MEMBER_ADDED)
    assert created.actor is None and created.actor_name == ""
    assert created.tenant_slug == "initech" and created.target_name == "initech"
    assert created.changes["name"] == [None, "Initech"]
    assert created.changes["plan"] == [None, "Default"]
    assert added.target_name == "founder" and added.changes == {"role": [None, "owner"]}


def test_a_key_created_and_revoked_twice_is_two_events_without_its_secret(tenant, owner):
    api_key, raw_key = services.api_key_issue(
        tenant=tenant, name="prod", created_by=owner, expires_in_days=30
    )
    services.api_key_revoke_by_id(tenant=tenant, api_key_id=api_key.pk, actor=owner)
    revoked_at = ApiKey.objects.get(pk=api_key.pk).revoked_at
    again = services.api_key_revoke_by_id(tenant=tenant, api_key_id=api_key.pk, actor=owner)

    created, revoked = _events(target_id=str(api_key.pk), action__startswith="api_key.")
    assert (created.action, revoked.action) == (Action.API_KEY_CREATED, Action.API_KEY_REVOKED)
    assert {created.actor, revoked.actor} == {owner}
    assert created.target_name == f"prod ({api_key.display_prefix})"
    assert created.changes["name"] == [None, "prod"]
    assert created.changes["expires_at"][1].startswith(str(api_key.expires_at.date()))
    stored = json.dumps([created.changes, created.target_name])
    assert raw_key not in stored and api_key.key_hash not in stored
    assert again.revoked_at == revoked_at  # the second revocation changed nothing


def test_a_command_key_for_an_owner_is_the_platforms_doing(tenant, owner):
    api_key, _ = services.api_key_create(tenant=tenant, name="default", created_by=owner)
    (event,) = _events(action=Action.API_KEY_CREATED)
    assert api_key.created_by == owner and event.actor is None


def test_membership_changes_are_events_and_no_ops_are_not(django_user_model, tenant, owner):
    bob = django_user_model.objects.create_user("bob", password="pw-bob-123")
    services.membership_set(tenant=tenant, user=bob, role="member", actor=owner)
    services.membership_set(tenant=tenant, user=bob, role="member", actor=owner)  # no-op
    membership = services.membership_set(tenant=tenant, user=bob, role="admin", actor=owner)
    services.membership_remove(membership=membership, actor=owner)

    events = _events(target_id=str(bob.pk), action__startswith="member.")
    assert [(event.action, event.changes["role"]) for event in events] == [
        (Action.MEMBER_ADDED, [None, "member"]),
        (Action.MEMBER_ROLE_CHANGED, ["member", "admin"]),
        (Action.MEMBER_REMOVED, ["admin", None]),
    ]
    assert {event.actor_name for event in events} == {"olive"}
    assert {event.tenant_id for event in events} == {tenant.pk}


def test_a_refused_change_leaves_no_event(tenant, owner):
    before = AuditEvent.objects.count()
    membership = tenant.memberships.get(user=owner)
    with pytest.raises(services.LastOwnerError):
        services.membership_change_role(membership=membership, role="member", actor=owner)
    assert AuditEvent.objects.count() == before


def test_deactivating_a_user_is_an_event_once(django_user_model, admin_user):
    bob = django_user_model.objects.create_user("bob", password="pw-bob-123")
    services.user_deactivate(user=bob, actor=admin_user)
    services.user_deactivate(user=bob, actor=admin_user)
    (event,) = _events(action=Action.USER_UPDATED)
    assert event.tenant is None and event.target_name == "bob"
    assert event.changes == {"is_active": [True, False]} and event.actor == admin_user


def test_deployment_changes_and_requests_are_events(monkeypatch, admin_user):
    queued = []
    monkeypatch.setattr(serving_services.control_engine, "delay", lambda *a: queued.append(a))
    register = serving_services.deployment_register
    deployment = register(name="m", endpoints=["ipc:///tmp/m.sock"], actor=admin_user)
    register(name="m", endpoints=["ipc:///tmp/m.sock"])  # make run starting again: no change
    register(name="m", endpoints=["ipc:///tmp/m.sock", "tcp://10.0.0.2:5555"], actor=admin_user)
    serving_services.deployment_set_enabled(
        deployment_id=deployment.pk, is_enabled=False, actor=admin_user
    )
    serving_services.deployment_set_enabled(
        deployment_id=deployment.pk, is_enabled=False, actor=admin_user
    )
    serving_services.deployment_control_request(
        deployment_id=deployment.pk,
        endpoint="ipc:///tmp/m.sock",
        action="load",
        model="/models/next",
        actor=admin_user,
    )

    events = _events(target_id=str(deployment.pk), action__startswith="deployment.")
    assert [event.action for event in events] == [
        Action.DEPLOYMENT_CREATED,
        Action.DEPLOYMENT_UPDATED,
        Action.DEPLOYMENT_UPDATED,
        Action.REPLICA_LOAD,
    ]
    assert events[0].changes["endpoints"] == [None, ["ipc:///tmp/m.sock"]]
    assert events[1].changes == {
        "endpoints": [["ipc:///tmp/m.sock"], ["ipc:///tmp/m.sock", "tcp://10.0.0.2:5555"]]
    }
    assert events[2].changes == {"is_enabled": [True, False]}
    assert events[3].changes == {
        "endpoint": [None, "ipc:///tmp/m.sock"],
        "model": [None, "/models/next"],
    }
    assert all(event.tenant is None for event in events) and len(queued) == 1


def test_a_request_the_broker_refused_leaves_no_event(monkeypatch):
    deployment = serving_services.deployment_register(name="m", endpoints=["ipc:///tmp/m.sock"])

    def broker_down(*args):
        raise ConnectionError("broker down")

    monkeypatch.setattr(serving_services.control_engine, "delay", broker_down)
    with pytest.raises(serving_services.ControlNotQueued):
        serving_services.deployment_control_request(
            deployment_id=deployment.pk, endpoint="ipc:///tmp/m.sock", action="unload"
        )
    assert not _events(action=Action.REPLICA_UNLOAD)


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"REMOTE_ADDR": "203.0.113.9"}, "203.0.113.9"),
        # a client that is not a trusted proxy cannot name another address
        ({"REMOTE_ADDR": "203.0.113.9", "HTTP_X_FORWARDED_FOR": "198.51.100.1"}, "203.0.113.9"),
        # behind the proxy: the nearest hop it did not add itself, not what the client wrote
        (
            {"REMOTE_ADDR": "10.1.2.3", "HTTP_X_FORWARDED_FOR": "6.6.6.6, 198.51.100.1"},
            "198.51.100.1",
        ),  # fmt: skip
        (
            {"REMOTE_ADDR": "10.1.2.3", "HTTP_X_FORWARDED_FOR": "198.51.100.1, 10.9.9.9"},
            "198.51.100.1",
        ),  # fmt: skip
        ({"REMOTE_ADDR": "10.1.2.3", "HTTP_X_FORWARDED_FOR": "junk"}, "10.1.2.3"),
        ({"REMOTE_ADDR": "10.1.2.3"}, "10.1.2.3"),
        ({"REMOTE_ADDR": ""}, None),  # a unix socket
        ({}, None),
    ],
)
def test_the_client_address_trusts_only_named_proxies(meta, expected):
    with override_settings(FORWARDED_ALLOW_IPS=["10.0.0.0/8", "::1"]):
        assert client_ip(meta) == expected


def test_the_console_records_the_actor_and_address(client, tenant, owner):
    client.force_login(owner)
    url = reverse("console:keys", args=[tenant.slug])
    response = client.post(url, {"action": "create", "name": "ci"}, REMOTE_ADDR="203.0.113.7")
    assert response.status_code == 200
    (event,) = _events(action=Action.API_KEY_CREATED)
    assert (event.actor, event.ip_address, event.tenant) == (owner, "203.0.113.7", tenant)


def test_admin_changes_are_events_with_what_changed(staff_client, admin_user, tenant):
    url = reverse("admin:tenants_tenant_change", args=[tenant.pk])
    form = {
        "name": "Acme", "slug": "acme", "plan": tenant.plan.pk, "is_active": "on",
        "requests_per_minute": "5",
        "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0",
    }  # fmt: skip
    assert staff_client.post(url, form).status_code == 302
    assert staff_client.post(url, form).status_code == 302  # saved again unchanged: no event

    (event,) = _events(action=Action.TENANT_UPDATED)
    assert event.changes == {"requests_per_minute": [None, 5]}
    assert (event.actor, event.tenant) == (admin_user, tenant)


def test_admin_made_superusers_are_in_the_log_without_passwords(
    staff_client, django_user_model, admin_user
):
    bob = django_user_model.objects.create_user("bob", password="pw-bob-123")
    url = reverse("admin:auth_user_change", args=[bob.pk])
    form = {
        "username": "bob", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "last_login_0": "", "last_login_1": "",
        "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00",
    }  # fmt: skip
    response = staff_client.post(url, form)
    assert response.status_code == 302, response.content

    (event,) = _events(action=Action.USER_UPDATED)
    assert event.changes["is_staff"] == [False, True]
    assert event.changes["is_superuser"] == [False, True]
    assert "password" not in event.changes and event.target_name == "bob"
    assert bob.password not in json.dumps(event.changes)


def test_admin_added_keys_are_one_event_and_deletions_one_each(staff_client, admin_user, tenant):
    staff_client.post(reverse("admin:tenants_apikey_add"), {"tenant": tenant.pk, "name": "adm"})
    (created,) = _events(action=Action.API_KEY_CREATED)
    assert created.actor == admin_user and created.tenant == tenant

    Plan.objects.create(slug="gold", name="Gold")
    Plan.objects.create(slug="silver", name="Silver")
    response = staff_client.post(
        reverse("admin:tenants_plan_changelist"),
        {
            "action": "delete_selected",
            "_selected_action": list(
                Plan.objects.filter(slug__in=["gold", "silver"]).values_list("pk", flat=True)
            ),
            "post": "yes",
        },
    )
    assert response.status_code == 302
    assert sorted(e.target_name for e in _events(action=Action.PLAN_DELETED)) == ["Gold", "Silver"]


def test_admin_registered_deployments_list_their_plans(staff_client, admin_user):
    gold = Plan.objects.create(slug="gold", name="Gold")
    response = staff_client.post(
        reverse("admin:serving_modeldeployment_add"),
        {
            "name": "big",
            "endpoints": '["ipc:///tmp/big.sock"]',
            "health": "unknown",
            "replicas": "{}",
            "plans": [gold.pk],
            "is_enabled": "on",
            "owned_by": "platform",
            "created_at_0": "2026-01-01",
            "created_at_1": "00:00:00",
        },  # fmt: skip
    )
    assert response.status_code == 302, response.content
    (event,) = _events(action=Action.DEPLOYMENT_CREATED)
    assert event.changes["plans"] == [None, ["Gold"]]
    assert event.target_id == str(ModelDeployment.objects.get(name="big").pk)


def test_the_admin_shows_the_log_and_nobody_edits_it(staff_client, tenant):
    services.api_key_create(tenant=tenant, name="x")
    event = AuditEvent.objects.get(action=Action.API_KEY_CREATED)
    assert staff_client.get(reverse("admin:tenants_auditevent_changelist")).status_code == 200
    assert staff_client.get(reverse("admin:tenants_auditevent_add")).status_code == 403
    change = reverse("admin:tenants_auditevent_change", args=[event.pk])
    assert staff_client.get(change).status_code == 200  # read only
    staff_client.post(change, {"action": "tenant.deleted"})
    assert AuditEvent.objects.get(pk=event.pk).action == Action.API_KEY_CREATED
    delete = reverse("admin:tenants_auditevent_delete", args=[event.pk])
    assert staff_client.post(delete, {"post": "yes"}).status_code == 403


def test_events_outlive_their_tenant_actor_and_key(django_user_model, tenant, owner):
    api_key, _ = services.api_key_issue(
        tenant=tenant, name="prod", created_by=owner, expires_in_days=None
    )
    api_key.delete()
    owner.delete()
    tenant.delete()
    event = AuditEvent.objects.get(action=Action.API_KEY_CREATED)
    assert (event.tenant, event.actor) == (None, None)
    assert (event.tenant_slug, event.actor_name) == ("acme", "olive")
    assert event.target_name.startswith("prod (sk-")


def test_old_events_are_purged_after_the_retention(tenant):
    AuditEvent.objects.all().delete()
    services.api_key_create(tenant=tenant, name="old")
    AuditEvent.objects.update(created_at=timezone.now() - timedelta(days=40))
    services.api_key_create(tenant=tenant, name="new")
    with override_settings(AUDIT_RETENTION_DAYS=0):
        assert purge_old_audit_events() == 0
    with override_settings(AUDIT_RETENTION_DAYS=30):
        assert purge_old_audit_events() == 1
    assert [event.changes["name"][1] for event in AuditEvent.objects.all()] == ["new"]


def test_a_hidden_field_is_shown_changed_never_by_value():
    from tenants.audit import _Hidden, field_changes

    assert field_changes({"password": _Hidden("a")}, {"password": _Hidden("b")}) == {
        "password": [HIDDEN_VALUE, HIDDEN_VALUE]
    }
    assert field_changes({"password": _Hidden("a")}, {"password": _Hidden("a")}) == {}


def test_a_password_set_in_the_admin_is_a_change_its_value_hidden(staff_client, admin_user):
    from django.contrib.auth import get_user_model

    bob = get_user_model().objects.create_user("bob", password="old-pass-123")
    url = reverse("admin:auth_user_password_change", args=[bob.pk])
    new = {"password1": "N3w-pass-xyz!", "password2": "N3w-pass-xyz!"}
    assert staff_client.post(url, new).status_code == 302
    (event,) = _events(action=Action.USER_UPDATED)
    assert event.changes == {"password": [HIDDEN_VALUE, HIDDEN_VALUE]}
    assert (event.actor, event.target_name) == (admin_user, "bob")
    assert staff_client.post(url, {"password1": "a", "password2": "b"}).status_code == 200
    assert len(_events(action=Action.USER_UPDATED)) == 1  # refused: no event


def test_a_user_deleted_in_the_admin_leaves_each_tenants_log_a_removal(
    staff_client, django_user_model, tenant, owner
):
    bob = django_user_model.objects.create_user("bob", password="x")
    services.membership_set(tenant=tenant, user=bob, role="admin", actor=None)
    url = reverse("admin:auth_user_delete", args=[bob.pk])
    assert staff_client.post(url, {"post": "yes"}).status_code == 302
    (removed,) = _events(tenant=tenant, action=Action.MEMBER_REMOVED)
    assert (removed.target_name, removed.changes) == ("bob", {"role": ["admin", None]})
    assert _events(action=Action.USER_DELETED)[0].target_name == "bob"


def test_an_admin_edit_records_what_the_editor_changed_only(staff_client, admin_user):
    """The form was compared whole with the row: what the health poll wrote since the page
    was opened, and the seconds the time widget drops, showed as the editor's changes."""
    deployment = serving_services.deployment_register(name="m", endpoints=["ipc:///tmp/m.sock"])
    url = reverse("admin:serving_modeldeployment_change", args=[deployment.pk])
    form = {
        "name": "m", "description": "now described", "endpoints": '["ipc:///tmp/m.sock"]',
        "is_enabled": "on", "owned_by": "platform",
    }  # fmt: skip
    ModelDeployment.objects.filter(pk=deployment.pk).update(health="ready", replicas={"x": {}})
    assert staff_client.post(url, form).status_code == 302
    (event,) = _events(action=Action.DEPLOYMENT_UPDATED)
    assert event.changes == {"description": ["", "now described"]}
    stored = ModelDeployment.objects.get(pk=deployment.pk)
    assert (stored.health, stored.replicas) == ("ready", {"x": {}})  # not written back


def test_what_start_up_makes_is_the_platforms_doing(settings, tmp_path):
    from config.demo import demo_bootstrap

    settings.VAR_DIR, settings.IS_EMBEDDED = tmp_path, True  # whatever database this runs on
    Plan.objects.filter(slug="default").delete()
    demo_bootstrap()
    events = {(event.action, event.target_name) for event in AuditEvent.objects.all()}
    assert {("user.created", "admin"), ("plan.created", "Default")} <= events
    assert {event.actor_name for event in AuditEvent.objects.all()} == {""}


def test_djangos_user_commands_are_in_the_platform_audit_log(django_user_model, monkeypatch):
    """``createsuperuser`` (the README's way to the first admin with PostgreSQL) and
    ``changepassword`` are Django's own commands: they made a superuser and set passwords
    with no event, where the console, the admin and the demo bootstrap all write one."""
    from django.core.management import call_command

    monkeypatch.setenv("DJANGO_SUPERUSER_PASSWORD", "pw-root-12345")
    call_command("createsuperuser", username="root", email="", interactive=False, verbosity=0)
    root = django_user_model.objects.get(username="root")
    [created] = _events(action=Action.USER_CREATED, target_id=str(root.pk))
    assert created.actor is None and created.tenant is None
    assert created.changes["is_superuser"] == [None, True]

    monkeypatch.setattr("getpass.getpass", lambda prompt="": "pw-new-678910")
    call_command("changepassword", "root", verbosity=0, stdout=io.StringIO())
    [changed] = _events(action=Action.USER_UPDATED, target_id=str(root.pk))
    assert changed.changes == {"password": [HIDDEN_VALUE, HIDDEN_VALUE]}
    root.refresh_from_db()
    assert root.check_password("pw-new-678910")
