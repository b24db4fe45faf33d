"""Fixtures of the tenants' tests."""

import pytest

from tenants import services


@pytest.fixture
def crew(django_user_model, tenant):
    """Acme with an owner, an admin and a member."""
    make = django_user_model.objects.create_user
    crew = {name: make(name, password=f"pw-{name}-123") for name in ("owner", "admin", "member")}
    for name, user in crew.items():
        services.membership_set(tenant=tenant, user=user, role=name, actor=None)
    return crew
