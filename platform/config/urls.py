from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from config import sign_in, views

admin.site.login_form = sign_in.AdminSignInForm  # the admin's sign-in is throttled too
admin.site.password_change = sign_in.admin_password_change  # and its password page

urlpatterns = [
    path("", views.landing, name="landing"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("admin/", admin.site.urls),
    path("accounts/login/", sign_in.SignInView.as_view(), name="login"),
    # of Django's account pages, signing out and changing one's password (the platform sends no
    # mail: no reset by mail)
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path(
        "accounts/password_change/",
        sign_in.AuditedPasswordChangeView.as_view(),
        name="password_change",
    ),
    path(
        "accounts/password_change/done/",
        auth_views.PasswordChangeDoneView.as_view(),
        name="password_change_done",
    ),
    path("chat/", include("chat.urls")),
    path("console/", include("console.urls")),
    path("", include("gateway.urls")),
]
