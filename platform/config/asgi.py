"""ASGI entry point: the API through a lean Django handler, pages through Django with its
full middleware, WebSockets through Channels.

Static files are served by the app itself (the platform must work offline, without a CDN or
a separate web server); set SERVE_STATIC=0 when a proxy serves STATIC_ROOT instead.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs Django set up)
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from config.origins import websocket_application  # noqa: E402
from gateway.asgi import ApiASGIHandler, is_api_path  # noqa: E402

pages_app = ASGIStaticFilesHandler(django_asgi_app) if settings.SERVE_STATIC else django_asgi_app
api_app = ApiASGIHandler()


async def http_app(scope, receive, send) -> None:
    app = api_app if is_api_path(scope["path"]) else pages_app
    await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": websocket_application(),
    }
)
