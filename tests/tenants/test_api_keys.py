from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import api_keys, services
from tenants.models import ApiKey

pytestmark = pytest.mark.django_db


def test_created_key_is_returned_once_and_only_its_hash_is_stored(tenant, user):
    api_key, raw_key = services.api_key_create(tenant=tenant, name="ci", created_by=user)

    assert raw_key.startswith("sk-") and len(raw_key) == api_keys.KEY_LENGTH
    stored = ApiKey.objects.get(pk=api_key.pk)
    assert stored.key_hash == api_keys.hash_key(raw_key)
    assert stored.prefix == raw_key[3:11]
    for field in ApiKey._meta.concrete_fields:
        assert raw_key not in str(getattr(stored, field.attname))
    assert raw_key not in repr(stored.__dict__)


def test_keys_are_unique(tenant):
    keys = {services.api_key_create(tenant=tenant, name=f"k{i}")[1] for i in range(20)}
    assert len(keys) == 20


def test_valid_key_authenticates_with_tenant_and_marks_last_use(tenant):
    api_key, raw_key = services.api_key_create(tenant=tenant, name="ci")

    authenticated = services.api_key_authenticate(raw_key=raw_key)

    assert authenticated.pk == api_key.pk
    assert authenticated.tenant == tenant
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda key: key[:-1] + ("A" if key[-1] != "A" else "B"), "mismatch"),
        (lambda key: key[:-1], "malformed"),
        (lambda key: "", "malformed"),
        (lambda key: "Bearer " + key, "malformed"),
        (lambda key: key.replace("sk-", "pk-"), "malformed"),
        (lambda key: key[:10] + "!" + key[11:], "malformed"),
        (lambda key: "sk-" + "Z" * 48, "unknown"),
    ],
)
def test_wrong_or_malformed_keys_do_not_authenticate(tenant, mangle, reason):
    _, raw_key = services.api_key_create(tenant=tenant, name="ci")

    with pytest.raises(services.ApiKeyInvalid) as excinfo:
        services.api_key_authenticate(raw_key=mangle(raw_key))
    assert excinfo.value.reason == reason


def test_right_prefix_with_wrong_secret_does_not_authenticate(tenant):
    _, raw_key = services.api_key_create(tenant=tenant, name="ci")
    forged = raw_key[:11] + api_keys.generate_key()[11:]

    with pytest.raises(services.ApiKeyInvalid, match="mismatch"):
        services.api_key_authenticate(raw_key=forged)


def test_revoked_key_does_not_authenticate(tenant):
    api_key, raw_key = services.api_key_create(tenant=tenant, name="ci")
    services.api_key_revoke(api_key=api_key)

    with pytest.raises(services.ApiKeyInvalid, match="revoked"):
        services.api_key_authenticate(raw_key=raw_key)


def test_expired_key_does_not_authenticate(tenant):
    _, raw_key = services.api_key_create(
        tenant=tenant, name="ci", expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(services.ApiKeyInvalid, match="expired"):
        services.api_key_authenticate(raw_key=raw_key)


def test_key_with_future_expiry_authenticates(tenant):
    _, raw_key = services.api_key_create(
        tenant=tenant, name="ci", expires_at=timezone.now() + timedelta(days=1)
    )
    assert services.api_key_authenticate(raw_key=raw_key).tenant == tenant


def test_revoking_twice_keeps_the_first_time(tenant):
    api_key, _ = services.api_key_create(tenant=tenant, name="ci")
    first = services.api_key_revoke(api_key=api_key).revoked_at
    assert services.api_key_revoke(api_key=api_key).revoked_at == first


def test_negative_key_limit_is_refused(tenant):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        services.api_key_create(tenant=tenant, name="ci", requests_per_minute=-1)
