"""One accessor for FastDeploy's config and metadata objects (stdlib only).

FastDeploy hands attribute objects (``FDConfig``, ``ForwardMeta``); tests and older
versions hand mappings with the same names. Every serving module reads them through
:func:`field` so both forms behave the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]``; ``None`` when absent (or when ``obj`` is ``None``)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)
