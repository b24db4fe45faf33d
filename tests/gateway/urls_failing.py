"""A URL conf whose API view fails, for the API handler's last-resort error."""

from django.urls import include, path

from config.urls import urlpatterns as platform_urlpatterns


async def failing_view(request):
    raise RuntimeError("boom")


urlpatterns = [path("v1/fail", failing_view), path("", include(platform_urlpatterns))]
