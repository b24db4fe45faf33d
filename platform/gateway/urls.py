from django.urls import path, re_path

from gateway import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models", views.models, name="models"),
    path("v1/models/<path:model>", views.model_detail, name="model-detail"),
    path("v1/openapi.json", views.openapi_document, name="openapi"),
    re_path(r"^v1/(?P<path>.*)$", views.api_not_found),
    path("health/live", views.live, name="health-live"),
    path("health/ready", views.ready, name="health-ready"),
    path("metrics", views.prometheus_metrics, name="metrics"),
]
