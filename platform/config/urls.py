from django.contrib import admin
from django.urls import include, path

from config import views

urlpatterns = [
    path("", views.landing, name="landing"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("chat/", include("chat.urls")),
    path("console/", include("console.urls")),
    path("", include("gateway.urls")),
]
