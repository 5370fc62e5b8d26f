"""Test-session setup shared by every module.

Without a CUDA GPU the Triton kernels run under the interpreter; ``TRITON_INTERPRET`` must be set
before any ``@triton.jit`` decoration happens, i.e. before the first test module imports the
kernels, whichever module that is.
"""

from __future__ import annotations

import importlib.util
import os


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
