"""The inference engine: a standalone process that owns the device (no Django).

Public API, imported lazily so that ``import inference_engine`` does not import torch:

- ``LLM(model=PATH, ...)`` with ``generate(prompts, params)`` and ``chat(conversations, params)``
- ``SamplingParams`` (wire struct, in ``inference_engine.protocol``)
- ``EngineCore`` with ``add_request``, ``abort_requests``, ``step``, ``has_unfinished_requests``
- ``EngineConfig``
- ``AsyncEngineClient`` and ``EngineUnavailable`` (the web tier's side of the wire, no torch);
  ``GenerateRequest`` and ``GenerateDelta``; the process is ``python -m inference_engine``
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "inference_engine.llm",
    "RequestOutput": "inference_engine.llm",
    "EngineCore": "inference_engine.core",
    "EngineConfig": "inference_engine.config",
    "SamplingParams": "inference_engine.protocol",
    "FinishReason": "inference_engine.protocol",
    "EngineOutput": "inference_engine.protocol",
    "GenerateRequest": "inference_engine.protocol",
    "GenerateDelta": "inference_engine.protocol",
    "AsyncEngineClient": "inference_engine.client",
    "EngineUnavailable": "inference_engine.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inference_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
