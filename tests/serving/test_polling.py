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
