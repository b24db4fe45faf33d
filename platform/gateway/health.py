"""Readiness: the database, the cache, and the enabled models' engines.

The platform is ready while its database and cache answer and it can serve: every enabled
model with no ready replica is reported, but fails readiness only when no model has one (or
no model is registered at all passes), so one dead deployment does not take every model out
of a load balancer. A model is ``ready`` (all its replicas are), ``degraded`` (some are) or
``down`` (none is).

Anybody may ask (load balancers do, without credentials), so the answer names no model unless
the caller shows the metrics bearer token: which models exist is for each tenant's own key
(``/v1/models``), for staff (the console) and for the operator."""

import asyncio
import logging
import uuid
from collections import Counter

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


async def _model_state(deployment: ModelDeployment) -> str:
    """``ready``, ``degraded`` or ``down``: how many of its replicas are ready."""
    pool = get_pool()
    all_stats = await asyncio.gather(*(pool.stats(ep) for ep in deployment.endpoints))
    ready = sum(1 for stats in all_stats if stats is not None and stats.ready)
    if ready == len(all_stats):
        return "ready"
    return "degraded" if ready else "down"


def _models_check(states: dict[str, str]) -> str:
    counts = Counter(states.values())
    summary = f"{counts['ready'] + counts['degraded']}/{len(states)} models ready"
    unhealthy = [f"{counts[state]} {state}" for state in ("degraded", "down") if counts[state]]
    if unhealthy:
        summary += "; " + ", ".join(unhealthy)
    if states and counts["down"] == len(states):
        return f"error: no model has a ready replica ({summary})"
    return f"ok ({summary})"


async def readiness(*, names_models: bool = False) -> dict:
    """The report: ``status`` ("ok" or "unavailable") and ``checks``; with ``names_models``,
    also ``models``: each enabled model's state."""
    checks = dict(
        await asyncio.gather(_check("database", _check_database), _check("cache", _check_cache))
    )
    states: dict[str, str] = {}
    if checks["database"] == "ok":
        deployments = await _enabled_deployments()
        found = await asyncio.gather(*(_model_state(d) for d in deployments))
        states = {d.name: state for d, state in zip(deployments, found, strict=True)}
        checks["models"] = _models_check(states)
    is_ready = all(value.startswith("ok") for value in checks.values())
    report = {"status": "ok" if is_ready else "unavailable", "checks": checks}
    if names_models:
        report["models"] = states
    return report
