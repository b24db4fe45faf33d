"""``/v1/models`` and ``/health/ready`` against a live engine and a dead one: a model is
listed only while it can serve, with its engine's real context length, and one dead model
does not make the platform unready."""

import asyncio
import json

import pytest
from asgiref.sync import sync_to_async

from serving.services import deployment_register
from tenants import services
from tests.asgi_client import asgi_request
from tests.gateway.conftest import MAX_MODEL_LEN, MODEL_NAME

DEAD_MODEL = "dead-model"


@pytest.fixture
async def two_models(async_db, engine, tmp_path):
    """The live engine's model, a model whose only replica nobody serves, and a key."""
    await asyncio.to_thread(engine.wait_ready)

    def create() -> str:
        deployment_register(name=MODEL_NAME, endpoints=[engine.endpoint])
        deployment_register(name=DEAD_MODEL, endpoints=[f"ipc://{tmp_path}/nobody.sock"])
        tenant = services.tenant_create(slug="acme")
        return services.api_key_create(tenant=tenant, name="k")[1]

    return await sync_to_async(create)()


async def _get(path: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, body = await asgi_request("GET", path, headers=headers)
    return status, json.loads(body)


async def test_models_lists_what_can_serve_with_the_engines_context_length(two_models):
    status, body = await _get("/v1/models", two_models)
    assert status == 200
    assert [(m["id"], m["max_model_len"]) for m in body["data"]] == [(MODEL_NAME, MAX_MODEL_LEN)]
    status, body = await _get(f"/v1/models/{MODEL_NAME}", two_models)
    assert (status, body["max_model_len"]) == (200, MAX_MODEL_LEN)
    status, _ = await _get(f"/v1/models/{DEAD_MODEL}", two_models)
    assert status == 404


async def test_a_deployments_own_context_limit_wins_where_it_is_lower(two_models, engine):
    await sync_to_async(deployment_register)(
        name=MODEL_NAME, endpoints=[engine.endpoint], max_context=100
    )
    _, body = await _get("/v1/models", two_models)
    assert [m["max_model_len"] for m in body["data"]] == [100]
    # above the engine's: requests get the engine's, and so does the list
    await sync_to_async(deployment_register)(
        name=MODEL_NAME, endpoints=[engine.endpoint], max_context=MAX_MODEL_LEN * 4
    )
    _, body = await _get("/v1/models", two_models)
    assert [m["max_model_len"] for m in body["data"]] == [MAX_MODEL_LEN]


async def test_one_dead_model_leaves_the_platform_ready_and_is_named_to_the_operator(
    two_models, settings
):
    settings.METRICS_BEARER_TOKEN = "operator-token"
    status, body = await _get("/health/ready", "operator-token")
    assert status == 200, body
    assert body["checks"]["models"] == "ok (1/2 models ready; 1 down)"
    assert body["models"] == {DEAD_MODEL: "down", MODEL_NAME: "ready"}

    # anybody else may ask too, and learns that something is down but not what
    status, body = await _get("/health/ready")
    assert status == 200 and "models" not in body
    assert DEAD_MODEL not in json.dumps(body) and MODEL_NAME not in json.dumps(body)


async def test_the_platform_is_unready_when_no_model_can_serve(async_db, tmp_path):
    await sync_to_async(deployment_register)(
        name=DEAD_MODEL, endpoints=[f"ipc://{tmp_path}/nobody.sock"]
    )
    status, body = await _get("/health/ready")
    assert status == 503
    assert (
        body["checks"]["models"] == "error: no model has a ready replica (0/1 models ready; 1 down)"
    )
