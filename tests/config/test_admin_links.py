"""The admin links to the chat and the console, as they link to it."""

import pytest

pytestmark = pytest.mark.django_db


def test_the_admin_links_to_the_chat_and_the_console(client, django_user_model):
    staff = django_user_model.objects.create_superuser("root", "", "pw-root-12345")
    client.force_login(staff)
    page = client.get("/admin/").content.decode()
    # once each (found twice, by the templates' folder and by the app, they showed twice)
    assert page.count('href="/chat/"') == page.count('href="/console/"') == 1
    assert "Log out" in page  # the admin's own links stay
