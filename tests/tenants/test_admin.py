import re

import pytest
from django.urls import reverse

from tenants import api_keys, services
from tenants.models import ApiKey

pytestmark = pytest.mark.django_db

CHANGELISTS = ["plan", "tenant", "membership", "apikey", "usagerecord"]


@pytest.fixture
def staff_client(client, admin_user):
    client.force_login(admin_user)
    return client


@pytest.mark.parametrize("model", CHANGELISTS)
def test_staff_can_open_every_tenants_page(staff_client, tenant, model):
    services.api_key_create(tenant=tenant, name="ci")
    assert staff_client.get(reverse(f"admin:tenants_{model}_changelist")).status_code == 200
    if model != "usagerecord":
        assert staff_client.get(reverse(f"admin:tenants_{model}_add")).status_code == 200


def test_anonymous_and_non_staff_users_are_refused(client, user):
    index = reverse("admin:index")
    response = client.get(index)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]

    client.force_login(user)
    for model in CHANGELISTS:
        response = client.get(reverse(f"admin:tenants_{model}_changelist"))
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert client.get(index).status_code == 302


def test_staff_login_through_the_form(client, django_user_model):
    django_user_model.objects.create_superuser("root", "", "s3cret-pass-phrase")
    response = client.post(
        reverse("admin:login"),
        {"username": "root", "password": "s3cret-pass-phrase", "next": "/admin/"},
    )
    assert response.status_code == 302
    assert client.get(reverse("admin:index")).status_code == 200


def test_adding_a_key_in_the_admin_shows_it_once(staff_client, tenant):
    response = staff_client.post(
        reverse("admin:tenants_apikey_add"),
        {"tenant": tenant.pk, "name": "from-admin"},
        follow=True,
    )

    assert response.status_code == 200
    shown = re.findall(r"sk-[A-Za-z0-9]{48}", response.content.decode())
    assert len(shown) == 1
    api_key = ApiKey.objects.get(name="from-admin")
    assert api_key.key_hash == api_keys.hash_key(shown[0])
    page = staff_client.get(reverse("admin:tenants_apikey_change", args=[api_key.pk]))
    assert shown[0] not in page.content.decode()


def test_revoke_action(staff_client, tenant):
    api_key, raw_key = services.api_key_create(tenant=tenant, name="ci")
    staff_client.post(
        reverse("admin:tenants_apikey_changelist"),
        {"action": "revoke_selected", "_selected_action": [api_key.pk]},
    )
    with pytest.raises(services.ApiKeyInvalid):
        services.api_key_authenticate(raw_key=raw_key)
