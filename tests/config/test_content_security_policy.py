"""Every page carries a Content-Security-Policy that runs no inline script: the chat turns
model output into HTML, and the sanitizer was its only guard."""

import re

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("path", ["/", "/accounts/login/", "/admin/login/", "/chat/", "/console/"])
def test_every_page_has_a_policy_that_runs_no_inline_script(client, admin_user, path):
    client.force_login(admin_user)
    response = client.get(path, follow=True)
    policy = dict(
        part.strip().split(" ", 1) for part in response["Content-Security-Policy"].split(";")
    )
    assert policy["script-src"] == "'self'"  # no 'unsafe-inline', no 'unsafe-eval'
    assert policy["object-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    # the chat's socket, on this host only
    assert policy["connect-src"] == "'self' ws://testserver"


def test_behind_tls_the_socket_allowed_is_wss(client, admin_user, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    client.force_login(admin_user)
    response = client.get(
        "/chat/", follow=True, HTTP_X_FORWARDED_PROTO="https", HTTP_HOST="testserver"
    )
    assert "connect-src 'self' wss://testserver;" in response["Content-Security-Policy"]


def test_no_template_holds_an_inline_script_or_handler():
    """What the policy would block: an ``on…=`` attribute or a ``<script>`` without ``src``
    (``json_script``'s data blocks are made at render time and run nothing)."""
    offenders = []
    for template in (ROOT / "platform").rglob("templates/**/*.html"):
        text = template.read_text()
        if re.search(r"\son[a-z]+\s*=", text) or re.search(r"<script(?![^>]*\bsrc=)", text):
            offenders.append(str(template.relative_to(ROOT)))
    assert offenders == []


def test_djangos_debug_page_for_a_server_error_keeps_its_scripts(client, settings):
    """Its sections open and close by inline scripts, which the policy would block."""
    from django.http import HttpResponse, HttpResponseServerError

    from config.security import ContentSecurityPolicyMiddleware

    def answer(status: int):
        response = HttpResponseServerError() if status == 500 else HttpResponse()
        return ContentSecurityPolicyMiddleware(lambda request: response)

    request = client.get("/").wsgi_request
    settings.DEBUG = True
    assert "Content-Security-Policy" not in answer(500)(request)
    assert "Content-Security-Policy" in answer(200)(request)
    settings.DEBUG = False
    assert "Content-Security-Policy" in answer(500)(request)
