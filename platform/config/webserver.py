"""Daphne as the platform runs it: ``python -m config.webserver`` takes Daphne's own arguments.

Twisted's ``Request`` parses the body of every form POST (``application/x-www-form-urlencoded``
and ``multipart/form-data``) into ``request.args`` before Daphne sees the request. Daphne never
reads ``args``: it hands the raw body to the ASGI application, which parses what it needs
(Django's forms, with Django's size limits). Left on, that parse:

- refuses a body that claims to be multipart but is not with a bare 400 and a dropped
  connection, before the application can answer with its own error (OpenAI's error object on
  the API);
- parses every upload a second time, in memory and with no size limit, on the one thread that
  also streams every token (the ``email`` package's ``Content-Type`` parse alone was 9% of an
  API request's CPU time there).

Twisted's ``parsePOSTFormSubmission`` switch turns it off. Daphne builds its requests itself,
from the ``WebRequest`` of its ``http_protocol`` module, so this module points that name at a
subclass that passes the switch, then runs Daphne's command line.

Twisted also spools every body whole (to a temporary file past 100 kB) before Daphne hands the
request on, so an application's size limit would come after the bytes were stored. The same
subclass enforces ``GATEWAY_MAX_BODY_BYTES`` as the body arrives: a ``Content-Length`` over
it, or a chunked body that grows past it, is read to its end and thrown away, never stored,
and answered with a 413 in OpenAI's error format. The one exception is an upload to
``POST /v1/files``, whose limit is the files' own (``batches.storage.max_file_bytes``, 100 MB
by default) plus room for the multipart framing; the view checks the file itself.

Twisted's channel takes a request line or header line of at most 16 KiB, and 16 KiB of head
in all. Past either it drops the connection without a word (a line too long) or writes a bare
400 and closes while the client is still sending, so the client reads a reset instead.
``HeadLimitedChannel`` answers both as HTTP servers do, 414 for a request line and 431 for
headers, in OpenAI's error format, and half-closes: the client reads the answer to its end.
A malformed head (a header without a name or with a NUL, an unreadable ``Content-Length``)
is a 400 in the same format, where Twisted wrote a bare one. Each of these answers carries
an ``x-request-id``, as every other answer of the API does.
"""

from __future__ import annotations

import io
import json
import os
import sys
import uuid

from daphne import http_protocol
from daphne.cli import CommandLineInterface
from twisted.web import http

from config import access_log

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def max_body_bytes() -> int:
    """The settings' ``GATEWAY_MAX_BODY_BYTES`` once Django is set up, else the environment."""
    try:
        from django.conf import settings

        return settings.GATEWAY_MAX_BODY_BYTES
    except Exception:  # noqa: BLE001 - settings not configured (yet)
        return int(os.environ.get("GATEWAY_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))


FILES_UPLOAD_TARGET = b"/v1/files"
MULTIPART_FRAMING_BYTES = 64 * 1024


def upload_body_bytes() -> int:
    """The body limit of a file upload: the largest file plus its multipart framing."""
    try:
        from batches.storage import max_file_bytes

        return max_file_bytes() + MULTIPART_FRAMING_BYTES
    except Exception:  # noqa: BLE001 - settings not configured (yet)
        return max_body_bytes()


def is_file_upload(method: bytes, target: bytes) -> bool:
    return method == b"POST" and target.split(b"?", 1)[0] == FILES_UPLOAD_TARGET


class RawBodyRequest(http_protocol.WebRequest):
    """Daphne's request with Twisted's form parsing off (the body reaches the application
    exactly as the client sent it) and the body size limit enforced before anything is
    stored."""

    def __init__(self, channel, *args, **kwargs) -> None:
        super().__init__(channel, *args, parsePOSTFormSubmission=False, **kwargs)
        self.body_limit = max_body_bytes()
        self.num_body_bytes = 0
        self.is_too_large = False

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - Twisted's name
        # the request line is parsed by now, on the channel, before any of the body
        method, target = getattr(self.channel, "_command", b""), getattr(self.channel, "_path", b"")
        if is_file_upload(method, target):
            self.body_limit = max(self.body_limit, upload_body_bytes())
        if length is not None and length > self.body_limit:
            self._discard_body()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self.is_too_large:
            return
        self.num_body_bytes += len(data)
        if self.num_body_bytes > self.body_limit:
            self._discard_body()
            return
        super().handleContentChunk(data)

    def process(self) -> None:
        if not self.is_too_large:
            super().process()
            return
        body = _error_body(
            f"The request body exceeds {self.body_limit} bytes.", "request_too_large"
        )
        self.handle_reply(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"Content-Type", b"application/json"),
                    (b"x-request-id", _new_request_id().encode()),
                    (b"Connection", b"close"),
                ],
            }
        )
        self.handle_reply({"type": "http.response.body", "body": body})

    def _discard_body(self) -> None:
        self.is_too_large = True
        if self.content is not None:
            self.content.close()
        self.content = io.BytesIO()


