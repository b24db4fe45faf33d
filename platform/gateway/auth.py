"""Bearer API keys: ``Authorization: Bearer sk-…``."""

from django.http import HttpRequest

from gateway.errors import ApiError
from tenants.models import ApiKey
from tenants.services import ApiKeyInvalid, aapi_key_authenticate

_MESSAGES = {
    "missing": "You didn't provide an API key. Send it as 'Authorization: Bearer sk-…'.",
    "expired": "Your API key has expired.",
    "revoked": "Your API key has been revoked.",
}
_INCORRECT = "Incorrect API key provided."


async def authenticate(request: HttpRequest) -> ApiKey:
    """The request's live API key with its tenant; 401 for any bad key, 403 for an inactive
    tenant."""
    header = request.headers.get("Authorization", "")
    scheme, _, raw_key = header.partition(" ")
    if not header:
        raise ApiError(401, _MESSAGES["missing"], code="missing_api_key")
    if scheme.lower() != "bearer" or not raw_key.strip():
        raise ApiError(401, _INCORRECT, code="invalid_api_key")
    try:
        api_key = await aapi_key_authenticate(raw_key=raw_key.strip())
    except ApiKeyInvalid as exc:
        raise ApiError(401, _MESSAGES.get(exc.reason, _INCORRECT), code="invalid_api_key") from exc
    if not api_key.tenant.is_active:
        raise ApiError(403, "Your organization is inactive.", code="tenant_inactive")
    return api_key
