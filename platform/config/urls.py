from django.contrib import admin
from django.urls import include, path

from config import sign_in, views

admin.site.login_form = sign_in.AdminSignInForm  # the admin's sign-in is throttled too

urlpatterns = [
    path("", views.landing, name="landing"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("admin/", admin.site.urls),
    path("accounts/login/", sign_in.SignInView.as_view(), name="login"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("chat/", include("chat.urls")),
    path("console/", include("console.urls")),
    path("", include("gateway.urls")),
]
