"""The web server's body limit is raised for file uploads only, and only for a client whose
API key the API would serve: anyone else's upload is never stored past the API's limit."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from twisted.web.test.requesthelper import DummyChannel

from config.webserver import RawBodyRequest
from gateway import auth
from gateway.errors import ApiError


class _NetworkProducer:
    def __init__(self) -> None:
        self.is_paused = False

    def pauseProducing(self) -> None:  # noqa: N802 - Twisted's name
        self.is_paused = True

    def resumeProducing(self) -> None:  # noqa: N802 - Twisted's name
        self.is_paused = False


def _request(method: bytes, target: bytes, authorization: bytes | None = None) -> RawBodyRequest:
    channel = DummyChannel()
    channel.factory = SimpleNamespace(server=SimpleNamespace(protocol_connected=lambda r: None))
    channel._command, channel._path = method, target
    channel._networkProducer = _NetworkProducer()
    request = RawBodyRequest(channel)
    request.body_limit = 1000
    if authorization is not None:
        request.requestHeaders.setRawHeaders(b"Authorization", [authorization])
    request.replies = []
    request.handle_reply = request.replies.append
    request.processed = []
    return request


@pytest.fixture
def checked_keys(monkeypatch):
    """The key check, answered from a table: ``sk-good`` is served, anything else refused
    as the API refuses a wrong key. ``checked_keys.gate`` holds every check until set."""
    gate = asyncio.Event()
    gate.set()
    seen = []

    async def refusal(authorization: str) -> ApiError | None:
        seen.append(authorization)
        await gate.wait()
        if authorization == "Bearer sk-good":
            return None
        return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    monkeypatch.setattr(auth, "refusal_of_header", refusal)
    return SimpleNamespace(gate=gate, seen=seen)


async def _checked(request: RawBodyRequest) -> None:
    await request.upload_check


def _answer(request: RawBodyRequest) -> tuple[int, dict]:
    start, body = request.replies
    return start["status"], json.loads(body["body"])


async def test_an_upload_with_a_good_key_may_be_as_large_as_a_file(settings, checked_keys):
    settings.FILES_MAX_BYTES = 5000
    request = _request(b"POST", b"/v1/files?x=1", b"Bearer sk-good")

    request.gotLength(5000)
    await _checked(request)
    request.handleContentChunk(b"x" * 5000)

    assert request.refusal is None and request.content.tell() == 5000
    assert checked_keys.seen == ["Bearer sk-good"]


@pytest.mark.parametrize("authorization", [None, b"Bearer sk-wrong"])
async def test_an_upload_past_the_api_limit_without_a_good_key_stores_nothing(
    settings, checked_keys, authorization
):
    settings.FILES_MAX_BYTES = 10**6
    request = _request(b"POST", b"/v1/files", authorization)

    request.gotLength(10**6)
    await _checked(request)
    for _ in range(15):
        request.handleContentChunk(b"x" * 65536)
    request.process()

    assert request.content.tell() == 0
    status, error = _answer(request)
    assert status == 401 and error["error"]["code"] == "invalid_api_key"


async def test_the_body_waits_past_the_api_limit_until_the_key_is_checked(settings, checked_keys):
    """The socket is no longer read past the API's limit while the check is out; what the
    channel had read already is kept, and reading resumes once the key is good."""
    settings.FILES_MAX_BYTES = 5000
    checked_keys.gate.clear()
    request = _request(b"POST", b"/v1/files", b"Bearer sk-good")
    producer = request.channel._networkProducer

    request.gotLength(None)
    request.handleContentChunk(b"x" * 800)
    assert not producer.is_paused
    request.handleContentChunk(b"x" * 800)
    assert producer.is_paused and request.refusal is None

    checked_keys.gate.set()
    await _checked(request)
    await asyncio.sleep(0)  # the check's done-callback
    request.handleContentChunk(b"x" * 800)

    assert not producer.is_paused and request.content.tell() == 2400


async def test_a_refused_key_past_the_limit_drops_what_was_kept_while_it_was_checked(
    settings, checked_keys
):
    settings.FILES_MAX_BYTES = 5000
    checked_keys.gate.clear()
    request = _request(b"POST", b"/v1/files", b"Bearer sk-wrong")

    request.gotLength(None)
    request.handleContentChunk(b"x" * 1600)
    checked_keys.gate.set()
    await _checked(request)
    await asyncio.sleep(0)

    assert request.content.tell() == 0 and request.refusal[0] == 401
    assert not request.channel._networkProducer.is_paused  # read to its end, thrown away


async def test_a_whole_body_in_before_the_check_is_answered_once_it_is_done(
    settings, checked_keys, monkeypatch
):
    settings.FILES_MAX_BYTES = 5000
    checked_keys.gate.clear()
    request = _request(b"POST", b"/v1/files", b"Bearer sk-good")
    processed = []
    monkeypatch.setattr(RawBodyRequest.__bases__[0], "process", lambda self: processed.append(1))

    request.gotLength(None)
    request.handleContentChunk(b"x" * 1200)
    request.process()
    assert processed == [] and request.replies == []

    checked_keys.gate.set()
    await _checked(request)
    await asyncio.sleep(0)

    assert processed == [1] and request.content.tell() == 1200


async def test_a_check_that_fails_is_a_503_and_stores_nothing(settings, monkeypatch):
    async def broken(authorization: str) -> None:
        raise RuntimeError("database down")

    monkeypatch.setattr(auth, "refusal_of_header", broken)
    settings.FILES_MAX_BYTES = 5000
    request = _request(b"POST", b"/v1/files", b"Bearer sk-good")

    request.gotLength(5000)
    await asyncio.gather(request.upload_check, return_exceptions=True)
    await asyncio.sleep(0)
    request.handleContentChunk(b"x" * 5000)
    request.process()

    status, error = _answer(request)
    assert status == 503 and error["error"]["type"] == "service_unavailable"
    assert dict(request.replies[0]["headers"])[b"Retry-After"] == b"5"
    assert request.content.tell() == 0


async def test_a_connection_lost_while_the_key_is_checked_is_let_go(settings, checked_keys):
    """The check's end resumed reading on the channel, which a lost connection no longer
    has: an error in the check's callback."""
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure
    from twisted.web import http

    settings.FILES_MAX_BYTES = 5000
    checked_keys.gate.clear()
    request = _request(b"POST", b"/v1/files", b"Bearer sk-good")
    request.gotLength(None)
    request.handleContentChunk(b"x" * 1600)  # past the API's limit: reading paused
    http.Request.connectionLost(request, Failure(ConnectionDone()))
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))

    checked_keys.gate.set()
    await _checked(request)
    await asyncio.sleep(0)

    assert errors == [] and request.replies == []


