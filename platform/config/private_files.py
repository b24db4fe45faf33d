"""Files under var/ that hold secrets (the secret key, the demo credentials, the SQLite
database): readable and writable by the platform's own user only, whatever the umask, and
tightened when an older version left them readable.

No Django here: the settings module uses it before Django is set up."""

import os
from pathlib import Path

PRIVATE_MODE = 0o600


def private_file_ensure(path: Path) -> None:
    """Create ``path`` empty when it is missing (SQLite takes an empty file for a new
    database); either way leave it owner-only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)
    finally:
        os.close(fd)


def private_file_write(path: Path, text: str) -> None:
    """Replace the content of ``path`` with ``text``; the file is owner-only before the first
    byte is written (``Path.write_text`` would create it with the umask's mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, PRIVATE_MODE)
        file.write(text)
