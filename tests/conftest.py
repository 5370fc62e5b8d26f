"""Test-session setup shared by every module.

Without a CUDA GPU the Triton kernels run under the interpreter; ``TRITON_INTERPRET`` must be set
before any ``@triton.jit`` decoration happens, i.e. before the first test module imports the
kernels, whichever module that is.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a module that sets ``GPU_LONG_VARIANTS = True``, the first variant of each parametrized GPU
    test stays ``gpu`` and the others become ``gpu_long``: each compiles its own kernel (~7 s on the
    H200), so ``pytest -m gpu`` runs one of each in minutes and ``-m gpu_long`` runs the rest (runs
    before the ``-m`` selection: a conftest's ``tryfirst`` hook)."""
    seen: set[tuple[str, str]] = set()
    for item in items:
        module = getattr(item, "module", None)
        if not getattr(module, "GPU_LONG_VARIANTS", False) or item.get_closest_marker("gpu") is None:
            continue
        key = (module.__name__, getattr(item, "originalname", item.name))
        if key not in seen:
            seen.add(key)
            continue
        item.own_markers = [m for m in item.own_markers if m.name != "gpu"]
        item.add_marker(pytest.mark.gpu_long)