def test_an_upload_within_the_api_limit_is_left_to_the_view(settings):
    """No key is checked twice for the uploads the API's limit takes anyway."""
    request = _request(b"POST", b"/v1/files")

    request.gotLength(1000)
    request.handleContentChunk(b"x" * 1000)

    assert request.upload_check is None and request.content.tell() == 1000


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"POST", b"/v1/chat/completions"), (b"POST", b"/v1/files/file-1"), (b"PUT", b"/v1/files")],
)
async def test_every_other_request_keeps_the_api_limit(settings, checked_keys, method, target):
    settings.FILES_MAX_BYTES = 5000
    request = _request(method, target, b"Bearer sk-good")

    request.gotLength(5000)
    await _checked(request)  # its key is checked: a wrong one would be a 401

    assert request.is_too_large and request.upload_limit == 0


async def test_a_file_larger_than_allowed_is_still_cut_off(settings, checked_keys):
    settings.FILES_MAX_BYTES = 5000
    request = _request(b"POST", b"/v1/files", b"Bearer sk-good")

    request.gotLength(None)
    await _checked(request)
    for _ in range(3):
        request.handleContentChunk(b"x" * 65536)

    assert request.is_too_large and request.content.tell() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("header", "status", "code"),
    [
        ("", 401, "missing_api_key"),
        ("Basic abc", 401, "invalid_api_key"),
        ("Bearer sk-not-a-key", 401, "invalid_api_key"),
        ("live", None, None),
        ("inactive", 403, "tenant_inactive"),
    ],
)
async def test_the_check_answers_as_the_api_would(tenant, header, status, code):
    from django.db import connections

    from tenants import services

    if header in ("live", "inactive"):
        _, raw_key = await sync_to_async(services.api_key_create)(tenant=tenant, name="k")
        if header == "inactive":
            tenant.is_active = False
            await sync_to_async(tenant.save)()
        header = f"Bearer {raw_key}"
    try:
        refusal = await auth.refusal_of_header(header)
    finally:
        # the check ran on the event loop's shared threads, which keep their connections
        await asyncio.get_running_loop().run_in_executor(None, connections.close_all)
        await sync_to_async(connections.close_all)()

    assert (refusal and (refusal.status, refusal.code)) == ((status, code) if status else None)


@pytest.mark.parametrize(
    ("target", "length"),
    [
        (b"/v1/chat/completions", 5000),  # declared past the limit
        (b"/v1/chat/completions", None),  # chunked past it
        (b"/v1/files", 10**9),  # declared past even a file's limit
    ],
)
async def test_a_wrong_key_is_a_401_whatever_the_body_on_any_api_path(
    settings, checked_keys, target, length
):
    """The API checks the key before the body; the web server's 413 for a body past the
    limit came first (a wrong key with a 9 MB chat request got 413, not 401). A right key
    still gets its 413, and none of the body is stored."""
    settings.FILES_MAX_BYTES = 5000
    for key, status in ((b"Bearer sk-wrong", 401), (b"Bearer sk-good", 413)):
        request = _request(b"POST", target, key)
        request.gotLength(length)
        request.handleContentChunk(b"x" * 5000)
        await _checked(request)
        request.handleContentChunk(b"x" * 5000)
        request.requestReceived(b"POST", target, b"HTTP/1.1")

        assert _answer(request)[0] == status and request.content.tell() == 0


def test_a_body_past_the_limit_off_the_api_is_a_413_with_no_key_check(checked_keys):
    request = _request(b"POST", b"/chat/new/")
    request.gotLength(5000)
    request.requestReceived(b"POST", b"/chat/new/", b"HTTP/1.1")
    assert _answer(request)[0] == 413 and checked_keys.seen == []
