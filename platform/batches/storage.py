"""Where files' bytes live: the ``files`` storage when ``STORAGES`` names one (any Django
storage backend in production), else ``var/files/``, owner-only."""

from django.conf import settings
from django.core.files.storage import FileSystemStorage, Storage, storages

STORAGE_ALIAS = "files"


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
    return settings.FILES_MAX_BYTES
