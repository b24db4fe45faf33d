"""The API's OpenAPI 3.1 document, generated from the structs the API decodes and encodes."""

import functools

import msgspec

from batches import schemas as batch_schemas
from gateway import schemas

REF = "#/components/schemas/{name}"


def _body(name: str) -> dict:
    return {"content": {"application/json": {"schema": {"$ref": REF.format(name=name)}}}}


def _responses(ok: str | dict, *, stream: bool = False) -> dict:
    ok_body = _body(ok) if isinstance(ok, str) else ok
    if stream:
        ok_body["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": "data: <chunk JSON> events, then [DONE]"}
        }
    errors = {
        "400": "invalid request (param names the field)",
        "401": "missing or invalid API key",
        "403": "inactive organization",
        "404": "unknown model, file or batch",
        "413": "body too large",
        "429": "rate limited (Retry-After, x-ratelimit-* headers)",
        "503": "engine overloaded or unavailable (Retry-After)",
    }
    return {
        "200": {"description": "OK", **ok_body},
        **{code: {"description": text, **_body("ErrorResponse")} for code, text in errors.items()},
    }


@functools.cache
def document() -> bytes:
    _, components = msgspec.json.schema_components(
        [
            schemas.ChatCompletionRequest,
            schemas.CompletionRequest,
            schemas.ChatCompletion,
            schemas.ChatCompletionChunk,
            schemas.Completion,
            schemas.ModelList,
            schemas.ErrorResponse,
            *batch_schemas.SCHEMAS,
        ],
        ref_template=REF,
    )
    bearer = [{"bearerAuth": []}]
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "LLM Platform API", "version": "1", "description": "OpenAI-compatible"},
        "servers": [{"url": "/v1"}],
        "components": {
            "schemas": components,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
        "security": bearer,
        "paths": {
            "/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "requestBody": {"required": True, **_body("ChatCompletionRequest")},
                    "responses": _responses("ChatCompletion", stream=True),
                }
            },
            "/completions": {
                "post": {
                    "operationId": "createCompletion",
                    "requestBody": {"required": True, **_body("CompletionRequest")},
                    "responses": _responses("Completion", stream=True),
                }
            },
            "/models": {"get": {"operationId": "listModels", "responses": _responses("ModelList")}},
            "/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": _responses("Model"),
                }
            },
            **_files_and_batches(),
        },
    }
    return msgspec.json.encode(doc)


def _path_id(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _files_and_batches() -> dict:
    """OpenAI's Files and Batch APIs (``batches.views``)."""
    after = _query("after", {"type": "string"})
    file_id, batch_id = _path_id("file_id"), _path_id("batch_id")
    upload = {
        "content": {"multipart/form-data": {"schema": {"$ref": REF.format(name="FileUpload")}}}
    }
    jsonl = {"content": {"application/jsonl": {"schema": {"type": "string"}}}}
    return {
        "/files": {
            "post": {
                "operationId": "createFile",
                "requestBody": {"required": True, **upload},
                "responses": _responses("FileObject"),
            },
            "get": {
                "operationId": "listFiles",
                "parameters": [
                    _query("purpose", {"type": "string"}),
                    after,
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
                    _query("order", {"type": "string", "enum": ["asc", "desc"]}),
                ],
                "responses": _responses("FileList"),
            },
        },
        "/files/{file_id}": {
            "get": {
                "operationId": "retrieveFile",
                "parameters": [file_id],
                "responses": _responses("FileObject"),
            },
            "delete": {
                "operationId": "deleteFile",
                "parameters": [file_id],
                "responses": _responses("FileDeleted"),
            },
        },
        "/files/{file_id}/content": {
            "get": {
                "operationId": "downloadFile",
                "parameters": [file_id],
                "responses": _responses(jsonl),
            }
        },
        "/batches": {
            "post": {
                "operationId": "createBatch",
                "requestBody": {"required": True, **_body("BatchCreateRequest")},
                "responses": _responses("BatchObject"),
            },
            "get": {
                "operationId": "listBatches",
                "parameters": [
                    after,
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                ],
                "responses": _responses("BatchList"),
            },
        },
        "/batches/{batch_id}": {
            "get": {
                "operationId": "retrieveBatch",
                "parameters": [batch_id],
                "responses": _responses("BatchObject"),
            }
        },
        "/batches/{batch_id}/cancel": {
            "post": {
                "operationId": "cancelBatch",
                "parameters": [batch_id],
                "responses": {
                    **_responses("BatchObject"),
                    "409": {"description": "the batch has ended", **_body("ErrorResponse")},
                },
            }
        },
    }
