"""OpenAI's rate-limit headers, from where admission left the per-minute limits."""

import math

from tenants.quotas import Window


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: 850ms, 12s, 1m30s."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    seconds = math.ceil(seconds)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def ratelimit_headers(windows: dict[str, Window], retry_after: int | None = None) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, and ``Retry-After`` for a
    refusal."""
    headers = {}
    for kind, window in windows.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = format_reset(window.reset_seconds)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return headers
