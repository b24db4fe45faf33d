"""Load or unload a model on one replica (CONTROL) and follow it to the end, keeping the
replica's state on its deployment as it goes."""

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils import timezone

from inference_engine.client import EngineUnavailable
from inference_engine.protocol import ControlRequest
from serving.models import ModelDeployment
from serving.polling import POLL_TIMEOUT_SECONDS
from serving.pool import EnginePool

CONTROL_TIMEOUT_SECONDS = 900.0
CONTROL_POLL_SECONDS = 0.5


async def _control(
    endpoint: str,
    action: str,
    model: str | None,
    on_progress: Callable[[dict], Awaitable[None]],
) -> dict:
    pool = EnginePool()
    try:
        client = pool.client(endpoint)
        await pool.stats(endpoint, timeout=POLL_TIMEOUT_SECONDS)  # connects the client
        try:
            reply = await client.control(ControlRequest(action, model=model))
        except EngineUnavailable as exc:
            return {"ok": False, "message": str(exc)}
        if not reply.ok:
            return {"ok": False, "message": reply.message}
        deadline = asyncio.get_running_loop().time() + CONTROL_TIMEOUT_SECONDS
        while asyncio.get_running_loop().time() < deadline:
            stats = await pool.stats(endpoint, timeout=POLL_TIMEOUT_SECONDS)
            if stats is not None:
                await on_progress(msgspec.structs.asdict(stats))
                if stats.state != "loading":
                    failed = "failed" in stats.state_detail
                    return {"ok": not failed, "message": stats.state_detail or stats.state}
            await asyncio.sleep(CONTROL_POLL_SECONDS)
        return {"ok": False, "message": "timed out waiting for the engine"}
    finally:
        pool.close()


def control_replica(
    *, deployment: ModelDeployment, endpoint: str, action: str, model: str | None
) -> dict:
    """Send CONTROL ``action`` to one replica and follow it to the end, keeping the
    replica's state on the deployment (the console shows it as it goes). The result:
    ``ok`` and the engine's ``message``."""
    if endpoint not in deployment.endpoints:
        raise ValueError(f"{endpoint} is not a replica of {deployment.name}")

    @sync_to_async
    @transaction.atomic
    def record(state: dict) -> None:
        # locked: the health poll writes the same replicas' states (``serving.polling``)
        current = ModelDeployment.objects.select_for_update().only("replicas").get(pk=deployment.pk)
        replicas = dict(current.replicas or {})
        replicas[endpoint] = {**replicas.get(endpoint, {}), **state}
        current.replicas, current.checked_at = replicas, timezone.now()
        current.save(update_fields=["replicas", "checked_at"])

    async def run() -> dict:
        await record({"control": {"action": action, "model": model, "state": "sent"}})
        result = await _control(endpoint, action, model, record)
        await record({"control": {"action": action, "model": model, **result}})
        return result

    return asyncio.run(run())
