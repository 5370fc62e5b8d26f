"""Cheap device detection without importing heavy frameworks eagerly."""

from __future__ import annotations

import importlib.util


def cuda_available() -> bool:
    """True when torch or paddle is installed and sees a CUDA GPU."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return True
    if importlib.util.find_spec("paddle") is not None:
        import paddle

        return bool(paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0)
    return False
