"""Bearer API keys: ``Authorization: Bearer sk-…``."""

from django.http import HttpRequest

from config.workers import database_worker
from gateway.errors import ApiError
from tenants.models import ApiKey
from tenants.services import ApiKeyInvalid, api_key_authenticate

_MESSAGES = {
    "missing": "You didn't provide an API key. Send it as 'Authorization: Bearer sk-…'.",
    "expired": "Your API key has expired.",
    "revoked": "Your API key has been revoked.",
}
_INCORRECT = "Incorrect API key provided."


def bearer_key(request: HttpRequest) -> str:
    """The raw key from the Authorization header; 401 when it is missing or not Bearer."""
    header = request.headers.get("Authorization", "")
    scheme, _, raw_key = header.partition(" ")
    if not header:
        raise ApiError(401, _MESSAGES["missing"], code="missing_api_key")
    if scheme.lower() != "bearer" or not raw_key.strip():
        raise ApiError(401, _INCORRECT, code="invalid_api_key")
    return raw_key.strip()


def api_key_for(raw_key: str) -> ApiKey:
    """The live key with its tenant; 401 for any bad key, 403 for an inactive tenant."""
    try:
        api_key = api_key_authenticate(raw_key=raw_key)
    except ApiKeyInvalid as exc:
        raise ApiError(401, _MESSAGES.get(exc.reason, _INCORRECT), code="invalid_api_key") from exc
    if not api_key.tenant.is_active:
        raise ApiError(403, "Your organization is inactive.", code="tenant_inactive")
    return api_key


aapi_key_for = database_worker(api_key_for)


async def authenticate(request: HttpRequest) -> ApiKey:
    return await aapi_key_for(bearer_key(request))