def _new_request_id() -> str:
    """As the API names an answer of its own that has no usage record (``gateway.asgi``)."""
    return f"req_{uuid.uuid4().hex}"


def _error_body(message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


# how long a connection refused for its head may take to read the answer and close
REFUSED_HEAD_LINGER_SECONDS = 5
HEAD_REFUSAL_CODES = {
    400: "invalid_request",
    414: "request_uri_too_long",
    431: "request_header_fields_too_large",
}


class HeadLimitedChannel(http.HTTPChannel):
    """Twisted's HTTP channel, answering a request line or head past its limits (see the
    module docstring) with 414 or 431 instead of a dropped connection."""

    def lineLengthExceeded(self, line: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._receivedHeaderSize == 0:  # nothing of this request counted yet: its first line
            self._refuse_head(414, "URI Too Long", "The request line is too long.")
        else:
            self._refuse_head(431, "Request Header Fields Too Large", "A header is too long.")

    def lineReceived(self, line: bytes) -> None:  # noqa: N802 - Twisted's name
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            message = f"The request's headers exceed {self.totalHeadersSize} bytes."
            self._refuse_head(431, "Request Header Fields Too Large", message)
            return
        super().lineReceived(line)

    def _respondToBadRequestAndDisconnect(self) -> None:  # noqa: N802 - Twisted's name
        # a malformed head (a header without a name or with a NUL, an unreadable
        # Content-Length or chunk): Twisted's own answer is a bare 400 with no body
        self._refuse_head(400, "Bad Request", "The request's head or framing is malformed.")

    def _refuse_head(self, status: int, reason: str, message: str) -> None:
        code = HEAD_REFUSAL_CODES[status]
        body = _error_body(message, code)
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"x-request-id: {_new_request_id()}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        # Read on and drop what the client still sends: closing with unread bytes would
        # reset the connection, and the client would lose the answer.
        self.dataReceived = self.lineReceived = lambda data: None
        self.transport.write(head + body)
        # a transport that cannot half-close (none of Daphne's, today) closes
        getattr(self.transport, "loseWriteConnection", self.transport.loseConnection)()
        self.setTimeout(REFUSED_HEAD_LINGER_SECONDS)


def _head_limited_channel(factory: http.HTTPFactory) -> http._GenericHTTPChannelProtocol:
    return http._GenericHTTPChannelProtocol(HeadLimitedChannel())


def use_raw_body_requests() -> None:
    """Make every connection Daphne accepts from now on a ``HeadLimitedChannel`` that builds
    ``RawBodyRequest``s (its ``HTTPFactory`` reads the module's ``WebRequest`` for each new
    connection)."""
    http_protocol.WebRequest = RawBodyRequest
    http_protocol.HTTPFactory.protocol = _head_limited_channel


def main(argv: list[str] | None = None) -> None:
    use_raw_body_requests()
    access_log.install()  # static files at DEBUG, not a line each
    CommandLineInterface().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
