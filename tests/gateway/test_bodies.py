"""An API request's body: its charset, its content type and its text (gateway.bodies)."""

import json

import pytest
from django.test import RequestFactory

from gateway.bodies import json_body
from gateway.errors import ApiError

BODY = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \u20ac \U0001f600"}]}
UTF8_BODY = json.dumps(BODY, ensure_ascii=False).encode()


def _request(raw: bytes, content_type: str | None):
    request = RequestFactory().generic(
        "POST", "/v1/chat/completions", data=raw, content_type=content_type or ""
    )
    if content_type is None:
        del request.META["CONTENT_TYPE"]
        request._set_content_type_params(request.META)
    return request


def _refusal(raw: bytes, content_type: str | None) -> ApiError:
    with pytest.raises(ApiError) as refused:
        json_body(_request(raw, content_type))
    return refused.value


@pytest.mark.parametrize(
    ("charset", "encoding"),
    [
        ("utf-8", "utf-8"),
        ("UTF-8", "utf-8"),
        ("latin-1", "latin-1"),
        ("iso-8859-1", "latin-1"),
        ("cp1252", "cp1252"),
        ("utf-16", "utf-16"),
        ("utf-16-le", "utf-16-le"),
    ],
)
def test_a_body_is_decoded_by_its_declared_charset(charset, encoding):
    if encoding in ("latin-1", "cp1252"):  # no emoji there
        body = {**BODY, "messages": [{"role": "user", "content": "caf\u00e9 \u00bd"}]}
    else:
        body = BODY
    raw = json.dumps(body, ensure_ascii=False).encode(encoding)
    decoded = json_body(_request(raw, f"application/json; charset={charset}"))
    assert json.loads(decoded.decode("utf-8")) == body


def test_a_body_without_a_content_type_is_read_as_json():
    """OpenAI's API and vLLM accept it; so does this one (and documents it)."""
    assert json_body(_request(UTF8_BODY, None)) == UTF8_BODY
    assert json_body(_request(UTF8_BODY, "application/json")) == UTF8_BODY


@pytest.mark.parametrize("charset", ["nope", "base64", "zlib", "x" * 300])
def test_a_charset_that_is_not_one_is_a_415(charset):
    error = _refusal(UTF8_BODY, f"application/json; charset={charset}")
    assert error.status == 415 and error.code == "unsupported_media_type"
    assert len(error.message) < 200


@pytest.mark.parametrize(
    "charset",
    ["punycode", "idna", "unicode_escape", "raw-unicode-escape", "utf-7", "undefined", "charmap"],
)
def test_a_text_transform_that_is_no_charset_is_a_415(charset):
    """Python's codecs that transform text are no charsets: punycode's decoder is quadratic
    (a 200 KB body with a bad key held the event loop, every other request with it, 2.9 s;
    400 KB 14 s), and the escapes turn ASCII bytes into any text."""
    error = _refusal(UTF8_BODY, f"application/json; charset={charset}")
    assert error.status == 415 and error.code == "unsupported_media_type"


@pytest.mark.parametrize("charset", ["shift_jis", "gb18030", "iso-8859-15", "cp1251", "koi8-r"])
def test_the_worlds_charsets_are_read(charset):
    text = '{"model": "м-ü-日"}'
    try:
        raw = text.encode(charset)
    except UnicodeEncodeError:
        raw = '{"model": "plain"}'.encode(charset)
    assert (
        json_body(_request(raw, f"application/json; charset={charset}"))
        == raw.decode(charset).encode()
    )


def test_bytes_the_declared_charset_cannot_decode_are_a_400():
    odd_length = b'{"model": "\xff"} '
    error = _refusal(odd_length, "application/json; charset=utf-16")
    assert error.status == 400 and "utf-16" in error.message
    error = _refusal(
        '{"model": "\ud800"}'.encode("utf-16", "surrogatepass"), "application/json; charset=utf-16"
    )
    assert error.status == 400


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_other_content_types_are_a_415(content_type):
    assert _refusal(UTF8_BODY, content_type).status == 415


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (
            rb'{"model": "m", "messages": [{"role": "user", "content": "hi \ud800"}]}',
            "messages[0].content",
        ),
        (rb'{"model": "m", "prompt": "x", "stop": ["\udc00"]}', "stop[0]"),
        (rb'{"model": "\udfff", "prompt": "x"}', "model"),
        (rb'{"model": "m", "prompt": "x", "user": "a\ud800b"}', "user"),
    ],
)
def test_a_lone_surrogate_in_any_text_is_a_400_naming_the_field(raw, param):
    error = _refusal(raw, "application/json")
    assert error.status == 400 and error.param == param and "surrogate" in error.message
    latin = _refusal(raw, "application/json; charset=latin-1")  # escapes are ASCII
    assert latin.param == param


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("raw", "content_type", "param"),
    [
        (
            '{"input_file_id": "file-caf\u00e9", "endpoint": "/v1/chat/completions", '
            '"completion_window": "24h"}'.encode("latin-1"),
            "application/json; charset=latin-1",
            "input_file_id",  # read, and no such file
        ),
        (
            b'{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", '
            b'"completion_window": "24h", "metadata": {"k": "\\ud800"}}',
            "application/json",
            "metadata.k",
        ),
    ],
)
async def test_a_batch_body_is_read_as_the_apis_bodies_are(async_db, raw, content_type, param):
    """A latin-1 body to POST /v1/batches was a 500 (its bytes went to the JSON decoder as
    UTF-8)."""
    from asgiref.sync import sync_to_async

    from tenants import services
    from tests.asgi_client import asgi_request

    tenant = await sync_to_async(services.tenant_create)(slug="acme", name="Acme")
    _, raw_key = await sync_to_async(services.api_key_create)(tenant=tenant, name="k")
    headers = {"Authorization": f"Bearer {raw_key}", "Content-Type": content_type}
    status, _, body = await asgi_request("POST", "/v1/batches", headers=headers, body=raw)
    assert 400 <= status < 500, body
    assert json.loads(body)["error"]["param"] == param
