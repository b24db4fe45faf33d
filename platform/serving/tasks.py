from celery import shared_task

from serving.models import ModelDeployment
from serving.polling import poll_deployments
from serving.replica_control import control_replica
from serving.usage_spool import spool_replay


@shared_task(name="serving.poll_engine_health")
def poll_engine_health() -> dict[str, str]:
    return poll_deployments()


@shared_task(name="serving.control_engine")
def control_engine(
    deployment_id: int, endpoint: str, action: str, model: str | None = None
) -> dict:
    """Load or unload a model on one replica (CONTROL), following it until it is done."""
    deployment = ModelDeployment.objects.get(pk=deployment_id)
    return control_replica(deployment=deployment, endpoint=endpoint, action=action, model=model)


@shared_task(name="serving.replay_usage_spool")
def replay_usage_spool() -> int:
    """Every minute: save the usage records kept on disk while the database was out of reach
    (``serving.usage_spool``); how many."""
    return spool_replay()
