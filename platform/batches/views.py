"""The Files and Batch APIs: thin async views over ``batches.services`` and
``batches.selectors``. Service errors become OpenAI's error object in ``_api`` only."""

import functools
from collections.abc import Awaitable, Callable

import msgspec
from django.conf import settings
from django.core.exceptions import (
    ObjectDoesNotExist,
    RequestDataTooBig,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from batches import objects, selectors, services
from batches.models import Batch, File
from batches.schemas import BatchCreateRequest
from config.numerals import parse_count
from config.workers import database_worker
from gateway.auth import authenticate
from gateway.bodies import json_body
from gateway.errors import ApiError, invalid
from tenants.models import ApiKey

View = Callable[..., Awaitable[HttpResponse]]
MAX_PAGE = {"files": 10_000, "batches": 100}


def _json(payload: object, status: int = 200) -> HttpResponse:
    return HttpResponse(
        msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def _api(*methods: str) -> Callable[[View], View]:
    """An endpoint for the bearer of a valid key, by method: each handler is
    ``(request, api_key, **kwargs)``. Maps the services' errors to OpenAI's error object."""

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, **kwargs) -> HttpResponse:
            if request.method not in methods:
                response = ApiError(
                    405,
                    f"Use {' or '.join(methods)} for {request.path}.",
                    code="method_not_allowed",
                ).response()
                response["Allow"] = ", ".join(methods)
                return response
            try:
                api_key = await authenticate(request)
                return await view(request, api_key, **kwargs)
            except ApiError as exc:
                return exc.response()
            except ObjectDoesNotExist:
                kind = "File" if "file_id" in kwargs else "Batch"
                object_id = kwargs.get("file_id") or kwargs.get("batch_id")
                return ApiError(
                    404, f"No such {kind} object: {object_id}", code="not_found"
                ).response()
            except services.FileTooLarge as exc:
                return ApiError(413, exc.message, param=exc.param, code=exc.code).response()
            except services.QueueFull as exc:
                return ApiError(429, exc.message, param=exc.param, code=exc.code).response()
            except services.Conflict as exc:
                return ApiError(409, exc.message, param=exc.param, code=exc.code).response()
            except services.InvalidRequest as exc:
                return invalid(exc.message, param=exc.param, code=exc.code).response()

        return wrapper

    return decorate


def _limit(request: HttpRequest, maximum: int, default: int) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return default
    limit = parse_count(raw)
    if limit is None or not 1 <= limit <= maximum:
        raise invalid(f"'limit' must be an integer from 1 to {maximum}.", param="limit")
    return limit


def _cursor(request: HttpRequest) -> str | None:
    return request.GET.get("after") or None


@database_worker
def _upload(request: HttpRequest, api_key: ApiKey) -> dict:
    # parsing the multipart body reads it whole: off the event loop
    try:
        upload = request.FILES.get("file")
    except TooManyFilesSent as exc:
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FILES
        raise invalid(f"The multipart body holds more than {limit} files.", param="file") from exc
    except TooManyFieldsSent as exc:
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        raise invalid(f"The multipart body holds more than {limit} fields.", param="file") from exc
    except (MultiPartParserError, RequestDataTooBig) as exc:
        raise invalid(f"The multipart body could not be read: {exc}", param="file") from exc
    if upload is None:
        raise invalid("Send the file as the multipart field 'file'.", param="file")
    file = services.file_create(
        tenant=api_key.tenant, upload=upload, purpose=request.POST.get("purpose", "")
    )
    return objects.file_object(file)


@database_worker
def _files_page(request: HttpRequest, api_key: ApiKey) -> dict:
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'.", param="order")
    try:
        files, has_more = selectors.files_list(
            tenant_id=api_key.tenant_id,
            purpose=request.GET.get("purpose"),
            after=_cursor(request),
            limit=_limit(request, MAX_PAGE["files"], MAX_PAGE["files"]),
            newest_first=order == "desc",
        )
    except File.DoesNotExist:
        raise invalid("'after' is not the id of one of your files.", param="after") from None
    return objects.list_object([objects.file_object(f) for f in files], has_more=has_more)


@_api("GET", "POST")
async def files(request: HttpRequest, api_key: ApiKey) -> HttpResponse:
    if request.method == "POST":
        return _json(await _upload(request, api_key))
    return _json(await _files_page(request, api_key))


@database_worker
def _file_get(api_key: ApiKey, file_id: str) -> File:
    return selectors.file_get(tenant_id=api_key.tenant_id, file_id=file_id)


@database_worker
def _file_delete(file: File) -> None:
    services.file_delete(file=file)


@_api("GET", "DELETE")
async def file_detail(request: HttpRequest, api_key: ApiKey, file_id: str) -> HttpResponse:
    file = await _file_get(api_key, file_id)
    if request.method == "DELETE":
        await _file_delete(file)
        return _json({"id": file_id, "object": "file", "deleted": True})
    return _json(objects.file_object(file))


@_api("GET")
async def file_content(request: HttpRequest, api_key: ApiKey, file_id: str) -> HttpResponse:
    file = await _file_get(api_key, file_id)
    response = StreamingHttpResponse(
        await selectors.file_chunks(file=file), content_type="application/jsonl"
    )
    response["Content-Length"] = str(file.bytes)
    return response


BATCH_CREATE_FIELDS = frozenset(BatchCreateRequest.__struct_fields__)


@database_worker
def _batch_create(request: HttpRequest, api_key: ApiKey) -> dict:
    try:
        payload = msgspec.json.decode(json_body(request))  # charset, type, text: as the API's
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise invalid("The request body is not valid JSON.") from None
    if not isinstance(payload, dict):
        raise invalid("The request body must be a JSON object.")
    for name in payload:
        if name not in BATCH_CREATE_FIELDS:  # as the generation endpoints refuse one
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name[:100])
    batch = services.batch_create(
        tenant=api_key.tenant,
        api_key=api_key,
        input_file_id=payload.get("input_file_id"),
        endpoint=payload.get("endpoint"),
        completion_window=payload.get("completion_window"),
        metadata=payload.get("metadata"),
    )
    return objects.batch_object(batch)


@database_worker
def _batches_page(request: HttpRequest, api_key: ApiKey) -> dict:
    try:
        batches, has_more = selectors.batches_list(
            tenant_id=api_key.tenant_id,
            after=_cursor(request),
            limit=_limit(request, MAX_PAGE["batches"], 20),
        )
    except Batch.DoesNotExist:
        raise invalid("'after' is not the id of one of your batches.", param="after") from None
    return objects.list_object([objects.batch_object(b) for b in batches], has_more=has_more)


@_api("GET", "POST")
async def batches(request: HttpRequest, api_key: ApiKey) -> HttpResponse:
    if request.method == "POST":
        return _json(await _batch_create(request, api_key))
    return _json(await _batches_page(request, api_key))


@database_worker
def _batch(api_key: ApiKey, batch_id: str, *, cancel: bool = False) -> dict:
    batch = selectors.batch_get(tenant_id=api_key.tenant_id, batch_id=batch_id)
    if cancel:
        batch = services.batch_cancel(batch=batch)
    return objects.batch_object(batch)


@_api("GET")
async def batch_detail(request: HttpRequest, api_key: ApiKey, batch_id: str) -> HttpResponse:
    return _json(await _batch(api_key, batch_id))


@_api("POST")
async def batch_cancel(request: HttpRequest, api_key: ApiKey, batch_id: str) -> HttpResponse:
    return _json(await _batch(api_key, batch_id, cancel=True))
