"""KV cache: FastDeploy-layout shapes and capacity planning (``layout``, stdlib only).

Heavier parts (the head-wise block manager) live in their own modules and are
imported explicitly, so ``import fastdeploy_paddlefleet.kvcache`` stays light.
"""

from .layout import KVBudget, cache_shapes, dtype_bytes, kv_budget

__all__ = ["KVBudget", "cache_shapes", "dtype_bytes", "kv_budget"]
