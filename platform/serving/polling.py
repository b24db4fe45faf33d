"""Poll every enabled deployment's replicas and record their health and load."""

import asyncio
from datetime import datetime

import msgspec
from django.db import transaction
from django.utils import timezone

from serving.models import ModelDeployment
from serving.pool import EnginePool

POLL_TIMEOUT_SECONDS = 3.0


async def _poll(endpoints: list[str]) -> dict[str, dict]:
    pool = EnginePool()
    try:
        results = await asyncio.gather(
            *(pool.stats(endpoint, timeout=POLL_TIMEOUT_SECONDS) for endpoint in endpoints)
        )
    finally:
        pool.close()
    return {
        endpoint: msgspec.structs.asdict(stats) if stats is not None else {"error": "no answer"}
        for endpoint, stats in zip(endpoints, results, strict=True)
    }


def _with_rate(state: dict, previous: dict | None, now: datetime) -> dict:
    """Add tokens/s generated since the previous poll of the same engine."""
    state = {**state, "polled_at": now.timestamp(), "tokens_per_second": None}
    if previous and "generation_tokens_total" in state and "polled_at" in previous:
        same_engine = previous.get("engine_id") == state.get("engine_id")
        elapsed = state["polled_at"] - previous["polled_at"]
        delta = state["generation_tokens_total"] - previous.get("generation_tokens_total", 0)
        if same_engine and elapsed > 0 and delta >= 0:
            state["tokens_per_second"] = round(delta / elapsed, 1)
    return state


def _health(replicas: dict[str, dict]) -> str:
    ready = sum(1 for state in replicas.values() if state.get("ready"))
    if ready == len(replicas):
        return ModelDeployment.Health.READY
    return ModelDeployment.Health.DEGRADED if ready else ModelDeployment.Health.DOWN


def poll_deployments() -> dict[str, str]:
    """Ask every replica of every enabled deployment for STATS; deployment name -> health.

    Each deployment's row is read again, locked, to write what was found: a load or unload
    (``serving.replica_control``) records its progress and result in the same replicas'
    states while the poll waits for answers, and the poll wrote back what it had read before
    (the console's "last control … failed: why" was gone within a poll). A deployment whose
    endpoints changed meanwhile (registered again) waits for the next poll."""
    deployments = list(ModelDeployment.objects.filter(is_enabled=True))
    endpoints = sorted({endpoint for d in deployments for endpoint in d.endpoints})
    states = asyncio.run(_poll(endpoints)) if endpoints else {}
    now = timezone.now()
    healths = {}
    for deployment in deployments:
        with transaction.atomic():
            current = (
                ModelDeployment.objects.select_for_update()
                .filter(pk=deployment.pk, endpoints=deployment.endpoints)
                .only("replicas")
                .first()
            )
            if current is None:
                continue
            previous = current.replicas or {}
            replicas = {}
            for endpoint in deployment.endpoints:
                state = _with_rate(states[endpoint], previous.get(endpoint), now)
                if "control" in previous.get(endpoint, {}):
                    state["control"] = previous[endpoint]["control"]
                replicas[endpoint] = state
            current.replicas, current.health, current.checked_at = replicas, _health(replicas), now
            current.save(update_fields=["replicas", "health", "checked_at"])
        healths[deployment.name] = current.health
    return healths
