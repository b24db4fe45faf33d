"""Run Triton kernels on CPU tensors when there is no GPU: ``TRITON_INTERPRET`` is read when a
kernel is decorated, so the engine tests' conftest imports this before any test module."""

from __future__ import annotations

import os
import platform

import torch

# Triton ships wheels for x86-64 Linux only; requirements-test.txt installs it there
TRITON_EXPECTED = platform.machine() == "x86_64"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def enable() -> None:
    if DEVICE == "cuda" or not TRITON_EXPECTED:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, scope) -> None:
        """Triton 3.6's interpreter holds scalars as 1-element arrays, which NumPy 2.4 no
        longer turns into an int: a loop bounded by a loaded value would fail to run."""
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_with_scalar_index
