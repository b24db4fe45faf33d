"""The API's OpenAPI 3.1 document, generated from the structs the API decodes and encodes."""

import functools

import msgspec

from gateway import schemas

REF = "#/components/schemas/{name}"


def _body(name: str) -> dict:
    return {"content": {"application/json": {"schema": {"$ref": REF.format(name=name)}}}}


def _responses(ok: str, *, stream: bool = False) -> dict:
    ok_body = _body(ok)
    if stream:
        ok_body["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": "data: <chunk JSON> events, then [DONE]"}
        }
    errors = {
        "400": "invalid request (param names the field)",
        "401": "missing or invalid API key",
        "403": "inactive organization",
        "404": "unknown model",
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
        },
    }
    return msgspec.json.encode(doc)
