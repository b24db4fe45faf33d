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
by default) plus room for the multipart framing, and only for a client whose API key the API
would serve: anyone else's upload is held to the API's limit and answered as the API answers
its key (``RawBodyRequest``). The view checks the file itself.

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

import asyncio
import io
import json
import logging
import os
import sys
import uuid
from http import HTTPStatus

from daphne import http_protocol
from daphne.cli import CommandLineInterface
from twisted.web import http

from config import access_log

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# Twisted's reason phrases lack 422, 429 and 431 ("429 Unknown Status" on every rate limit):
# the standard library's fill the gaps, Twisted's own stay
for _status in HTTPStatus:
    http.RESPONSES.setdefault(_status.value, _status.phrase.encode())
SERVICE_UNAVAILABLE = "The server could not check your API key; try again."
UNAVAILABLE_RETRY_AFTER_SECONDS = 5  # as the API's own service_unavailable (serving.runs)


def max_body_bytes() -> int:
    """The settings' ``GATEWAY_MAX_BODY_BYTES`` once Django is set up, else the environment."""
    try:
        from django.conf import settings

        return settings.GATEWAY_MAX_BODY_BYTES
    except Exception:  # noqa: BLE001 - settings not configured (yet)
        return int(os.environ.get("GATEWAY_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))


API_PREFIX = b"/v1/"
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
    stored.

    A file upload may be larger than the API's limit, but only for a client whose key the API
    would serve: the key is checked (on the API's database threads) as soon as the head is in,
    while the body starts to arrive. Past the API's limit the body waits (the socket is no
    longer read) until the check is done; a refused key's body is read to its end and thrown
    away, and answered as the API answers that key. So is any other API request's body past
    the limit: a wrong key is the API's 401 whatever follows, as the API checks the key before
    the body; a right one gets the 413."""

    def __init__(self, channel, *args, **kwargs) -> None:
        super().__init__(channel, *args, parsePOSTFormSubmission=False, **kwargs)
        self.body_limit = max_body_bytes()
        self.num_body_bytes = 0
        # (status, OpenAI's error object, further headers)
        self.refusal: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None
        self.upload_check: asyncio.Future | None = None
        self.upload_limit = 0
        self.is_reading_paused = False
        self.is_body_received = False
        self.is_process_waiting = False

    @property
    def is_too_large(self) -> bool:
        return self.refusal is not None and self.refusal[0] == 413

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - Twisted's name
        # the request line is parsed by now, on the channel, before any of the body
        method = getattr(self.channel, "_command", b"")
        may_pass_limit = length is None or length > self.body_limit
        if may_pass_limit and is_file_upload(method, self._target()):
            self.upload_limit = upload_body_bytes()
            if length is not None and length > self.upload_limit:
                self.body_limit = self.upload_limit
                self._refuse_too_large()  # a wrong key's 401 first, as on every API path
                return
            self._check_key()
        elif length is not None and length > self.body_limit:
            self._refuse_too_large()
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802 - Twisted's name
        if self.refusal is not None:
            return
        self.num_body_bytes += len(data)
        if self.num_body_bytes > self.body_limit:
            if self.upload_check is None or self.upload_check.done():
                self._refuse_too_large()
                return
            self._pause_reading()  # kept: at most what the channel had read already
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:  # noqa: N802
        self.is_body_received = True
        super().requestReceived(command, path, version)

    def process(self) -> None:
        if self.upload_check is not None and not self.upload_check.done():
            self.is_process_waiting = True  # answered once the key is checked
            return
        if self.refusal is None:
            super().process()
            return
        status, body, headers = self.refusal
        self.handle_reply(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"Content-Type", b"application/json"),
                    (b"x-request-id", _new_request_id().encode()),
                    (b"Connection", b"close"),
                    *headers,
                ],
            }
        )
        self.handle_reply({"type": "http.response.body", "body": body})

    def _refuse_too_large(self) -> None:
        """413 for a body past the limit; on the API, a key the API would refuse is answered
        as the API answers it (its 401 or 403 comes before anything of the body, as there)."""
        self._refuse_body(413)
        if self.upload_check is None and self._target().startswith(API_PREFIX):
            self._check_key()

    def _target(self) -> bytes:
        """The request line's target (parsed by the channel before any of the body)."""
        return getattr(self.channel, "_path", b"") if self.channel is not None else b""

    def _check_key(self) -> None:
        from gateway.auth import refusal_of_header  # the web tier's, once Django is set up

        header = (self.requestHeaders.getRawHeaders(b"Authorization") or [b""])[0]
        self.upload_check = asyncio.ensure_future(refusal_of_header(header.decode("latin-1")))
        self.upload_check.add_done_callback(self._key_checked)

    def _key_checked(self, check: asyncio.Future) -> None:
        if check.cancelled() or check.exception() is not None:
            if not check.cancelled():
                logger.error("Checking a request's API key failed", exc_info=check.exception())
            self._refuse(
                503,
                SERVICE_UNAVAILABLE,
                "service_unavailable",
                "service_unavailable",
                headers=[(b"Retry-After", str(UNAVAILABLE_RETRY_AFTER_SECONDS).encode())],
            )
        elif (refusal := check.result()) is not None:
            body = refusal.body().error
            self.refusal = None  # the key's refusal before a 413 for its body's size
            self._refuse(refusal.status, body.message, body.code, body.type)
        elif self.upload_limit:
            self.body_limit = self.upload_limit
            if self.num_body_bytes > self.body_limit:
                self._refuse_body(413)
        if self.is_reading_paused and not self.is_body_received and self.channel is not None:
            # (a connection lost meanwhile has no channel left to read from)
            self.is_reading_paused = False
            self.channel._networkProducer.resumeProducing()
        if self.is_process_waiting and not self._disconnected:
            self.is_process_waiting = False
            self.process()

    def _pause_reading(self) -> None:
        if not self.is_reading_paused:
            self.is_reading_paused = True
            self.channel._networkProducer.pauseProducing()

    def _refuse_body(self, status: int) -> None:
        message = f"The request body exceeds {self.body_limit} bytes."
        self._refuse(status, message, "request_too_large")

    def _refuse(
        self,
        status: int,
        message: str,
        code: str | None,
        error_type: str = "invalid_request_error",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Answer ``status`` once the body is in, and store none of it."""
        if self.refusal is None:
            self.refusal = (status, _error_body(message, code, error_type), headers or [])
        if self.content is not None:
            self.content.close()
        self.content = io.BytesIO()


def _new_request_id() -> str:
    """As the API names an answer of its own that has no usage record (``gateway.asgi``)."""
    return f"req_{uuid.uuid4().hex}"


def _error_body(message: str, code: str | None, error_type: str = "invalid_request_error") -> bytes:
    error = {"message": message, "type": error_type, "param": None, "code": code}
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
