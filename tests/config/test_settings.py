"""Settings resolve in each mode; each case runs in a fresh interpreter."""

import json
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env

PROBE = """
import json, django
from django.conf import settings
django.setup()
db = settings.DATABASES["default"]
print(json.dumps({
    "embedded": settings.IS_EMBEDDED,
    "debug": settings.DEBUG,
    "db_engine": db["ENGINE"],
    "db_name": str(db["NAME"]),
    "db_host": db.get("HOST"),
    "db_pool": db.get("OPTIONS", {}).get("pool"),
    "conn_max_age": db.get("CONN_MAX_AGE"),
    "conn_health_checks": db.get("CONN_HEALTH_CHECKS"),
    "cache": settings.CACHES["default"]["BACKEND"],
    "cache_location": settings.CACHES["default"].get("LOCATION"),
    "channel_layer": settings.CHANNEL_LAYERS["default"]["BACKEND"],
    "broker": settings.CELERY_BROKER_URL,
    "celery_broker": __import__("config").celery_app.conf.broker_url,
    "allowed_hosts": settings.ALLOWED_HOSTS,
    "csrf_trusted_origins": settings.CSRF_TRUSTED_ORIGINS,
    "secret_key": settings.SECRET_KEY,
    "hsts_seconds": getattr(settings, "SECURE_HSTS_SECONDS", 0),
}))
"""

PRODUCTION_ENV = {
    "DATABASE_URL": "postgres://app:pw@db.internal:5432/platform",
    "REDIS_URL": "redis://cache.internal:6379/2",
    "SECRET_KEY": "x" * 60,
    "ALLOWED_HOSTS": "llm.example.com, api.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://llm.example.com",
    "DEBUG": None,
}


