"""The pages' Content-Security-Policy: scripts and styles from the platform's own origin only.

The chat renders model output as HTML (marked, then DOMPurify); the policy is the second line
should anything ever get past the sanitizer: no inline script or event handler runs, no
script loads from elsewhere, nothing is framed or posted off-site. The pages run none inline
(their behaviours live in their static scripts). Styles may be inline (a few ``style``
attributes; styles run no code). The socket's own address is allowed by name: browsers
before CSP level 3 do not count ``ws:`` to the same host as ``'self'``. The API's answers
(JSON) carry none: they are no pages (``gateway.asgi`` serves them without this stack)."""

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self' {socket}; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def content_security_policy(request: HttpRequest) -> str:
    scheme = "wss" if request.is_secure() else "ws"
    try:
        socket = f"{scheme}://{request.get_host()}"
    except DisallowedHost:  # answered 400 already: no socket to allow
        socket = ""
    return POLICY.format(socket=socket)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        # Django's debug page for a server error toggles its sections with inline scripts
        is_debug_page = settings.DEBUG and response.status_code >= 500
        if "Content-Security-Policy" not in response and not is_debug_page:
            response["Content-Security-Policy"] = content_security_policy(request)
        return response
