#!/usr/bin/env python
"""Django's command-line utility, with the web tier's source root on sys.path."""

import os
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent


def main() -> None:
    # platform/ is a source root, never a package: `import platform` stays the stdlib's.
    sys.path[:0] = [str(BASE_DIR / "platform"), str(BASE_DIR)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
