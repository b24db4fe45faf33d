"""The web server's body limit is raised for file uploads only."""

from types import SimpleNamespace

import pytest
from twisted.web.test.requesthelper import DummyChannel

from config.webserver import RawBodyRequest


def _request(method: bytes, target: bytes) -> RawBodyRequest:
    channel = DummyChannel()
    channel.factory = SimpleNamespace(server=SimpleNamespace(protocol_connected=lambda r: None))
    channel._command, channel._path = method, target
    request = RawBodyRequest(channel)
    request.body_limit = 1000
    return request


def test_an_upload_to_files_may_be_as_large_as_a_file(settings):
    settings.FILES_MAX_BYTES = 5000
    request = _request(b"POST", b"/v1/files?x=1")

    request.gotLength(5000)
    request.handleContentChunk(b"x" * 5000)

    assert not request.is_too_large and request.content.tell() == 5000


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"POST", b"/v1/chat/completions"), (b"POST", b"/v1/files/file-1"), (b"PUT", b"/v1/files")],
)
def test_every_other_request_keeps_the_api_limit(settings, method, target):
    settings.FILES_MAX_BYTES = 5000
    request = _request(method, target)

    request.gotLength(5000)

    assert request.is_too_large


def test_a_file_larger_than_allowed_is_still_cut_off(settings):
    settings.FILES_MAX_BYTES = 5000
    request = _request(b"POST", b"/v1/files")

    request.gotLength(None)
    for _ in range(3):
        request.handleContentChunk(b"x" * 65536)

    assert request.is_too_large and request.content.tell() == 0
