"""The process boundaries of DESIGN.md: the engine never imports Django or the web tier; the
web tier imports no torch or transformers, and of the engine only its protocol and client."""

import ast
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, subprocess_env

WEB_TIER_DIRS = [ROOT / "platform", ROOT / "tenants"]
WEB_TIER_PACKAGES = {
    "django",
    "channels",
    "daphne",
    "celery",
    "config",
    "tenants",
    "serving",
    "gateway",
    "chat",
    "console",
}
HEAVY_PACKAGES = {"torch", "transformers", "tokenizers", "safetensors"}
ENGINE_MODULES_FOR_WEB = {
    "inference_engine",
    "inference_engine.protocol",
    "inference_engine.client",
}


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _python_files(*folders: Path) -> list[Path]:
    return [path for folder in folders for path in sorted(folder.rglob("*.py"))]


def test_engine_imports_nothing_from_the_web_tier():
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in _python_files(ROOT / "inference_engine")
        for module in _imports(path)
        if module.split(".")[0] in WEB_TIER_PACKAGES
    }
    assert not offenders


def _web_may_import(module: str) -> bool:
    top = module.split(".")[0]
    if top in HEAVY_PACKAGES:
        return False
    return (
        top != "inference_engine"
        or module in ENGINE_MODULES_FOR_WEB
        or any(module.startswith(f"{allowed}.") for allowed in ENGINE_MODULES_FOR_WEB - {top})
    )


def test_web_tier_imports_no_torch_and_only_the_engines_protocol_and_client():
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in _python_files(*WEB_TIER_DIRS)
        for module in _imports(path)
        if not _web_may_import(module)
    }
    assert not offenders


PLATFORM_PACKAGES = {path.name for path in (ROOT / "platform").iterdir() if path.is_dir()}


def test_tenants_imports_nothing_from_platform():
    """``tenants/`` holds the models, services, selectors and quota counters: the web tier's
    request path, HTTP and settings live in ``platform/`` and may use it, never the reverse.
    (Migrations name only apps, not modules, so they pass as well.)"""
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in _python_files(ROOT / "tenants")
        for module in _imports(path)
        if module.split(".")[0] in PLATFORM_PACKAGES
    }
    assert {"config", "serving", "gateway", "chat", "console"} <= PLATFORM_PACKAGES
    assert not offenders


def _run(code: str, tmp_path: Path) -> str:
    result = subprocess.run(
        [PYTHON, "-c", code],
        env=subprocess_env(VAR_DIR=str(tmp_path)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_engine_protocol_and_client_load_without_torch_or_django(tmp_path):
    client = (ROOT / "inference_engine" / "client.py").exists()
    code = f"""
import sys
import inference_engine, inference_engine.protocol
{"import inference_engine.client" if client else ""}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(HEAVY_PACKAGES | {"django"})})
print(",".join(heavy))
"""
    assert _run(code, tmp_path) == ""


@pytest.mark.parametrize("entry", ["config.asgi", "config.celery"])
def test_web_tier_processes_load_no_torch(tmp_path, entry):
    code = f"""
import pkgutil, sys, importlib, django
django.setup()
import {entry}
roots = [info.name for info in pkgutil.iter_modules(["platform"]) if info.ispkg] + ["tenants"]
for root in roots:
    package = importlib.import_module(root)
    for info in pkgutil.walk_packages(package.__path__, prefix=root + "."):
        importlib.import_module(info.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(HEAVY_PACKAGES)})
print(",".join(heavy))
"""
    assert _run(code, tmp_path) == ""


def test_the_engines_tests_run_where_no_web_tier_is_installed(tmp_path):
    """The GPU machine runs the engine's tests without Django or Channels
    (``bench/gpu_session.sh``): an autouse fixture of the whole suite that imported Channels
    failed every one of them at set-up there, and spent a GPU call."""
    hidden = tmp_path / "hidden"
    for package in ("django", "channels"):
        (hidden / package).mkdir(parents=True)
        (hidden / package / "__init__.py").write_text(f"raise ImportError('no {package} here')\n")
    paths = os.pathsep.join([str(hidden), str(ROOT / "platform"), str(ROOT)])
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "pytest",
            "-p",
            "no:django",
            "-q",
            "tests/inference_engine/test_protocol.py",
        ],
        cwd=ROOT,
        env=subprocess_env(PYTHONPATH=paths),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " error" not in result.stdout.splitlines()[-1]
