"""The web server's request: a body past the limit is never stored; a head past the limits
is answered 414 or 431 (Twisted's own channel dropped the connection)."""

import json
from types import SimpleNamespace

import pytest
from twisted.internet.testing import StringTransport
from twisted.web.test.requesthelper import DummyChannel

from config.webserver import HeadLimitedChannel, RawBodyRequest, use_raw_body_requests


def _request(limit: int) -> RawBodyRequest:
    channel = DummyChannel()
    channel.factory = SimpleNamespace(server=SimpleNamespace(protocol_connected=lambda r: None))
    request = RawBodyRequest(channel)
    request.body_limit = limit
    return request


def test_a_declared_length_past_the_limit_stores_nothing():
    request = _request(limit=1000)
    request.gotLength(10**9)
    for _ in range(100):
        request.handleContentChunk(b"x" * 65536)
    assert request.is_too_large and request.content.tell() == 0


def test_a_chunked_body_is_dropped_once_it_grows_past_the_limit():
    request = _request(limit=1000)
    request.gotLength(None)
    request.handleContentChunk(b"x" * 600)
    assert not request.is_too_large and request.content.tell() == 600
    request.handleContentChunk(b"x" * 600)
    request.handleContentChunk(b"x" * 65536)
    assert request.is_too_large and request.content.tell() == 0


def test_a_body_past_the_limit_is_answered_413_with_a_request_id():
    request = _request(limit=1000)
    request.gotLength(10**9)
    request.handleContentChunk(b"x" * 65536)
    replies = []
    request.handle_reply = replies.append
    request.process()
    start, body = replies
    assert start["status"] == 413
    headers = dict(start["headers"])
    assert headers[b"x-request-id"].startswith(b"req_")
    assert json.loads(body["body"])["error"]["code"] == "request_too_large"


def test_a_body_within_the_limit_is_kept_whole():
    request = _request(limit=1000)
    request.gotLength(1000)
    request.handleContentChunk(b"x" * 1000)
    assert not request.is_too_large and request.content.tell() == 1000


class _HalfClosingTransport(StringTransport):
    is_write_closed = False

    def loseWriteConnection(self) -> None:  # noqa: N802 - Twisted's name
        self.is_write_closed = True


def _channel_fed(*pieces: bytes) -> tuple[HeadLimitedChannel, _HalfClosingTransport]:
    channel, transport = HeadLimitedChannel(), _HalfClosingTransport()
    channel.makeConnection(transport)
    for piece in pieces:
        channel.dataReceived(piece)
    return channel, transport


def _answer(transport: StringTransport) -> tuple[bytes, dict]:
    head, _, body = transport.value().partition(b"\r\n\r\n")
    status, *headers = head.split(b"\r\n")
    # an answer of the API's, as every other: it names itself for the operator's log
    assert any(h.lower().startswith(b"x-request-id: req_") for h in headers), headers
    return status, json.loads(body)["error"]


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


def test_a_100_kb_header_is_a_431_and_what_follows_is_read_and_dropped():
    huge = b"Authorization: Bearer " + b"a" * 100_000 + b"\r\n"
    channel, transport = _channel_fed(HEAD, huge[:50_000], huge[50_000:], b"\r\n{}")
    status, error = _answer(transport)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert error["code"] == "request_header_fields_too_large" and error["type"]
    # half-closed, not closed: the client reads the answer, then closes
    assert transport.is_write_closed and not transport.disconnecting
    assert not channel.requests or not channel.requests[0].finished
    channel.dataReceived(b"more of the same" * 1000)
    assert transport.value().count(b"HTTP/1.1") == 1


def test_many_headers_past_the_heads_limit_are_a_431_not_a_bare_400():
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(40))
    _, transport = _channel_fed(HEAD + headers + b"\r\n")
    status, error = _answer(transport)
    assert status.startswith(b"HTTP/1.1 431 ") and "exceed" in error["message"]


def test_a_request_line_past_the_limit_is_a_414():
    _, transport = _channel_fed(b"GET /v1/models/" + b"m" * 20_000 + b" HTTP/1.1\r\n")
    status, error = _answer(transport)
    assert status == b"HTTP/1.1 414 URI Too Long" and error["code"] == "request_uri_too_long"


@pytest.mark.parametrize(
    "header",
    [b"Content-Length: Q", b"Bad Name{}: x", b"X-Nul: a\x00b", b"no colon at all"],
)
def test_a_malformed_head_is_a_400_with_the_apis_error_object(header):
    """Twisted answered a bare "400 Bad Request" with no body: no client could tell why."""
    _, transport = _channel_fed(HEAD + header + b"\r\n\r\n{}")
    status, error = _answer(transport)
    assert status == b"HTTP/1.1 400 Bad Request"
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert transport.value().count(b"HTTP/1.1") == 1


def test_the_web_server_builds_head_limited_channels():
    from daphne import http_protocol

    use_raw_body_requests()
    factory = http_protocol.HTTPFactory(server=None)
    assert isinstance(factory.buildProtocol(None)._channel, HeadLimitedChannel)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (429, b"Too Many Requests"),
        (422, b"Unprocessable Entity"),
        (413, b"Request Entity Too Large"),
    ],
)
def test_every_status_the_api_answers_has_its_reason_phrase(status, reason):
    """Twisted knows no 429: every rate-limited answer went out as "429 Unknown Status"."""
    request = _request(limit=1000)
    request.setResponseCode(status)
    assert request.code_message == reason
