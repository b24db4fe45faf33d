from django.contrib import admin
from django.urls import path

from config import views

urlpatterns = [
    path("", views.landing, name="landing"),
    path("admin/", admin.site.urls),
]
