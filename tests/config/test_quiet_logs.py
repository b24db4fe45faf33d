"""Known harmless noise is handled where it starts: Daphne logs no line per static file, and
the embedded mode's Celery worker neither warns that it runs as root (a container's user)
nor that its filesystem broker has no host."""

import io
import logging
import os
import subprocess

import pytest

from config.access_log import QuietAccessLog
from tests.conftest import PYTHON, ROOT, subprocess_env


def _request(path: str, status: int = 200) -> dict:
    return {"client": "127.0.0.1:5", "method": "GET", "path": path, "status": status, "size": 9}


def test_static_files_are_logged_at_debug_and_pages_as_before(caplog):
    stream = io.StringIO()
    log = QuietAccessLog(stream)
    with caplog.at_level(logging.DEBUG, logger="daphne.access"):
        log("http", "complete", _request("/static/chat/chat.css"))
        log("http", "complete", _request("/favicon.ico", 301))
        log("http", "complete", _request("/chat/"))
        log("websocket", "connected", {"client": "127.0.0.1:5", "path": "/ws/chat/1/"})

    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and '"GET /chat/" 200 9' in lines[0] and "WSCONNECT" in lines[1]
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
    assert "/static/chat/chat.css" in caplog.records[0].getMessage()


def test_the_web_server_installs_it():
    from daphne import cli

    from config import webserver

    before = cli.AccessLogGenerator
    try:
        webserver.access_log.install()
        assert cli.AccessLogGenerator is QuietAccessLog
    finally:
        cli.AccessLogGenerator = before


PROBE = """
import warnings
warnings.simplefilter("default")
import django
django.setup()
from celery.platforms import check_privileges
from config.celery import app
check_privileges({"json"})
app.connection_for_write()._info()
print("probed")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="Celery warns about root only to root")
def test_the_embedded_worker_does_not_warn_about_root_or_its_broker_host(tmp_path):
    env = subprocess_env(DATABASE_URL=None, REDIS_URL=None, VAR_DIR=str(tmp_path / "var"))
    result = subprocess.run(
        [PYTHON, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert "probed" in result.stdout, result.stderr
    assert "superuser" not in result.stderr and "No hostname" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="Celery warns about root only to root")
def test_a_production_worker_run_as_root_is_still_warned(tmp_path):
    env = subprocess_env(
        DATABASE_URL="postgres://nobody@127.0.0.1:1/none", SECRET_KEY="x" * 50,
        REDIS_URL="redis://127.0.0.1:1/0", VAR_DIR=str(tmp_path / "var"),
    )  # fmt: skip
    probe = PROBE.replace("app.connection_for_write()._info()\n", "")
    result = subprocess.run(
        [PYTHON, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert "probed" in result.stdout, result.stderr
    assert "superuser" in result.stderr


ERRORS_PROBE = """
import logging, types
import django
django.setup()
log = logging.getLogger("django.request")
log.error("Internal Server Error: /chat/x", extra={"status_code": 500})
probe = types.SimpleNamespace(path="/health/ready")
log.error("Service Unavailable: /health/ready", extra={"status_code": 503, "request": probe})
page = types.SimpleNamespace(path="/v1/models")
log.error("Service Unavailable: /v1/models", extra={"status_code": 503, "request": page})
"""


def test_a_server_error_is_logged_once_and_a_probe_saying_not_ready_not_at_all(tmp_path):
    """In the embedded mode (DEBUG) Django's own handler printed every request error a
    second time, and each of the readiness probe's 503s while the engine loads was an ERROR
    pair (some fifteen at every start)."""
    result = subprocess.run(
        [PYTHON, "-c", ERRORS_PROBE],
        env=subprocess_env(
            VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, REDIS_URL=None, SECRET_KEY=None
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert sum("Internal Server Error: /chat/x" in line for line in lines) == 1, lines
    assert not any("/health/ready" in line for line in lines), lines
    assert sum("Service Unavailable: /v1/models" in line for line in lines) == 1, lines


@pytest.mark.parametrize(
    ("path", "status", "kept"),
    [
        ("/v1/chat/completions", 400, False),  # the client's error: its body says why
        ("/v1/models/nope", 404, False),
        ("/chat/", 403, False),
        ("/health/ready", 503, False),  # "not ready", for the probe to read
        ("/v1/chat/completions", 500, True),  # the server's own failure
        ("/chat/", 502, True),
    ],
)
def test_django_logs_a_server_error_but_no_client_error(path, status, kept):
    """Every API 4xx was logged again as a WARNING beside its access line."""
    from types import SimpleNamespace

    from config.access_log import ProbeAnswersFilter

    record = logging.LogRecord("django.request", logging.WARNING, "", 0, "x", None, None)
    record.request, record.status_code = SimpleNamespace(path=path), status
    assert ProbeAnswersFilter().filter(record) is kept
