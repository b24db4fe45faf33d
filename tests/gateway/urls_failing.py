"""The API's URL conf plus views that fail, for the API handler's last-resort errors."""

from django.core.exceptions import TooManyFieldsSent
from django.urls import include, path


async def failing_view(request):
    raise RuntimeError("boom")


async def suspicious_view(request):
    raise TooManyFieldsSent("The number of GET/POST parameters exceeded the limit.")


urlpatterns = [
    path("v1/fail", failing_view),
    path("v1/suspicious", suspicious_view),
    path("", include("gateway.urls")),
]
