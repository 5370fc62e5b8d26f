"""How the worker sizes each layer's KV cache (stdlib only: no FastDeploy, no paddle).

FastDeploy (c1b7c083d) allocates ONE shape for every layer and prices a block with
``cal_theortical_kvcache`` = ``2 bytes * 2 * block_size * head_dim * kv_heads * layers``. For a
PaddleFleet model the plugin instead gives layer ``l``

* key   ``[num_blocks_l, Hkv_l, block_size, qk_head_dim_l]``
* value ``[num_blocks_l, Hkv_l, block_size, v_head_dim_l]``

in the cache dtype (``model_config.dtype``), where ``num_blocks_l`` is FastDeploy's
``num_gpu_blocks`` for every layer, or, with window recycling, the pool of the layer's group from
``kvcache/pools.py: split_kv_pools`` (the one split function the engine's scheduler hook calls
too). The price of one block, :func:`block_bytes`, is the sum of the layers' real block sizes, so
``num_gpu_blocks = available_memory // block_bytes`` and ``num_gpu_blocks * block_bytes`` is the
KV budget both sides split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...kvcache.layout import cache_shapes, dtype_bytes, layer_bytes_per_token
from ...plan.layer import LayerAttention

Shape = tuple[int, int, int, int]


def block_bytes(layers: Sequence[LayerAttention], block_size: int, dtype: Any) -> int:
    """Bytes of one block over every layer (K + V, all kv heads of this rank):
    ``block_size * sum_l Hkv_l * (qk_head_dim_l + v_head_dim_l) * dtype_bytes``."""
    return int(block_size) * sum(layer_bytes_per_token(layer, dtype) for layer in layers)


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache: ``key_shape`` / ``value_shape`` are ``[blocks, Hkv, block_size, D]``."""

    index: int
    group: int | None
    num_blocks: int
    key_shape: Shape
    value_shape: Shape


@dataclass(frozen=True)
class WorkerCaches:
    """Every layer's cache shape on this rank (``group`` is None without recycling)."""

    block_size: int
    dtype: str
    layers: tuple[LayerCache, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V cache."""
        elements = sum(math.prod(c.key_shape) + math.prod(c.value_shape) for c in self.layers)
        return elements * dtype_bytes(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "layers": [
                {
                    "index": c.index,
                    "group": c.group,
                    "num_blocks": c.num_blocks,
                    "key_shape": list(c.key_shape),
                    "value_shape": list(c.value_shape),
                }
                for c in self.layers
            ],
        }


def worker_caches(
    layers: Sequence[LayerAttention],
    block_size: int,
    dtype: Any,
    num_gpu_blocks: int,
    group_blocks: dict[int, int] | None = None,
    layer_group: dict[int, int] | None = None,
) -> WorkerCaches:
    """Each layer's cache: ``num_gpu_blocks`` blocks, or its group's ``group_blocks[g]`` where
    ``layer_group`` (``{layer index: group}``) places it. ``ValueError`` names a layer with no group."""
    out = []
    for layer in layers:
        group = None
        blocks = num_gpu_blocks
        if group_blocks is not None:
            if layer_group is None or layer.index not in layer_group:
                raise ValueError(f"layer {layer.index} belongs to no layer group of the recycling layout")
            group = layer_group[layer.index]
            blocks = group_blocks[group]
        key, value = cache_shapes(layer, int(blocks), int(block_size))
        out.append(LayerCache(layer.index, group, int(blocks), key, value))
    return WorkerCaches(int(block_size), str(dtype), tuple(out))


def check_layout_matches(layers: Sequence[LayerAttention], layout: Any) -> None:
    """Every layer of this rank's plan sits in one group of ``layout`` with the same kv head count
    (the engine's tables have ``Hkv`` rows per request for head-wise groups): ``ValueError`` otherwise."""
    groups = {li: g for g in layout.groups for li in g.layers}
    for layer in layers:
        g = groups.get(layer.index)
        if g is None:
            raise ValueError(f"layer {layer.index} is in no group of the recycling layout {layout.layout_id}")
        if g.num_kv_heads != layer.num_kv_heads:
            raise ValueError(
                f"layer {layer.index} has {layer.num_kv_heads} kv heads on this rank, its recycling group "
                f"{g.index} has {g.num_kv_heads}"
            )


__all__ = ["LayerCache", "WorkerCaches", "block_bytes", "check_layout_matches", "worker_caches"]
