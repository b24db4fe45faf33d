"""The Celery app, wired the same way in both modes.

Start a worker with ``celery -A config worker --beat`` from the project's virtual
environment (``make`` puts ``platform/`` on its path). The broker comes from settings:
Redis when ``REDIS_URL`` is set, otherwise a filesystem broker under ``var/``.
"""

import os
import warnings

from celery import Celery
from celery.exceptions import SecurityWarning
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

if settings.IS_EMBEDDED:
    # The embedded mode's worker runs as whoever ran `make run`: root in a container, where
    # Celery's eight-line warning says nothing the user can act on. A production worker runs
    # under a user of its own (deploy/), and a root one is still warned about.
    warnings.filterwarnings(
        "ignore", message="You're running the worker with superuser", category=SecurityWarning
    )

app = Celery("llm_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
