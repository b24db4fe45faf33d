"""`make run`'s banner: every address a person opens, with the login to open them with."""

import io

import pytest
from django.core.management import call_command

from config.management.commands import runplatform

pytestmark = pytest.mark.django_db

ADDRESSES = ("/chat/", "/console/", "/admin/", "/v1 ", "/v1/openapi.json", "/health/ready")


@pytest.fixture
def embedded(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    settings.IS_EMBEDDED = True  # whatever DATABASE_URL this suite runs with
    settings.RUN_ENGINE = settings.RUN_WORKER = False
    return settings


def _banner(monkeypatch, *args: str) -> str:
    monkeypatch.setattr(runplatform.Supervisor, "run", lambda self: 0)
    out = io.StringIO()
    call_command("runplatform", "--port", "8123", *args, stdout=out)
    return out.getvalue()


def test_the_banner_lists_every_address_and_the_login(embedded, monkeypatch):
    output = _banner(monkeypatch)
    for address in ADDRESSES:
        assert f"http://127.0.0.1:8123{address}" in output, address
    assert "login: admin / " in output and "API key: sk-" in output


def test_without_the_demo_the_banner_still_lists_the_addresses(embedded, monkeypatch):
    output = _banner(monkeypatch, "--no-demo")
    for address in ADDRESSES:
        assert f"http://127.0.0.1:8123{address}" in output, address
    assert "sk-" not in output and "createsuperuser" in output


def test_a_port_in_use_stops_the_start_before_the_banner(embedded, monkeypatch):
    """The banner, and a new demo key, were printed, then Daphne looped on "Address already
    in use" while /health/ready answered from whatever held the port (the other copy, whose
    database knows no such key)."""
    import socket

    from django.core.management.base import CommandError

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    monkeypatch.setattr(runplatform.Supervisor, "run", lambda self: 0)
    out = io.StringIO()
    try:
        with pytest.raises(CommandError, match=f"127.0.0.1:{port} is in use"):
            call_command("runplatform", "--port", str(port), stdout=out)
    finally:
        taken.close()
    assert "API key" not in out.getvalue()


def test_a_second_platform_on_the_same_var_dir_is_refused(embedded, monkeypatch):
    """Two copies on one checkout shared its engine socket and supervisor state: stopping the
    second took the first one's engine away."""
    from django.core.management.base import CommandError

    def second_start(self):
        out = io.StringIO()
        with pytest.raises(CommandError, match="already runs on"):
            call_command("runplatform", "--port", "8124", stdout=out)
        return 0

    monkeypatch.setattr(runplatform.Supervisor, "run", second_start)
    call_command("runplatform", "--port", "8123", stdout=io.StringIO())
    _banner(monkeypatch)  # the first has stopped: free again


def test_an_ipv6_host_is_checked_as_daphne_binds_it(embedded, monkeypatch):
    """HOST=:: (Daphne binds it) failed the port check with a traceback: an IPv4 socket."""
    import socket

    from django.core.management.base import CommandError

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    monkeypatch.setattr(runplatform.Supervisor, "run", lambda self: 0)
    try:
        call_command("runplatform", "--host", "::1", "--port", "8125", stdout=io.StringIO())
    except CommandError as exc:  # a host without IPv6 configured: said so, no traceback
        assert "Cannot listen on ::1:8125" in str(exc)
