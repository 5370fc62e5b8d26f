"""Adapters: layers that replace a host model's attention and run it on the paged KV cache.

Exports are resolved lazily so that importing ``adapter.context`` stays free of paddle.
"""

from __future__ import annotations

import importlib
from typing import Any

from .context import StepContext, StepContextHolder

_LAZY = {
    "PagedCoreAttention": ".core_attention",
    "SinkFuser": ".core_attention",
    "ValuePadFuser": ".core_attention",
    "backend_layer": ".core_attention",
}

__all__ = ["StepContext", "StepContextHolder", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
