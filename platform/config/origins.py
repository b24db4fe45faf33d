"""The chat socket opens only for a page of the platform's own: its ``Origin`` is the host the
browser connected to (its ``Host`` header), or one of ``CSRF_TRUSTED_ORIGINS``, as Django's
CSRF check reads a form's origin. Channels' ``AllowedHostsOriginValidator`` alone lets any
origin through once ``ALLOWED_HOSTS`` holds ``*``: any site could then open a socket with a
signed-in user's cookie (cross-site WebSocket hijacking), and read their conversations."""

from urllib.parse import urlsplit

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator, WebsocketDenier
from django.conf import settings

DEFAULT_PORTS = {"http": 80, "https": 443}


def websocket_application():
    """The chat's WebSocket stack: same origin, an allowed host, the session's user."""
    from config.routing import websocket_urlpatterns

    return SameOriginValidator(
        AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
    )


class SameOriginValidator:
    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not is_same_origin(scope.get("headers", [])):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)


def is_same_origin(headers: list[tuple[bytes, bytes]]) -> bool:
    by_name = {name.lower(): value.decode("latin-1") for name, value in headers}
    origin, host = by_name.get(b"origin", ""), by_name.get(b"host", "")
    if not origin or not host:
        return False
    if any(_is_trusted(origin, trusted) for trusted in settings.CSRF_TRUSTED_ORIGINS):
        return True
    try:
        parsed = urlsplit(origin)
        origin_port = parsed.port or DEFAULT_PORTS.get(parsed.scheme)
        host_parsed = urlsplit(f"//{host}")
        host_port = host_parsed.port or DEFAULT_PORTS.get(parsed.scheme)
    except ValueError:  # a port that is no number
        return False
    return (
        parsed.scheme in DEFAULT_PORTS
        and bool(parsed.hostname)
        and (parsed.hostname, origin_port) == (host_parsed.hostname, host_port)
    )


def _is_trusted(origin: str, trusted: str) -> bool:
    """As Django reads ``CSRF_TRUSTED_ORIGINS``: exact, or ``https://*.example.com`` for any
    subdomain."""
    origin, trusted = origin.lower(), trusted.lower()
    if "://*." not in trusted:
        return origin == trusted
    scheme, suffix = trusted.split("://*", 1)
    return origin.startswith(f"{scheme}://") and origin.endswith(suffix)
