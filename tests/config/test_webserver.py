"""The web server's request: a body past the limit is never stored."""

from types import SimpleNamespace

from twisted.web.test.requesthelper import DummyChannel

from config.webserver import RawBodyRequest


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


def test_a_body_within_the_limit_is_kept_whole():
    request = _request(limit=1000)
    request.gotLength(1000)
    request.handleContentChunk(b"x" * 1000)
    assert not request.is_too_large and request.content.tell() == 1000
