"""Where files' bytes live: the ``files`` storage when ``STORAGES`` names one (any Django
storage backend in production), else ``var/files/``, owner-only."""

import os

from django.conf import settings
from django.core.files.storage import FileSystemStorage, Storage, storages

STORAGE_ALIAS = "files"
DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024


def file_storage() -> Storage:
    if STORAGE_ALIAS in settings.STORAGES:
        return storages[STORAGE_ALIAS]
    return FileSystemStorage(
        location=settings.VAR_DIR / "files",
        file_permissions_mode=0o600,
        directory_permissions_mode=0o700,
    )


def max_file_bytes() -> int:
    """The largest file ``POST /v1/files`` takes: ``FILES_MAX_BYTES``, default 100 MB."""
    configured = getattr(settings, "FILES_MAX_BYTES", None)
    if configured is None:
        configured = os.environ.get("FILES_MAX_BYTES", DEFAULT_MAX_FILE_BYTES)
    return int(configured)
