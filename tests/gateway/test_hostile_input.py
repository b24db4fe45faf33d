"""Hostile input against a live Daphne and engine: every answer a precise 4xx in OpenAI's
error format, the key checked before the body, hopeless requests a 400 (never a 429 to
retry), and the server serving on afterwards."""

import asyncio
import json

import httpx
import pytest

from bench import probes
from tenants.models import UsageRecord
from tests.gateway.conftest import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
WRONG_KEY = "sk-" + "x" * 48


def _post(platform, path, body: bytes | dict, key: str | None = None, **headers) -> httpx.Response:
    headers = {
        "Authorization": f"Bearer {key or platform.key}",
        "Content-Type": "application/json",
        **headers,
    }
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    with httpx.Client(base_url=platform.base, timeout=60) as http:
        return http.post(path, content=content, headers=headers)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _serves(platform) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    assert _post(platform, CHAT, body).status_code == 200


INVALID_UTF8 = (
    b'{"model": "' + MODEL_NAME.encode() + b'", "messages": [{"role": "user", '
    b'"content": "caf\xe9 \xff"}], "max_tokens": 2}'
)


def test_invalid_utf8_is_a_400_and_a_wrong_key_a_401_whatever_the_body(platform):
    assert "UTF-8" in _error(_post(platform, CHAT, INVALID_UTF8), 400)["message"]
    assert _error(_post(platform, CHAT, INVALID_UTF8, WRONG_KEY), 401)["code"] == "invalid_api_key"
    for body in (b"{not json", b"", b"[]"):
        _error(_post(platform, CHAT, body, WRONG_KEY), 401)
    _serves(platform)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"prompt": [10**23]}, "prompt[0]"),
        (COMPLETIONS, {"prompt": [[1], [2, 10**23]]}, "prompt[1][1]"),
        (COMPLETIONS, {"prompt": [[1], [2, 3], 4]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "top_k": 10**30}, "top_k"),
        (CHAT, {"seed": 2**64}, "seed"),
        (CHAT, {"temperature": 2.5}, "temperature"),
        (CHAT, {"n": 10**30}, "n"),
        (CHAT, {"max_tokens": 10**9}, "max_tokens"),
        (CHAT, {"max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens"),
    ],
)
def test_integers_and_numbers_past_their_bounds_are_400s(platform, path, fields, param):
    body = {"model": MODEL_NAME, **({"messages": MESSAGES} if path == CHAT else {}), **fields}
    response = _post(platform, path, body)
    error = _error(response, 400)
    assert error["param"] == param
    assert "retry-after" not in response.headers
    assert not UsageRecord.objects.exists()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": [100_000]}, "prompt"),  # past the tiny model's vocabulary
        ({"prompt": [[1, 2], [3, 100_000]]}, "prompt"),
        ({"prompt": "hi", "top_k": 100_000}, "top_k"),
        ({"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias"),
    ],
)
def test_bounds_that_depend_on_the_model_are_400s_naming_the_field(platform, fields, param):
    response = _post(platform, COMPLETIONS, {"model": MODEL_NAME, "max_tokens": 2, **fields})
    error = _error(response, 400)
    assert (error["code"], error["param"]) == ("invalid_request", param)
    _serves(platform)


def test_a_request_larger_than_a_per_minute_limit_is_a_400_not_a_429(platform):
    platform.tenant.tokens_per_minute = 100
    platform.tenant.save()
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 200}
    response = _post(platform, CHAT, body)
    error = _error(response, 400)
    assert error["code"] == "request_too_large" and "Limit 100" in error["message"]
    assert "retry-after" not in response.headers
    assert _post(platform, CHAT, {**body, "max_tokens": 2}).status_code == 200


def test_a_monthly_budget_used_up_is_openais_insufficient_quota(platform):
    """It was a rate limit's 429 with a Retry-After of days: the SDKs retried it, and proxies
    took it for a busy minute. OpenAI answers a quota used up with its own type and code."""
    from django.utils import timezone

    from tenants.models import ApiKey, UsageRecord
    from tests.usage_records import usage_record_add

    platform.tenant.monthly_token_budget = 1000
    platform.tenant.save()
    now = timezone.now()
    usage_record_add(
        request_id="earlier",
        tenant=platform.tenant,
        api_key=ApiKey.objects.get(tenant=platform.tenant),
        model=MODEL_NAME,
        source=UsageRecord.Source.API,
        status=UsageRecord.Status.OK,
        started_at=now,
        finished_at=now,
        prompt_tokens=1000,
    )
    response = _post(platform, CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})

    error = _error(response, 429)
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert error["message"].startswith("You exceeded your current quota")
    assert response.headers["x-should-retry"] == "false"
    platform.tenant.monthly_token_budget = None
    platform.tenant.save()


