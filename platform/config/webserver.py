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
"""

from __future__ import annotations

import io
import json
import os
import sys

from daphne import http_protocol
from daphne.cli import CommandLineInterface

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
        body = json.dumps(
            {
                "error": {
                    "message": f"The request body exceeds {self.body_limit} bytes.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        self.handle_reply(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"Content-Type", b"application/json"), (b"Connection", b"close")],
            }
        )
        self.handle_reply({"type": "http.response.body", "body": body})

    def _discard_body(self) -> None:
        self.is_too_large = True
        if self.content is not None:
            self.content.close()
        self.content = io.BytesIO()


def use_raw_body_requests() -> None:
    """Make every connection Daphne accepts from now on build ``RawBodyRequest``s (its
    ``HTTPFactory`` reads the module's ``WebRequest`` for each new connection)."""
    http_protocol.WebRequest = RawBodyRequest


def main(argv: list[str] | None = None) -> None:
    use_raw_body_requests()
    CommandLineInterface().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
