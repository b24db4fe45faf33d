"""Loading and unloading a model on a real engine through the Celery task and the console."""

import pytest
from django.urls import reverse

from config import celery_app
from serving.models import ModelDeployment
from serving.services import deployment_register
from tests.gateway.conftest import Engine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def eager():
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@pytest.fixture
def own_engine(tiny_model_dir, tmp_path):
    engine = Engine(tiny_model_dir, f"ipc://{tmp_path}/control.sock", tmp_path / "engine.log")
    engine.start()
    engine.wait_ready()
    yield engine
    engine.stop()


def test_console_unloads_and_loads_a_model_through_celery(
    eager, own_engine, tiny_model_dir, admin_client, tmp_path
):
    deployment = deployment_register(name="switchable", endpoints=[own_engine.endpoint])
    action = reverse("console:deployment-action")
    form = {"deployment_id": deployment.pk, "endpoint": own_engine.endpoint}

    admin_client.post(action, {**form, "action": "unload"})
    replica = ModelDeployment.objects.get(pk=deployment.pk).replicas[own_engine.endpoint]
    assert replica["state"] == "unloaded" and replica["control"]["ok"] is True

    admin_client.post(action, {**form, "action": "load", "model": str(tmp_path / "missing")})
    replica = ModelDeployment.objects.get(pk=deployment.pk).replicas[own_engine.endpoint]
    assert (
        replica["control"]["ok"] is False
        and "no Hugging Face model" in replica["control"]["message"]
    )

    admin_client.post(action, {**form, "action": "load", "model": tiny_model_dir})
    replica = ModelDeployment.objects.get(pk=deployment.pk).replicas[own_engine.endpoint]
    assert replica["state"] == "ready" and replica["model_path"] == tiny_model_dir
    assert replica["control"]["ok"] is True
    assert own_engine.wait_ready().ready

    page = admin_client.get(reverse("console:platform")).content.decode()
    assert "last control: load" in page and tiny_model_dir in page


def test_control_refuses_an_endpoint_outside_the_deployment(eager, admin_client):
    deployment = deployment_register(name="m", endpoints=["tcp://127.0.0.1:1"])
    response = admin_client.post(
        reverse("console:deployment-action"),
        {"deployment_id": deployment.pk, "endpoint": "tcp://evil:1", "action": "unload"},
        follow=True,
    )
    assert "is not a replica" in response.content.decode()
