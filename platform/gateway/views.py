"""Thin async views: each one hands the request to a service and returns its response."""

import asyncio
import functools
import hmac

import msgspec
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from config.workers import database_worker
from gateway import health, metrics, openapi
from gateway.auth import authenticate
from gateway.errors import ApiError
from gateway.handling import serve_generation
from gateway.schemas import Model, ModelList
from gateway.validation import plan_chat, plan_completion
from serving.models import ModelDeployment
from serving.pool import get_pool
from serving.selectors import deployments_for_tenant
from tenants.models import ApiKey


def _method_not_allowed(request: HttpRequest, allowed: str) -> HttpResponse:
    error = ApiError(
        405, f"Use {allowed} for {request.path}.", code="method_not_allowed", headers={}
    )
    response = error.response()
    response["Allow"] = allowed
    return response


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _method_not_allowed(request, "POST")
    return await serve_generation(request, "chat", plan_chat)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _method_not_allowed(request, "POST")
    return await serve_generation(request, "completion", plan_completion)


@database_worker
def _deployments_of(tenant) -> list[ModelDeployment]:
    return list(deployments_for_tenant(tenant=tenant))


async def _models_of(tenant) -> list[Model]:
    """The tenant's models that can serve now (a ready replica), each with the context length
    a request gets: the deployment's own limit, else what its engine serves."""
    deployments = await _deployments_of(tenant)
    pool = get_pool()
    lengths = await asyncio.gather(*(pool.ready_max_model_len(d.endpoints) for d in deployments))
    return [
        Model(
            id=d.name,
            object="model",
            created=int(d.created_at.timestamp()),
            owned_by=d.owned_by,
            # what requests get: the deployment's own limit where it is lower (serving.pool)
            max_model_len=min(d.max_context or engine_len, engine_len),
        )
        for d, engine_len in zip(deployments, lengths, strict=True)
        if engine_len is not None
    ]


def _authenticated_get(view):
    """A GET endpoint of the API for the bearer of a valid key: the view gets the key."""

    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method != "GET":
            return _method_not_allowed(request, "GET")
        try:
            api_key = await authenticate(request)
        except ApiError as exc:
            return exc.response()
        return await view(request, api_key, *args, **kwargs)

    return wrapper


@_authenticated_get
async def models(request: HttpRequest, api_key: ApiKey) -> HttpResponse:
    data = await _models_of(api_key.tenant)
    return _json(ModelList(object="list", data=data))


@_authenticated_get
async def model_detail(request: HttpRequest, api_key: ApiKey, model: str) -> HttpResponse:
    for entry in await _models_of(api_key.tenant):
        if entry.id == model:
            return _json(entry)
    return ApiError(
        404, f"The model '{model}' does not exist.", code="model_not_found", param="model"
    ).response()


async def live(request: HttpRequest) -> HttpResponse:
    return _json({"status": "ok"})


def _has_metrics_token(request: HttpRequest) -> bool:
    token = settings.METRICS_BEARER_TOKEN
    # as bytes (the header as it came, latin-1 being how it was read): compare_digest
    # refuses strings of other characters than ASCII, and a header may hold any
    header = request.headers.get("Authorization", "").encode("latin-1", "replace")
    return bool(token) and hmac.compare_digest(header, f"Bearer {token}".encode())


async def ready(request: HttpRequest) -> HttpResponse:
    """Which models are degraded or down is named to the metrics token's bearer only."""
    report = await health.readiness(names_models=_has_metrics_token(request))
    return _json(report, status=200 if report["status"] == "ok" else 503)


async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """With ``METRICS_BEARER_TOKEN`` set, only its bearer may scrape. Without one, the
    embedded mode shows everything, and a production server shows no tenant names."""
    token = settings.METRICS_BEARER_TOKEN
    if token and not _has_metrics_token(request):
        return ApiError(401, "Metrics need the metrics bearer token.").response()
    with_tenants = bool(token) or settings.IS_EMBEDDED
    return HttpResponse(
        metrics.exposition(with_tenants=with_tenants), content_type="text/plain; version=0.0.4"
    )


async def openapi_document(request: HttpRequest) -> HttpResponse:
    return HttpResponse(openapi.document(), content_type="application/json")


def api_not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    return ApiError(
        404, f"Unknown API route: {request.method} {request.path}", code="unknown_route"
    ).response()


def _json(payload: object, status: int = 200) -> HttpResponse:
    return HttpResponse(
        msgspec.json.encode(payload), status=status, content_type="application/json"
    )
