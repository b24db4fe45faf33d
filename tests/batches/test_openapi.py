"""The OpenAPI document lists the Files and Batch APIs, and its schemas are those of the
objects the API returns."""

import json

import msgspec
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import Resolver404, resolve

from batches import objects, schemas, services
from gateway import openapi
from tests.batches.conftest import jsonl, request_line

pytestmark = pytest.mark.django_db

ROUTES = {
    "/files": {"get", "post"},
    "/files/{file_id}": {"get", "delete"},
    "/files/{file_id}/content": {"get"},
    "/batches": {"get", "post"},
    "/batches/{batch_id}": {"get"},
    "/batches/{batch_id}/cancel": {"post"},
}


def _document() -> dict:
    return json.loads(openapi.document())


def test_the_files_and_batches_routes_are_listed():
    paths = _document()["paths"]

    assert {path: set(paths[path]) for path in ROUTES if path in paths} == ROUTES


def test_each_listed_path_is_served_by_its_view():
    for path in _document()["paths"]:
        concrete = "/v1" + path.replace("{file_id}", "file-1").replace("{batch_id}", "batch_1")
        try:
            match = resolve(concrete)
        except Resolver404:
            pytest.fail(f"{path} is not routed")
        assert "not_found" not in match.func.__name__, path


def test_the_schemas_describe_the_objects_returned(tenant, file_storage_dir):
    file = services.file_create(
        tenant=tenant,
        upload=SimpleUploadedFile("in.jsonl", jsonl([request_line("a")])),
        purpose="batch",
    )
    batch = services.batch_create(
        tenant=tenant,
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    failed = services.batch_validate(
        batch=services.batch_create(
            tenant=tenant,
            input_file_id=services.file_create(
                tenant=tenant,
                upload=SimpleUploadedFile("c.jsonl", jsonl([request_line("b")])),
                purpose="batch",
            ).id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
    )
    assert failed.status == "failed"

    msgspec.convert(objects.file_object(file), schemas.FileObject)
    msgspec.convert(
        objects.list_object([objects.file_object(file)], has_more=False), schemas.FileList
    )
    for each in (batch, failed):
        msgspec.convert(objects.batch_object(each), schemas.BatchObject)
    msgspec.convert(
        objects.list_object([objects.batch_object(batch)], has_more=True), schemas.BatchList
    )
    components = _document()["components"]["schemas"]
    assert {"FileObject", "BatchObject", "BatchCreateRequest", "FileUpload"} <= set(components)
