import asyncio

import pytest
from django.conf import settings

from config import celery_app
from serving.models import ModelDeployment
from serving.services import deployment_register
from serving.tasks import poll_engine_health

pytestmark = pytest.mark.django_db


def test_polling_records_each_replicas_state(engine, tmp_path):
    engine.wait_ready()
    deployment_register(name="up", endpoints=[engine.endpoint])
    deployment_register(name="half", endpoints=[engine.endpoint, f"ipc://{tmp_path}/none.sock"])
    deployment_register(name="gone", endpoints=[f"ipc://{tmp_path}/gone.sock"])
    deployment_register(name="off", endpoints=[engine.endpoint], is_enabled=False)

    celery_app.conf.task_always_eager = True
    try:
        states = poll_engine_health.delay().get()
    finally:
        celery_app.conf.task_always_eager = False

    assert states == {"up": "ready", "half": "degraded", "gone": "down"}
    up = ModelDeployment.objects.get(name="up")
    replica = up.replicas[engine.endpoint]
    assert replica["ready"] and replica["max_model_len"] > 0
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage"} <= set(replica)
    assert up.checked_at is not None
    assert ModelDeployment.objects.get(name="off").health == "unknown"


def test_the_task_names_beat_and_queued_messages_carry_are_registered():
    celery_app.loader.import_default_modules()
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "serving.poll_engine_health" in scheduled
    assert {*scheduled, "serving.control_engine"} <= set(celery_app.tasks)


ENDPOINT = "tcp://127.0.0.1:1"
CONTROL = {"action": "load", "model": "/models/x", "ok": False, "message": "no model there"}


def _answering(monkeypatch, meanwhile=None) -> None:
    """Every replica answers ready; ``meanwhile`` runs (on a thread of its own, as another
    process would) while the poll waits for the answers."""
    from serving import polling

    def another_process() -> None:
        from django.db import connections

        try:
            meanwhile()
        finally:
            connections.close_all()

    async def poll(endpoints):
        if meanwhile is not None:
            await asyncio.to_thread(another_process)
        return {e: {"state": "ready", "ready": True, "engine_id": "e1"} for e in endpoints}

    monkeypatch.setattr(polling, "_poll", poll)


def test_a_poll_keeps_each_replicas_last_load_or_unload(monkeypatch):
    """The poll replaced each replica's state whole: the console's "last control: load …
    failed: why" was gone within 15 s."""
    from serving.polling import poll_deployments

    deployment = deployment_register(name="m", endpoints=[ENDPOINT])
    ModelDeployment.objects.filter(pk=deployment.pk).update(
        replicas={ENDPOINT: {"state": "ready", "ready": True, "control": CONTROL}}
    )
    _answering(monkeypatch)

    assert poll_deployments() == {"m": "ready"}

    replica = ModelDeployment.objects.get(pk=deployment.pk).replicas[ENDPOINT]
    assert replica["control"] == CONTROL and replica["engine_id"] == "e1"


@pytest.mark.django_db(transaction=True)
def test_a_load_recorded_while_the_poll_waits_is_kept(monkeypatch):
    """The poll wrote back the states it had read before its wait."""
    from serving.polling import poll_deployments

    deployment = deployment_register(name="m", endpoints=[ENDPOINT])

    def load_recorded() -> None:
        ModelDeployment.objects.filter(pk=deployment.pk).update(
            replicas={ENDPOINT: {"control": {**CONTROL, "ok": None, "state": "sent"}}}
        )

    _answering(monkeypatch, meanwhile=load_recorded)
    poll_deployments()

    replica = ModelDeployment.objects.get(pk=deployment.pk).replicas[ENDPOINT]
    assert replica["control"]["state"] == "sent" and replica["ready"]


@pytest.mark.django_db(transaction=True)
def test_a_deployment_registered_again_meanwhile_waits_for_the_next_poll(monkeypatch):
    from serving.polling import poll_deployments

    deployment_register(name="m", endpoints=[ENDPOINT])
    _answering(
        monkeypatch,
        meanwhile=lambda: deployment_register(name="m", endpoints=["tcp://127.0.0.1:2"]),
    )

    assert poll_deployments() == {}
    moved = ModelDeployment.objects.get(name="m")
    assert (moved.health, moved.replicas) == ("unknown", {})
