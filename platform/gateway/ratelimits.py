"""OpenAI's rate-limit headers, from where admission left the per-minute limits."""

from tenants.quotas import Window, format_wait


def ratelimit_headers(windows: dict[str, Window], retry_after: int | None = None) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, and ``Retry-After`` for a
    refusal."""
    headers = {}
    for kind, window in windows.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(window.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(window.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = format_wait(window.reset_seconds)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return headers
