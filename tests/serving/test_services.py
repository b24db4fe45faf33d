"""The deployment registry's writes and the rules on a load or unload request. Sending the
request to an engine is the Celery task's job (tests/serving/test_control.py); here the queue
is replaced by a list."""

import pytest
from django.core.exceptions import ValidationError

from serving import services
from serving.models import ModelDeployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def queued(monkeypatch) -> list[tuple]:
    """The arguments of each ``serving.control_engine`` task queued."""
    calls: list[tuple] = []
    monkeypatch.setattr(services.control_engine, "delay", lambda *args: calls.append(args))
    return calls


@pytest.fixture
def deployment() -> ModelDeployment:
    return services.deployment_register(name="m", endpoints=["tcp://h:1", "tcp://h:2"])


def test_a_load_or_unload_is_queued_for_one_replica(queued, deployment):
    services.deployment_control_request(
        deployment_id=deployment.pk, endpoint="tcp://h:2", action="load", model=" /models/x "
    )
    services.deployment_control_request(
        deployment_id=deployment.pk, endpoint="tcp://h:1", action="unload", model=""
    )
    assert queued == [
        (deployment.pk, "tcp://h:2", "load", "/models/x"),
        (deployment.pk, "tcp://h:1", "unload", None),
    ]


@pytest.mark.parametrize(
    ("endpoint", "action", "model", "message"),
    [
        ("tcp://evil:1", "unload", None, "is not a replica of m"),
        ("tcp://h:1", "load", None, "Give the model directory"),
        ("tcp://h:1", "load", "   ", "Give the model directory"),
        ("tcp://h:1", "delete", None, "Unknown action"),
    ],
)
def test_a_control_request_is_refused_before_anything_is_queued(
    queued, deployment, endpoint, action, model, message
):
    with pytest.raises(ValidationError, match=message):
        services.deployment_control_request(
            deployment_id=deployment.pk, endpoint=endpoint, action=action, model=model
        )
    assert queued == []


@pytest.mark.parametrize("deployment_id", [None, 10**6])
def test_no_deployment_no_control_request(queued, deployment_id):
    with pytest.raises(ModelDeployment.DoesNotExist):
        services.deployment_control_request(
            deployment_id=deployment_id, endpoint="tcp://h:1", action="unload"
        )
    assert queued == []


def test_a_deployment_is_disabled_and_enabled_by_id(deployment):
    services.deployment_set_enabled(deployment_id=deployment.pk, is_enabled=False)
    assert not ModelDeployment.objects.get(pk=deployment.pk).is_enabled
    services.deployment_set_enabled(deployment_id=deployment.pk, is_enabled=True)
    assert ModelDeployment.objects.get(pk=deployment.pk).is_enabled
    with pytest.raises(ModelDeployment.DoesNotExist):
        services.deployment_set_enabled(deployment_id=None, is_enabled=False)


def test_registering_again_forgets_what_was_polled_before(deployment):
    # make run registers its engine at every start: the last run's "down" must not show
    ModelDeployment.objects.filter(pk=deployment.pk).update(
        health=ModelDeployment.Health.DOWN, replicas={"tcp://h:1": {"error": "no answer"}}
    )
    services.deployment_register(name="m", endpoints=["tcp://h:1", "tcp://h:2"])
    deployment.refresh_from_db()
    assert deployment.health == ModelDeployment.Health.UNKNOWN
    assert deployment.replicas == {} and deployment.checked_at is None


def test_registering_again_keeps_what_an_admin_set_unless_told(deployment):
    """``make run`` registers its engine at each start: it re-enabled a deployment an admin
    had closed, and dropped its context limit."""
    services.deployment_set_enabled(deployment_id=deployment.pk, is_enabled=False)
    services.deployment_register(name="m", endpoints=["tcp://h:1"], max_context=128)
    again = services.deployment_register(name="m", endpoints=["tcp://h:3"])

    assert (again.endpoints, again.is_enabled, again.max_context) == (["tcp://h:3"], False, 128)
    told = services.deployment_register(
        name="m", endpoints=["tcp://h:3"], max_context=None, is_enabled=True
    )
    assert (told.is_enabled, told.max_context) == (True, None)
    fresh = services.deployment_register(name="new", endpoints=["tcp://h:4"])
    assert (fresh.is_enabled, fresh.max_context) == (True, None)


@pytest.mark.parametrize(
    ("flags", "is_enabled", "max_context"),
    [([], False, 128), (["--enabled"], True, 128), (["--max-context", "64"], False, 64)],
)
def test_the_command_keeps_what_it_is_not_given(deployment, flags, is_enabled, max_context):
    from django.core.management import call_command

    services.deployment_set_enabled(deployment_id=deployment.pk, is_enabled=False)
    services.deployment_register(name="m", endpoints=["tcp://h:1"], max_context=128)

    call_command("register_deployment", "m", "--endpoint", "tcp://h:9", *flags)

    stored = ModelDeployment.objects.get(name="m")
    assert (stored.endpoints, stored.is_enabled, stored.max_context) == (
        ["tcp://h:9"],
        is_enabled,
        max_context,
    )


def test_a_broker_out_of_reach_is_said_in_the_console_and_audits_nothing(
    monkeypatch, deployment, client, django_user_model
):
    """The broker (Redis) down: the console's load or unload was a 500."""
    from django.urls import reverse
    from kombu.exceptions import OperationalError

    from tenants.models import AuditEvent

    def unreachable(*args):
        raise OperationalError("Error 111 connecting to localhost:6379. Connection refused.")

    monkeypatch.setattr(services.control_engine, "delay", unreachable)
    client.force_login(django_user_model.objects.create_superuser("root", "", "pw-root-123"))
    before = AuditEvent.objects.count()
    answer = client.post(
        reverse("console:deployment-action"),
        {"action": "unload", "deployment_id": deployment.pk, "endpoint": "tcp://h:1"},
        follow=True,
    )

    assert answer.status_code == 200
    assert "could not be queued" in answer.content.decode()
    assert AuditEvent.objects.count() == before
