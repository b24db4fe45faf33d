"""`platform/` is a source root, never a package: the stdlib's `platform` must win."""

import subprocess
import sysconfig

from tests.conftest import PYTHON, ROOT, subprocess_env

PROBE = """
import django, platform
django.setup()
import config.asgi, config.celery  # every entry point's imports
import platform as again
assert again is platform
print(platform.__file__)
print(platform.system())
"""


def test_django_process_still_sees_the_standard_librarys_platform(tmp_path):
    result = subprocess.run(
        [PYTHON, "-c", PROBE],
        env=subprocess_env(VAR_DIR=str(tmp_path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    module_file, system = result.stdout.split()
    assert module_file.startswith(sysconfig.get_paths()["stdlib"])
    assert system == "Linux"


def test_pytest_process_sees_it_too():
    import platform

    assert platform.system() == "Linux"
    assert not (ROOT / "platform" / "__init__.py").exists()
