"""The Celery app, wired the same way in both modes.

Start a worker with ``celery -A config worker --beat`` from the project's virtual
environment (``make`` puts ``platform/`` on its path). The broker comes from settings:
Redis when ``REDIS_URL`` is set, otherwise a filesystem broker under ``var/``.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("llm_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
