from celery import shared_task


@shared_task(name="config.ping")
def ping() -> str:
    """A round trip through the broker, the worker and the result backend (health checks)."""
    return "pong"
