"""What ``make run`` prints once it is up: every address a person opens, and the login."""

from config.demo import CREATE_SUPERUSER_HINT, DemoCredentials

PAGES = (
    ("Chat", "/chat/", "talk with the models"),
    ("Console", "/console/", "usage, API keys, members; the platform page for staff"),
    ("Admin", "/admin/", "tenants, plans, keys, deployments"),
    ("API", "/v1", "OpenAI-compatible: base_url for the openai SDK"),
    ("API docs", "/v1/openapi.json", "the OpenAPI document"),
)


def banner_lines(base_url: str, credentials: DemoCredentials | None) -> list[str]:
    """The addresses under ``base_url``; with the demo's ``credentials``, the login and the
    API key; without (production), how to make a user."""
    lines = ["", f"Open {base_url}/ in a browser:"]
    width = max(len(name) for name, _, _ in PAGES) + 1
    for name, path, what in PAGES:
        lines.append(f"  {name + ':':<{width}} {base_url}{path}  ({what})")
    if credentials is None:
        lines.append(f"  Sign in with your own user (none yet? {CREATE_SUPERUSER_HINT})")
    else:
        lines.append(f"  login: {credentials.login}")
        lines.append(f"API key: {credentials.api_key_shown}")
    lines.append(f"Ready once {base_url}/health/ready answers 200 (the engine loads first).")
    lines.append("")
    return lines
