"""The platform's one settings module, driven by the environment.

Two modes share this file:

- **embedded** (no environment needed): SQLite under ``var/``, in-memory channel layer,
  local-memory cache, a filesystem Celery broker. ``make run`` uses it.
- **production**: ``DATABASE_URL`` selects PostgreSQL (psycopg 3, pooled), ``REDIS_URL``
  backs the cache, the channel layer and the Celery broker, and ``SECRET_KEY`` is required
  whenever ``DEBUG`` is off.

Every variable is listed in the README's configuration table.
"""

import ipaddress
import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.private_files import private_file_ensure, private_file_write

BASE_DIR = Path(__file__).resolve().parents[2]
VAR_DIR = Path(os.environ.get("VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {value!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


DATABASE_URL = os.environ.get("DATABASE_URL", "").strip()
REDIS_URL = os.environ.get("REDIS_URL", "").strip()
IS_EMBEDDED = not DATABASE_URL

# where `make run` serves (runplatform passes its --host on): debug pages only on loopback
SERVED_ON_LOOPBACK = os.environ.get("HOST", "127.0.0.1") in {"127.0.0.1", "localhost", "::1"}
DEBUG = env_bool("DEBUG", default=IS_EMBEDDED and SERVED_ON_LOOPBACK)


def _embedded_secret_key() -> str:
    """A per-installation key kept in var/, so sessions survive restarts of `make run`."""
    path = VAR_DIR / "secret_key"
    if path.exists():
        private_file_ensure(path)
        return path.read_text().strip()
    key = secrets.token_urlsafe(50)
    private_file_write(path, key)
    return key


SECRET_KEY = os.environ.get("SECRET_KEY", "").strip()
if not SECRET_KEY:
    if not (DEBUG or IS_EMBEDDED):
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = _embedded_secret_key()
if SECRET_KEY.startswith("replace-with-"):  # deploy/llm-platform.env.example's, published
    raise ImproperlyConfigured(
        "SECRET_KEY is the example's placeholder: set it to the output of "
        "python3 -c 'import secrets; print(secrets.token_urlsafe(50))'."
    )

ALLOWED_HOSTS = env_list(
    "ALLOWED_HOSTS",
    ["localhost", "127.0.0.1", "[::1]", "testserver"] if DEBUG or IS_EMBEDDED else [],
)
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "config",  # before django.contrib.auth: its createsuperuser and changepassword audit
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "tenants",
    "serving",
    "gateway",
    "chat",
    "console",
    "batches",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "config.security.ContentSecurityPolicyMiddleware",
    "config.query_values.QueryValueMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "tenants.audit.AuditMiddleware",
]
# Proxies (addresses or networks) whose X-Forwarded-For names the client, for the audit log's
# addresses; behind a TLS proxy on another host, name it here.
FORWARDED_ALLOW_IPS = env_list("FORWARDED_ALLOW_IPS", ["127.0.0.1", "::1"])
for _proxy in FORWARDED_ALLOW_IPS:  # a typo stops start-up, not every request
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError as exc:
        raise ImproperlyConfigured(f"FORWARDED_ALLOW_IPS: {exc}") from None

# Flash messages live in the session (on the server), not in a cookie, which is signed but
# not encrypted. No secret goes through them: a new API key is shown on the page that made it.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

ROOT_URLCONF = "config.urls"
API_URLCONF = "gateway.urls"  # what gateway.asgi resolves API paths against
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # the apps' templates: config's admin/base_site.html (links to the chat and the
        # console) wins over the admin app's own, config being listed before it
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------------------

if IS_EMBEDDED:
    # SQLite creates the database with the umask's mode (often world-readable) and gives its
    # -wal and -shm files the database's mode: create it owner-only before it is opened.
    private_file_ensure(VAR_DIR / "db.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "db.sqlite3",
            "OPTIONS": {
                # Daphne and the Celery worker write concurrently: WAL plus IMMEDIATE
                # transactions make writers queue instead of failing with "database is locked".
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # Connections outlive a request on the API's shared worker threads
            # (config.workers); SQLite's are cheap to keep and slow-ish to open.
            "CONN_MAX_AGE": 600,
            # A file, not memory, so live-server tests can share it with their subprocesses;
            # one per test run, so concurrent runs in one checkout don't collide.
            "TEST": {"NAME": str(VAR_DIR / f"test-db-{os.getpid()}.sqlite3")},
        }
    }
else:
    _database = dj_database_url.parse(DATABASE_URL)
    if _database["ENGINE"] == "django.db.backends.postgresql":
        _pool_max = int(os.environ.get("DATABASE_POOL_MAX_SIZE", "20"))
        _database["CONN_MAX_AGE"] = 0  # Django's pool owns connection reuse.
        # The pool checks a connection before lending it: one the database dropped (a
        # restart, a failover, an idle timeout) is replaced, not handed to a request.
        _database["CONN_HEALTH_CHECKS"] = True
        _database.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": _pool_max}
    DATABASES = {"default": _database}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Cache, channel layer, Celery -------------------------------------------------------------

if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": os.environ.get("CACHE_KEY_PREFIX", "llmp"),
        }
    }
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    # Quota counters and chat claims live here: culling at the default 300 entries would drop
    # live ones at random.
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "OPTIONS": {"MAX_ENTRIES": 1_000_000},
        }
    }
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # A broker that needs no server: kombu's filesystem transport, one folder under var/.
    CELERY_BROKER_DIR = VAR_DIR / "celery" / "broker"
    CELERY_RESULTS_DIR = VAR_DIR / "celery" / "results"
    for _folder in (CELERY_BROKER_DIR, CELERY_RESULTS_DIR, VAR_DIR / "celery" / "control"):
        _folder.mkdir(parents=True, exist_ok=True)
    # a host named, though the transport ignores it: kombu warns of a missing one otherwise
    CELERY_BROKER_URL = "filesystem://localhost/"
    # kombu's, with every file written whole before any process can read it (config.celery_broker)
    CELERY_BROKER_TRANSPORT = "config.celery_broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_DIR),
        "data_folder_out": str(CELERY_BROKER_DIR),
        "control_folder": str(VAR_DIR / "celery" / "control"),
    }
    CELERY_RESULT_BACKEND = f"file://{CELERY_RESULTS_DIR}"

CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", default=False)
BATCH_SWEEP_SECONDS = float(os.environ.get("BATCH_SWEEP_SECONDS", "60"))
# usage records the database could not take when their requests ended, until it can
# (``serving.usage_spool``): shared by the web processes and the Celery worker
USAGE_SPOOL_DIR = Path(os.environ.get("USAGE_SPOOL_DIR", VAR_DIR / "usage-spool"))
CELERY_BEAT_SCHEDULE = {
    "replay-usage-spool": {"task": "serving.replay_usage_spool", "schedule": 60.0},
    "rollup-usage": {"task": "tenants.rollup_usage", "schedule": 300.0},
    "purge-old-usage": {"task": "tenants.purge_old_usage", "schedule": 24 * 3600.0},
    "purge-old-audit-events": {"task": "tenants.purge_old_audit_events", "schedule": 24 * 3600.0},
    "purge-closed-invitations": {
        "task": "tenants.purge_closed_invitations",
        "schedule": 24 * 3600.0,
    },
    "poll-engine-health": {"task": "serving.poll_engine_health", "schedule": 15.0},
    "purge-old-conversations": {"task": "chat.purge_old_conversations", "schedule": 24 * 3600.0},
    "purge-empty-conversations": {"task": "chat.purge_empty_conversations", "schedule": 3600.0},
    "sweep-batches": {"task": "batches.sweep_batches", "schedule": BATCH_SWEEP_SECONDS},
    "purge-orphaned-files": {"task": "batches.purge_orphaned_files", "schedule": 24 * 3600.0},
}
# The Batch API's runner: lines of one batch in flight at once, and how long a worker's hold
# on a batch lasts unrenewed (a killed worker's batch is resumed that long after, at most
# one sweep, every BATCH_SWEEP_SECONDS, later).
BATCH_MAX_IN_FLIGHT = int(os.environ.get("BATCH_MAX_IN_FLIGHT", "16"))
BATCH_LEASE_SECONDS = float(os.environ.get("BATCH_LEASE_SECONDS", "60"))
# A batch's run holds a worker for as long as the batch lasts: runs have a queue of their own,
# served by workers of their own (`make run` starts one, deploy/ has a unit and a service), so
# that health polls, roll-ups, model loads and the sweep never wait behind them.
BATCH_QUEUE = "batches"
CELERY_TASK_ROUTES = {"batches.run_batch": {"queue": BATCH_QUEUE}}
# A worker reserves one task per process beyond those it runs (Celery's default is four): a
# busy batch worker holding queued runs would keep them from another host's idle one until
# the sweep takes them for lost (10 minutes: batches.selectors.REQUEUE_AFTER).
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Daphne processes `make run` starts on one listening socket. More than one needs REDIS_URL:
# quotas, the chat's channel layer and the API's auth generation must be shared.
WEB_PROCESSES = int(os.environ.get("WEB_PROCESSES", "1"))
RUN_WORKER = env_bool("RUN_WORKER", default=True)  # `make run` starts a worker with beat
CELERY_WORKER_ARGS = os.environ.get("CELERY_WORKER_ARGS", "--concurrency 2")
BATCH_WORKER_ARGS = os.environ.get("BATCH_WORKER_ARGS", "--concurrency 2")  # batches at once
USAGE_RETENTION_DAYS = int(os.environ.get("USAGE_RETENTION_DAYS", "400"))
ROLLUP_RETENTION_DAYS = int(os.environ.get("ROLLUP_RETENTION_DAYS", "1100"))
CHAT_RETENTION_DAYS = int(os.environ.get("CHAT_RETENTION_DAYS", "0"))  # 0: keep forever
AUDIT_RETENTION_DAYS = int(os.environ.get("AUDIT_RETENTION_DAYS", "1100"))  # 0: keep forever
# where beat keeps when each task last ran: it must outlive the worker (compose: a volume)
CELERY_BEAT_SCHEDULE_FILENAME = os.environ.get(
    "CELERY_BEAT_SCHEDULE_FILENAME", str(VAR_DIR / "celerybeat-schedule")
)
CELERY_TIMEZONE = "UTC"

