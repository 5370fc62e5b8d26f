"""Convert downloaded checkpoints into ones the plugin serves: ``fdfleet convert dequantize``.

The plugin refuses weight quantization (``serving.checks``): gpt-oss ships MXFP4 expert weights and
DeepSeek-V3 block-FP8 weights, both with a ``quantization_config`` in ``config.json``. ::

    fdfleet convert dequantize SRC DST [--dtype bf16|fp32] [--force] [--json]
    python -m fastdeploy_paddlefleet.convert dequantize SRC DST ...    # the same command

writes a bfloat16 copy (:func:`dequantize_checkpoint`): the quantized tensors decoded
(``formats``), every other tensor and file copied unchanged, ``config.json`` without its
``quantization_config``, the index rewritten; shard by shard, one tensor slice at a time, all or
nothing. Formats, rules and their sources, the memory bound: ``docs/convert.md``.

Importing this package imports nothing heavy; numpy and safetensors are imported by the command.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "dequantize_checkpoint": ".dequantize",
    "plan_dequantize": ".dequantize",
    "ConvertReport": ".dequantize",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
