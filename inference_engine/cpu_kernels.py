"""C++ kernels for the CPU, compiled on the machine that runs them.

torch ops cost several microseconds each on a CPU however little they compute, and a decode's
attention in torch ops is a dozen of them per layer, or one unfused SDPA call per request (a
chunk after a cached prefix: a gather, a mask and an SDPA call): at a batch of 80 long contexts
that is most of a step. ``csrc/paged_attention.cpp`` attends every decode and every chunk that
extends a cached context in one call per layer, reading K and V from the paged cache in its
own dtype.

It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 15 s) for this
CPU (``-march=native``) into torch's extensions cache (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``), by ``make`` before the engine starts (``python -m
inference_engine.cpu_kernels``) or else by the first engine that needs it; later starts load
it. Where it cannot be built, the engine attends with torch ops (``cpu_attention=auto``) or
refuses to start (``compiled``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
EXTENSION_NAME = "inference_engine_cpu_kernels"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, Callable[..., torch.Tensor]] = {}
_failure: list[str] = []


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here; the message says why."""


def paged_attention() -> Callable[..., None]:
    """``op(out [T, H, D], query [T, H, D], key_cache, value_cache [N, KVH, block_size, D],
    block_table [R, max_blocks], context_lens [R], query_starts [R], query_lens [R], scale)``,
    all indices int64: request r's queries are rows ``query_starts[r]`` on of ``query``, its
    last one at position ``context_lens[r] - 1``, each attending causally to the cache (where
    their own K and V already are); it writes their rows of ``out``. Built on the first call
    in this process; raises ``KernelUnavailable`` when it cannot be built."""
    with _lock:
        if not _loaded and not _failure:
            try:
                _build()
            except KernelUnavailable as error:
                _failure.append(str(error))
        if _failure:
            raise KernelUnavailable(_failure[0])
        return _loaded["paged_attention"]


def _build() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) on PATH")
    from torch.utils import cpp_extension

    started = time.monotonic()
    build_directory = _build_directory()
    try:
        build_directory.mkdir(parents=True, exist_ok=True)
        # torch's own lock is a file that outlives a builder killed mid-build, and waits on
        # it forever; an flock dies with its holder, and while it is held no one else builds
        with open(build_directory / "engine-build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_directory / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                EXTENSION_NAME,
                [str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=False,
            )
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"building {SOURCE.name} failed: {error}") from error
    _loaded["paged_attention"] = torch.ops.inference_engine.paged_attention
    logger.info("CPU attention kernel ready in %.1f s", time.monotonic() - started)


def _build_directory() -> Path:
    """One per Python, torch and CPU feature set: a build for ``-march=native`` must not be
    loaded on a CPU with fewer instructions (a shared home, an image moved between hosts)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    cpu = hashlib.sha256(_cpu_features().encode()).hexdigest()[:12]
    return Path(root) / f"{EXTENSION_NAME}-{python}-torch{torch.__version__}-cpu{cpu}"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def use_compiled_attention(mode: str, device: torch.device, backend: str) -> bool:
    """Whether the runner attends decodes and chunks with the compiled kernel: only on the
    CPU's torch backend; ``compiled`` insists (raising ``KernelUnavailable``), ``auto`` falls
    back."""
    if mode == "torch" or device.type != "cpu" or backend != "torch":
        return False
    try:
        paged_attention()
    except KernelUnavailable as error:
        if mode == "compiled":
            raise
        logger.warning("attention runs in torch ops: %s", error)
        return False
    return True


if __name__ == "__main__":
    # `make` builds the kernel ahead of the engine; a machine that cannot build it still runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        paged_attention()
    except KernelUnavailable as error:
        logger.warning("the CPU attention kernel is not available: %s", error)