def _settings(tmp_path, **env: str | None) -> dict:
    base = {"DATABASE_URL": None, "REDIS_URL": None, "SECRET_KEY": None, "DEBUG": None}
    base.update(env)
    result = subprocess.run(
        [PYTHON, "-c", PROBE],
        env=subprocess_env(VAR_DIR=str(tmp_path / "var"), **base),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def test_embedded_mode_needs_no_environment(tmp_path):
    settings = _settings(tmp_path)

    assert settings["embedded"] and settings["debug"]
    assert settings["db_engine"] == "django.db.backends.sqlite3"
    assert settings["db_name"] == str(tmp_path / "var" / "db.sqlite3")
    assert settings["cache"] == "django.core.cache.backends.locmem.LocMemCache"
    assert settings["channel_layer"] == "channels.layers.InMemoryChannelLayer"
    assert settings["broker"] == settings["celery_broker"] == "filesystem://localhost/"
    assert "127.0.0.1" in settings["allowed_hosts"]


def test_embedded_secret_key_is_generated_once_and_kept(tmp_path):
    first = _settings(tmp_path)["secret_key"]
    assert len(first) >= 50
    assert _settings(tmp_path)["secret_key"] == first
    assert (tmp_path / "var" / "secret_key").stat().st_mode & 0o077 == 0


def test_production_mode_from_the_environment(tmp_path):
    settings = _settings(tmp_path, **PRODUCTION_ENV)

    assert not settings["embedded"] and not settings["debug"]
    assert settings["db_engine"] == "django.db.backends.postgresql"
    assert (settings["db_host"], settings["db_name"]) == ("db.internal", "platform")
    assert settings["db_pool"]["max_size"] == 20 and settings["conn_max_age"] == 0
    # the pool checks a connection before it lends it: one the database dropped (a restart,
    # a failover) is replaced, not handed to a request that then fails
    assert settings["conn_health_checks"] is True
    assert settings["cache"] == "django.core.cache.backends.redis.RedisCache"
    assert settings["cache_location"] == PRODUCTION_ENV["REDIS_URL"]
    assert settings["channel_layer"] == "channels_redis.core.RedisChannelLayer"
    assert settings["broker"] == settings["celery_broker"] == PRODUCTION_ENV["REDIS_URL"]
    assert settings["allowed_hosts"] == ["llm.example.com", "api.example.com"]
    assert settings["csrf_trusted_origins"] == ["https://llm.example.com"]
    assert settings["secret_key"] == "x" * 60


def test_secret_key_is_required_when_debug_is_off(tmp_path):
    env = {**PRODUCTION_ENV, "SECRET_KEY": None}
    with pytest.raises(AssertionError, match="SECRET_KEY must be set"):
        _settings(tmp_path, **env)
    # the embedded mode keeps its own generated key, debug pages or not
    assert _settings(tmp_path, DEBUG="0")["secret_key"]


def test_the_example_secret_key_is_refused(tmp_path):
    """``cp deploy/llm-platform.env.example`` kept its published placeholder as the key that
    signs sessions, password resets and messages; Django's own check passes it (long enough)."""
    example = (ROOT / "deploy" / "llm-platform.env.example").read_text()
    placeholder = next(
        line.split("=", 1)[1] for line in example.splitlines() if line.startswith("SECRET_KEY=")
    )
    with pytest.raises(AssertionError, match="SECRET_KEY is the example's placeholder"):
        _settings(tmp_path, **{**PRODUCTION_ENV, "SECRET_KEY": placeholder})


def test_behind_tls_browsers_are_told_to_keep_to_https(tmp_path):
    """No ``Strict-Transport-Security``: a network attacker could strip TLS from a first
    visit. On by default where cookies are secure (behind TLS), a year, as Django advises."""
    assert _settings(tmp_path, **PRODUCTION_ENV)["hsts_seconds"] == 31_536_000
    insecure = {**PRODUCTION_ENV, "SECURE_COOKIES": "0"}
    assert _settings(tmp_path, **insecure)["hsts_seconds"] == 0
    assert (
        _settings(tmp_path, **{**PRODUCTION_ENV, "SECURE_HSTS_SECONDS": "600"})["hsts_seconds"]
        == 600
    )
    assert _settings(tmp_path)["hsts_seconds"] == 0  # embedded: plain HTTP on localhost


def test_the_embedded_mode_served_beyond_loopback_shows_no_debug_pages(tmp_path):
    """``HOST=0.0.0.0 make run`` served Django's debug pages (tracebacks, the URL list) to
    anybody on the network who sent ``Host: localhost``."""
    exposed = _settings(tmp_path, HOST="0.0.0.0")
    assert exposed["embedded"] and not exposed["debug"]
    assert "localhost" in exposed["allowed_hosts"]  # this machine's browser still gets in
    assert exposed["secret_key"] == _settings(tmp_path)["secret_key"]  # still its own
    assert _settings(tmp_path, HOST="127.0.0.1")["debug"]
    assert _settings(tmp_path, HOST="0.0.0.0", DEBUG="1")["debug"]  # asked for: as asked


def test_malformed_boolean_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="DEBUG must be a boolean"):
        _settings(tmp_path, DEBUG="maybe")


def _mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_embedded_files_holding_secrets_are_private(tmp_path):
    var = tmp_path / "var"
    _settings(tmp_path)
    assert _mode(var / "secret_key") == 0o600
    assert _mode(var / "db.sqlite3") == 0o600  # created before Django ever opens it

    # files an older version left readable are tightened
    for name in ("secret_key", "db.sqlite3"):
        (var / name).chmod(0o644)
    _settings(tmp_path)
    assert _mode(var / "secret_key") == _mode(var / "db.sqlite3") == 0o600


def test_the_migrated_embedded_database_stays_private(tmp_path):
    result = subprocess.run(
        [PYTHON, "manage.py", "migrate", "--verbosity", "0"],
        cwd=ROOT,
        env=subprocess_env(
            VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, REDIS_URL=None, DEBUG=None
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    database = tmp_path / "var" / "db.sqlite3"
    assert database.stat().st_size > 0
    for path in tmp_path.joinpath("var").glob("db.sqlite3*"):  # with -wal and -shm if left
        assert _mode(path) == 0o600, path
