"""Daphne's access log, without a line for every static file.

Daphne writes an NCSA-style line per request to stdout. A page of the chat or the console
pulls in its stylesheets, scripts and icon, each a line that says nothing: requests for
static files go to the ``daphne.access`` logger at DEBUG instead (``LOG_LEVEL=DEBUG`` shows
them), every other request is written as before, but for the secret in an invitation link's
path."""

import logging

from daphne import cli
from daphne.access import AccessLogGenerator

logger = logging.getLogger("daphne.access")
STATIC_PATHS = ("/static/", "/favicon.ico")
# paths whose rest is a secret (an invitation link's code): logged without it
SECRET_PATHS = ("/console/join/",)


def is_static(path: str) -> bool:
    return path.startswith(STATIC_PATHS)


class QuietAccessLog(AccessLogGenerator):
    def __call__(self, protocol: str, action: str, details: dict) -> None:
        if protocol == "http" and action == "complete" and is_static(details.get("path", "")):
            logger.debug(
                '"%s %s" %s %s',
                details.get("method"),
                details.get("path"),
                details.get("status"),
                details.get("size"),
            )
            return
        super().__call__(protocol, action, _redacted(details))


def _redacted(details: dict) -> dict:
    """``details`` with the secret part of its path left out."""
    path = details.get("path") or ""
    for prefix in SECRET_PATHS:
        if path.startswith(prefix) and len(path) > len(prefix):
            return {**details, "path": prefix + "…"}
    return details


def install() -> None:
    """Make Daphne's command line build ``QuietAccessLog`` for its access log."""
    cli.AccessLogGenerator = QuietAccessLog


class ProbeAnswersFilter(logging.Filter):
    """Drops Django's request log for what is no server error: a client's error (a 4xx: the
    access log has its line, and its body tells the client why), and a health probe's own
    answer (a 503 from ``/health/ready`` says "not ready": the engine loading, a database
    away, which the probe reads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", 0) or 0
        if 400 <= status < 500:
            return False
        request = getattr(record, "request", None)
        path = getattr(request, "path", "") if request is not None else ""
        return not (path.startswith("/health/") and status == 503)
