"""Where files' bytes live: the ``files`` storage when ``STORAGES`` names one (any Django
storage backend, set in a settings module of your own), else the directory ``FILES_DIR``
(``VAR_DIR/files`` by default), owner-only. Every web process and worker must reach the same
files: the web tier stores an upload, the worker that runs its batch reads it and writes the
results, and the web tier serves those."""

from django.conf import settings
from django.core.files.storage import FileSystemStorage, Storage, storages

STORAGE_ALIAS = "files"


def file_storage() -> Storage:
    if STORAGE_ALIAS in settings.STORAGES:
        return storages[STORAGE_ALIAS]
    return FileSystemStorage(
        location=settings.FILES_DIR or settings.VAR_DIR / "files",
        file_permissions_mode=0o600,
        directory_permissions_mode=0o700,
    )


def max_file_bytes() -> int:
    """The largest file ``POST /v1/files`` takes: ``FILES_MAX_BYTES``, default 100 MB."""
    return settings.FILES_MAX_BYTES


def max_line_bytes() -> int:
    """The longest line of a batch input file: ``GATEWAY_MAX_BODY_BYTES``, the largest
    request the API takes."""
    return settings.GATEWAY_MAX_BODY_BYTES