# --- Auth, i18n, static -----------------------------------------------------------------------

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

LOGIN_URL = "/accounts/login/"
# Failed sign-ins (config.sign_in): at most so many per account from one address, per account,
# and per address, in a window that starts at the first failure; then refused until it ends.
SIGN_IN_WINDOW_SECONDS = int(os.environ.get("SIGN_IN_WINDOW_SECONDS", "900"))
SIGN_IN_FAILURES_PER_PAIR = int(os.environ.get("SIGN_IN_FAILURES_PER_PAIR", "5"))
SIGN_IN_FAILURES_PER_ACCOUNT = int(os.environ.get("SIGN_IN_FAILURES_PER_ACCOUNT", "20"))
SIGN_IN_FAILURES_PER_ADDRESS = int(os.environ.get("SIGN_IN_FAILURES_PER_ADDRESS", "50"))
LOGIN_REDIRECT_URL = "/chat/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "static"))
SERVE_STATIC = env_bool("SERVE_STATIC", default=True)

if not DEBUG:
    SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", default=not IS_EMBEDDED)
    CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # behind TLS, browsers keep to HTTPS for a year (sent on HTTPS answers only)
    SECURE_HSTS_SECONDS = int(
        os.environ.get("SECURE_HSTS_SECONDS", "31536000" if SESSION_COOKIE_SECURE else "0")
    )
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)

# --- The engine that `make run` starts beside Daphne -----------------------------------------

RUN_ENGINE = env_bool("RUN_ENGINE", default=True)
MODEL_PATH = os.environ.get("MODEL_PATH", str(BASE_DIR / "models" / "demo-chat"))
SERVED_MODEL_NAME = os.environ.get("SERVED_MODEL_NAME", "demo-chat")
ENGINE_ENDPOINT = os.environ.get("ENGINE_ENDPOINT", f"ipc://{VAR_DIR / 'engine.sock'}")
# Extra `python -m inference_engine` flags, e.g. "--dtype bfloat16 --device cuda".
ENGINE_ARGS = os.environ.get("ENGINE_ARGS", "--kv-cache-memory 268435456")
# CPUs of the engine that `make run` starts: auto (the web tier gets one core per Daphne
# process, at most half; the engine the rest), off, or a list such as "2-7" (config.placement)
ENGINE_CPUS = os.environ.get("ENGINE_CPUS", "auto")

# --- API gateway ------------------------------------------------------------------------------

GATEWAY_MAX_BODY_BYTES = int(os.environ.get("GATEWAY_MAX_BODY_BYTES", str(8 * 1024 * 1024)))
# web pages (origins) that may call /v1/ from the browser; "*": any, as OpenAI's API and vLLM
# answer (the API's credential is a key the page must hold, never a cookie; gateway.cors)
API_CORS_ALLOWED_ORIGINS = env_list("API_CORS_ALLOWED_ORIGINS", ["*"])
# the largest file POST /v1/files takes (the Batch API's input); only that path gets the room
FILES_MAX_BYTES = int(os.environ.get("FILES_MAX_BYTES", str(100 * 1024 * 1024)))
# where files' bytes live (batches.storage): every web process and worker must see the same
# directory (a shared volume, NFS); unset: VAR_DIR/files
FILES_DIR = os.environ.get("FILES_DIR") or None
DATA_UPLOAD_MAX_MEMORY_SIZE = GATEWAY_MAX_BODY_BYTES
# How long a web process trusts what it read about an API key and its model (see
# gateway.authorization); 0 reads the database on every request.
GATEWAY_AUTH_CACHE_SECONDS = float(os.environ.get("GATEWAY_AUTH_CACHE_SECONDS", "5"))
# a concurrency slot's lease: its process renews it while the request runs (tenants.slots)
QUOTA_SLOT_LEASE_SECONDS = float(os.environ.get("QUOTA_SLOT_LEASE_SECONDS", "60"))
METRICS_BEARER_TOKEN = os.environ.get("METRICS_BEARER_TOKEN", "")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"probe_answers": {"()": "config.access_log.ProbeAnswersFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        # the root's handler alone (with DEBUG on, Django's own printed each error twice)
        "django": {"handlers": [], "level": "INFO"},
        "django.request": {"handlers": [], "filters": ["probe_answers"]},
    },
}
