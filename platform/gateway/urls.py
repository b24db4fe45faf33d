from django.urls import path, re_path

from batches import views as batch_views
from gateway import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/models", views.models, name="models"),
    path("v1/models/<path:model>", views.model_detail, name="model-detail"),
    path("v1/openapi.json", views.openapi_document, name="openapi"),
    path("v1/files", batch_views.files, name="files"),
    path("v1/files/<str:file_id>", batch_views.file_detail, name="file-detail"),
    path("v1/files/<str:file_id>/content", batch_views.file_content, name="file-content"),
    path("v1/batches", batch_views.batches, name="batches"),
    path("v1/batches/<str:batch_id>", batch_views.batch_detail, name="batch-detail"),
    path("v1/batches/<str:batch_id>/cancel", batch_views.batch_cancel, name="batch-cancel"),
    re_path(r"^v1/(?P<path>.*)$", views.api_not_found),
    path("health/live", views.live, name="health-live"),
    path("health/ready", views.ready, name="health-ready"),
    path("metrics", views.prometheus_metrics, name="metrics"),
]