def test_a_body_over_the_limit_is_refused_as_it_arrives(platform):
    """Declared by Content-Length or streamed in chunks, a body past the limit is a 413 (the
    server's default limit, 8 MiB), and the server serves on."""
    too_big = b"x" * (8 * 1024 * 1024 + 1)
    headers = {"Authorization": f"Bearer {platform.key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=platform.base, timeout=60) as http:
        declared = http.post(CHAT, content=too_big, headers=headers)
        chunked = http.post(
            CHAT,
            content=(too_big[i : i + 65536] for i in range(0, len(too_big), 65536)),
            headers=headers,
        )
    for response in (declared, chunked):
        assert _error(response, 413)["code"] == "request_too_large"
    _serves(platform)


def test_one_tenant_cannot_probe_anothers_prompts_through_the_prefix_cache(platform):
    """B sends a unique prompt; A sending the same one finds nothing cached (each tenant has
    its own cache salt), B itself does; a deployment that shares its cache shares it."""
    from serving.models import ModelDeployment
    from tenants import services

    other = services.tenant_create(slug="globex", plan=platform.tenant.plan)
    _, other_key = services.api_key_create(tenant=other, name="b")
    prompt = " ".join(f"s{i}" for i in range(20))  # several 16-token blocks
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}

    def cached(key: str) -> int:
        response = _post(platform, COMPLETIONS, body, key)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(other_key)
    assert cached(platform.key) == 0
    assert cached(other_key) > 0

    deployment = ModelDeployment.objects.get(name=MODEL_NAME)
    deployment.shares_prefix_cache = True
    deployment.save()  # its signal reaches the server's cached authorizations
    body["prompt"] = prompt + " shared"
    cached(other_key)
    assert cached(platform.key) > 0


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
        (CHAT, {"stop": ["ok", "\udfff"]}, "stop[1]"),
        (CHAT, {"user": "a\ud800"}, "user"),
        (COMPLETIONS, {"prompt": "x \udc00 y"}, "prompt"),
    ],
)
def test_a_lone_surrogate_in_any_text_is_a_400_naming_the_field(platform, path, fields, param):
    body = {"model": MODEL_NAME, **({"messages": MESSAGES} if path == CHAT else {}), **fields}
    raw = json.dumps(body).encode()  # json escapes a lone surrogate as \ud800: valid JSON
    error = _error(_post(platform, path, raw), 400)
    assert error["param"] == param and "surrogate" in error["message"]
    assert not UsageRecord.objects.exists()
    _serves(platform)


def test_a_body_is_read_in_its_declared_charset(platform):
    """latin-1, cp1252 and utf-16 bodies are decoded by their charset (a latin-1 body was a
    500 once); a charset that is none is a 415, bytes it cannot decode a 400."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "caf\u00e9"}]}
    text = json.dumps({**body, "max_tokens": 2}, ensure_ascii=False)
    for charset in ("latin-1", "cp1252", "utf-16"):
        response = _post(
            platform,
            CHAT,
            text.encode(charset),
            **{"Content-Type": f"application/json; charset={charset}"},
        )
        assert response.status_code == 200, (charset, response.text)
    utf8_tokens = _post(platform, CHAT, text.encode()).json()["usage"]["prompt_tokens"]
    assert response.json()["usage"]["prompt_tokens"] == utf8_tokens  # the same text
    for charset, status in (("klingon", 415), ("zlib", 415)):
        response = _post(
            platform,
            CHAT,
            text.encode(),
            **{"Content-Type": f"application/json; charset={charset}"},
        )
        assert _error(response, status)["code"] == "unsupported_media_type"
    declared_utf8 = _post(platform, CHAT, text.encode("latin-1"))
    assert "UTF-8" in _error(declared_utf8, 400)["message"]


def test_a_body_without_a_content_type_is_read_as_json(platform):
    """As OpenAI's API and vLLM's server do (documented in the README)."""
    body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}).encode()
    with httpx.Client(base_url=platform.base, timeout=60) as http:
        request = http.build_request(
            "POST", CHAT, content=body, headers={"Authorization": f"Bearer {platform.key}"}
        )
        assert "content-type" not in request.headers
        response = http.send(request)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Authorization": "Bearer sk-" + "a" * 100_000}, 431),
        ({"Authorization": "Bearer sk-" + "a" * 1_000_000}, 431),
        ({f"X-Pad-{i}": "p" * 1000 for i in range(40)}, 431),
    ],
)
def test_an_oversized_head_is_a_431_not_a_dropped_connection(platform, headers, status):
    body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}).encode()
    answer = asyncio.run(probes.post_json(platform.base, CHAT, platform.key, body, headers=headers))
    assert not answer.dropped, answer.dropped
    assert answer.status == status and answer.is_openai_error, answer.body[:200]
    _serves(platform)
