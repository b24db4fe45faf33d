"""The API's URL conf plus a view that fails, for the API handler's last-resort error."""

from django.urls import include, path


async def failing_view(request):
    raise RuntimeError("boom")


urlpatterns = [path("v1/fail", failing_view), path("", include("gateway.urls"))]
