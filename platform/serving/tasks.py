from celery import shared_task

from serving.health import poll_deployments


@shared_task(name="serving.poll_engine_health")
def poll_engine_health() -> dict[str, str]:
    return poll_deployments()
