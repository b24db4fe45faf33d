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
"""

from __future__ import annotations

import sys

from daphne import http_protocol
from daphne.cli import CommandLineInterface


class RawBodyRequest(http_protocol.WebRequest):
    """Daphne's request with Twisted's form parsing off: the body reaches the application
    exactly as the client sent it."""

    def __init__(self, channel, *args, **kwargs) -> None:
        super().__init__(channel, *args, parsePOSTFormSubmission=False, **kwargs)


def use_raw_body_requests() -> None:
    """Make every connection Daphne accepts from now on build ``RawBodyRequest``s (its
    ``HTTPFactory`` reads the module's ``WebRequest`` for each new connection)."""
    http_protocol.WebRequest = RawBodyRequest


def main(argv: list[str] | None = None) -> None:
    use_raw_body_requests()
    CommandLineInterface().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
