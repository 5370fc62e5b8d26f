"""Patch passes: swap a host model's attention for paged adapters and report what was done.

Exports are resolved lazily so that importing ``patch.report`` stays free of paddle.
"""

from __future__ import annotations

import importlib
from typing import Any

from .report import PatchedLayer, PatchReport, SkippedLayer

_LAZY = {
    "patch_core_attention": ".core_attention",
    "unpatch_core_attention": ".core_attention",
    "step_holder": ".core_attention",
    "cache_plan": ".core_attention",
    "patch_paddleformers": ".paddleformers",
    "unpatch_paddleformers": ".paddleformers",
}

__all__ = ["PatchReport", "PatchedLayer", "SkippedLayer", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
