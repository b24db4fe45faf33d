from django.urls import include, path

from console import audit, batches, joining, views

app_name = "console"

urlpatterns = [
    path("", views.home, name="home"),
    path("platform/", views.platform, name="platform"),
    path("platform/deployments/", views.deployment_action, name="deployment-action"),
    path("join/", joining.join, name="join"),
    path("join/<str:code>/", joining.join_link, name="join-link"),
    path("t/<slug:slug>/", views.dashboard, name="dashboard"),
    path("t/<slug:slug>/usage.csv", views.usage_csv, name="usage-csv"),
    path("t/<slug:slug>/keys/", views.keys, name="keys"),
    path("t/<slug:slug>/members/", views.members, name="members"),
    path("t/<slug:slug>/batches/", include(batches.urlpatterns)),
    *audit.urlpatterns,
]
