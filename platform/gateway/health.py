"""Readiness: the database, the cache, and a ready engine for every enabled deployment.

Anybody may ask (load balancers do, without credentials), so the answer names no model: which
models exist is for each tenant's own key (``/v1/models``) and for staff (the console)."""

import asyncio
import logging
import uuid

from django.core.cache import cache
from django.db import connection

from config.workers import database_worker
from serving.models import ModelDeployment
from serving.pool import get_pool

logger = logging.getLogger(__name__)


@database_worker
def _check_database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


@database_worker
def _check_cache() -> None:
    key = f"health:{uuid.uuid4().hex}"
    cache.set(key, "ok", timeout=10)
    if cache.get(key) != "ok":
        raise RuntimeError("the cache did not return what was written")
    cache.delete(key)


@database_worker
def _enabled_deployments() -> list[ModelDeployment]:
    return list(ModelDeployment.objects.filter(is_enabled=True))


async def _check(name: str, check) -> tuple[str, str]:
    """The check's state; why it failed goes to the log, not to whoever asked (an exception's
    text can name hosts, users and paths)."""
    try:
        await check()
    except Exception:  # noqa: BLE001 - reported, not raised
        logger.warning("readiness: the %s check failed", name, exc_info=True)
        return name, "error: unavailable"
    return name, "ok"


async def _is_ready(deployment: ModelDeployment) -> bool:
    """Whether one of the deployment's replicas is ready."""
    pool = get_pool()
    all_stats = await asyncio.gather(*(pool.stats(ep) for ep in deployment.endpoints))
    return any(stats is not None and stats.ready for stats in all_stats)


async def readiness() -> dict:
    checks = dict(
        await asyncio.gather(_check("database", _check_database), _check("cache", _check_cache))
    )
    if checks["database"] == "ok":
        deployments = await _enabled_deployments()
        ready = sum(await asyncio.gather(*(_is_ready(d) for d in deployments)))
        state = "ok" if ready == len(deployments) else "error: a model has no ready replica"
        checks["models"] = f"{state} ({ready}/{len(deployments)} models ready)"
    is_ready = all(value.startswith("ok") for value in checks.values())
    return {"status": "ok" if is_ready else "unavailable", "checks": checks}
