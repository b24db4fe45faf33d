from celery import shared_task

from serving.health import control_replica, poll_deployments
from serving.models import ModelDeployment


@shared_task(name="serving.poll_engine_health")
def poll_engine_health() -> dict[str, str]:
    return poll_deployments()


@shared_task(name="serving.control_engine")
def control_engine(deployment_id: int, endpoint: str, action: str, model: str | None = None):
    """Load or unload a model on one replica (CONTROL), following it until it is done."""
    deployment = ModelDeployment.objects.get(pk=deployment_id)
    return control_replica(deployment=deployment, endpoint=endpoint, action=action, model=model)
