from django.urls import path

from chat import views

app_name = "chat"

urlpatterns = [
    path("", views.chat_home, name="home"),
    path("new/", views.conversation_new, name="new"),
    path("tenant/", views.tenant_choose, name="tenant"),
    path("<int:conversation_id>/", views.conversation_detail, name="conversation"),
    path("<int:conversation_id>/rename/", views.conversation_rename, name="rename"),
    path("<int:conversation_id>/delete/", views.conversation_delete, name="delete"),
]
