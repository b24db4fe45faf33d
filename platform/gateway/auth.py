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
    "deleted": "Your API key has been deleted.",
}
_TENANT_INACTIVE = "Your organization is inactive."
_INCORRECT = "Incorrect API key provided."


def bearer_key(request: HttpRequest) -> str:
    """The raw key from the Authorization header; 401 when it is missing or not Bearer."""
    return bearer_key_of(request.headers.get("Authorization", ""))


def bearer_key_of(header: str) -> str:
    """The raw key from an Authorization header's value; 401 when it is empty or not Bearer."""
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
    if (refusal := refusal_of(api_key)) is not None:  # its tenant inactive
        raise refusal
    return api_key


def refusal_of(api_key: ApiKey | None) -> ApiError | None:
    """What the API would answer a request made now with a key already found (``None``: it
    was deleted; its tenant loaded), or ``None`` where it would be served. For work that
    outlives the request that authorized it: a batch's lines."""
    if api_key is None:
        return ApiError(401, _MESSAGES["deleted"], code="invalid_api_key")
    if api_key.is_revoked:
        return ApiError(401, _MESSAGES["revoked"], code="invalid_api_key")
    if api_key.is_expired():
        return ApiError(401, _MESSAGES["expired"], code="invalid_api_key")
    if not api_key.tenant.is_active:
        return ApiError(403, _TENANT_INACTIVE, code="tenant_inactive")
    return None


aapi_key_for = database_worker(api_key_for)


async def authenticate(request: HttpRequest) -> ApiKey:
    return await aapi_key_for(bearer_key(request))


async def refusal_of_header(authorization: str) -> ApiError | None:
    """What the API would answer a request bearing this Authorization header, or ``None``
    where its key would be served: for the web server, which takes a body larger than the
    API's limit (a file upload) only from a client that may send it."""
    try:
        await aapi_key_for(bearer_key_of(authorization))
    except ApiError as refusal:
        return refusal
    return None
