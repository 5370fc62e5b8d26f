"""How the worker sizes each layer's KV cache (stdlib only: no FastDeploy, no paddle).

FastDeploy (c1b7c083d) allocates ONE shape for every layer and prices a block with
``cal_theortical_kvcache`` = ``2 bytes * 2 * block_size * head_dim * kv_heads * layers``. For a
PaddleFleet model the plugin instead gives layer ``l``

* key   ``[num_blocks_l, Hkv_l, block_size, qk_head_dim_l]``
* value ``[num_blocks_l, Hkv_l, block_size, v_head_dim_l]``

in the cache dtype (``model_config.dtype``), where ``num_blocks_l`` is FastDeploy's
``num_gpu_blocks`` for every layer. The price of one block, :func:`block_bytes`, is the sum of the
layers' real block sizes, so ``num_gpu_blocks = available_memory // block_bytes``.

With window recycling the caches are the ONE pool of ``kvcache/pools.py`` instead
(:func:`pool_caches`): ``slots`` key and value tensors ``[rows, G, block_size, D]`` whose rows
(pages) any group can take, each layer a view of its slot, ``layout.num_pages(num_gpu_blocks)``
pages managed by the engine's hook as by this worker; one FastDeploy block is priced at
:func:`pool_block_bytes` (the per-layer sum unless head dims differ between layers).

Quantized caches (``quant``, FastDeploy's ``kv_cache_quant_type``): the codes are ``uint8`` in the
same shapes and a dynamic format (``block_wise_fp8``) adds a key and a value scale tensor per layer
``[num_blocks_l, Hkv_l, block_size]`` (per slot ``[rows, G, block_size]``) in the model dtype;
every price and byte count includes them (FastDeploy's own ``cal_theortical_kvcache`` counts one
byte per element and no scales).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...kvcache.layout import cache_bytes, cache_quant, cache_shapes, layer_bytes_per_token
from ...plan.layer import LayerAttention

Shape = tuple[int, int, int, int]
ScaleShape = tuple[int, int, int]


def block_bytes(layers: Sequence[LayerAttention], block_size: int, dtype: Any, quant: Any = None) -> int:
    """Bytes of one block over every layer (K + V, all kv heads of this rank):
    ``block_size * sum_l Hkv_l * (qk_head_dim_l + v_head_dim_l) * dtype_bytes``; quantized, one byte
    per element plus a dynamic format's ``2 * Hkv_l`` scales per token in ``dtype``."""
    return int(block_size) * sum(layer_bytes_per_token(layer, dtype, quant) for layer in layers)


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache: ``key_shape`` / ``value_shape`` are ``[blocks, Hkv, block_size, D]``;
    ``scale_shape`` ``[blocks, Hkv, block_size]`` for each of a dynamic quantized cache's key and
    value scales (``None`` otherwise)."""

    index: int
    num_blocks: int
    key_shape: Shape
    value_shape: Shape
    scale_shape: ScaleShape | None = None


@dataclass(frozen=True)
class WorkerCaches:
    """Every layer's cache shape on this rank (no recycling). ``quant``: the
    ``kv_cache_quant_type`` (codes ``uint8``, ``dtype`` the scales'); ``None``: ``dtype`` caches."""

    block_size: int
    dtype: str
    layers: tuple[LayerCache, ...]
    quant: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V cache (codes and scales when quantized)."""
        elements = sum(math.prod(c.key_shape) + math.prod(c.value_shape) for c in self.layers)
        token_heads = sum(math.prod(c.key_shape[:3]) for c in self.layers)
        return cache_bytes(elements, token_heads, self.dtype, self.quant)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "dtype": self.dtype,
            "quant": self.quant,
            "nbytes": self.nbytes,
            "layers": [
                {
                    "index": c.index,
                    "num_blocks": c.num_blocks,
                    "key_shape": list(c.key_shape),
                    "value_shape": list(c.value_shape),
                }
                for c in self.layers
            ],
        }


def worker_caches(
    layers: Sequence[LayerAttention], block_size: int, dtype: Any, num_gpu_blocks: int, quant: Any = None
) -> WorkerCaches:
    """Each layer's own cache of ``num_gpu_blocks`` blocks (no recycling, or the profile run)."""
    fmt = cache_quant(quant)
    out = []
    for layer in layers:
        key, value = cache_shapes(layer, int(num_gpu_blocks), int(block_size))
        scales = key[:3] if fmt is not None and fmt.dynamic else None
        out.append(LayerCache(layer.index, int(num_gpu_blocks), key, value, scales))
    return WorkerCaches(int(block_size), str(dtype), tuple(out), None if fmt is None else fmt.name)


@dataclass(frozen=True)
class LayerView:
    """One layer's key / value view of its slot: ``[rows * G / Hkv, Hkv, block_size, D]`` of the
    slot's ``[rows, G, block_size, D_slot]`` (a reshape), the leading ``D`` channels."""

    index: int
    group: int
    slot: int
    key_shape: Shape
    value_shape: Shape

    @property
    def scale_shape(self) -> ScaleShape:
        """The view ``[rows * G / Hkv, Hkv, block_size]`` of its slot's scales (dynamic quant)."""
        return self.key_shape[:3]


@dataclass(frozen=True)
class PoolCaches:
    """The one pool on this rank (``kvcache/pools.py``): ``slots`` key tensors ``key_shape`` and
    value tensors ``value_shape`` (``[rows, G, block_size, D]``), and each layer's view.
    ``num_pages`` pages are managed (the engine's count), ``rows >= num_pages`` allocated.
    Quantized (``quant``): the codes are ``uint8`` and a dynamic format adds per slot a key and a
    value scale tensor ``scale_shape`` ``[rows, G, block_size]`` in ``dtype``."""

    block_size: int
    dtype: str
    num_pages: int
    rows: int
    slots: int
    key_shape: Shape
    value_shape: Shape
    layers: tuple[LayerView, ...]
    quant: str | None = None

    @property
    def scale_shape(self) -> ScaleShape | None:
        fmt = cache_quant(self.quant)
        return self.key_shape[:3] if fmt is not None and fmt.dynamic else None

    @property
    def nbytes(self) -> int:
        elements = self.slots * (math.prod(self.key_shape) + math.prod(self.value_shape))
        return cache_bytes(elements, self.slots * math.prod(self.key_shape[:3]), self.dtype, self.quant)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "dtype": self.dtype,
            "quant": self.quant,
            "num_pages": self.num_pages,
            "rows": self.rows,
            "slots": self.slots,
            "key_shape": list(self.key_shape),
            "value_shape": list(self.value_shape),
            "nbytes": self.nbytes,
            "layers": [
                {"index": v.index, "group": v.group, "slot": v.slot, "key_shape": list(v.key_shape),
                 "value_shape": list(v.value_shape)}
                for v in self.layers
            ],
        }  # fmt: skip


def slot_dims(layers: Sequence[LayerAttention]) -> tuple[int, int]:
    """The slots' ``(qk_head_dim, v_head_dim)``: the largest over this rank's layers."""
    return max(la.qk_head_dim for la in layers), max(la.v_head_dim for la in layers)


def pool_block_bytes(pool: Any, layers: Sequence[LayerAttention], dtype: Any, quant: Any = None) -> int:
    """What one FastDeploy block costs in the pool on this rank: ``pages_per_block`` pages of
    ``slots * G * block_size * (qk + v)`` elements (the slots' dims: this rank's largest), plus a
    dynamic quantized cache's ``2 * slots * G * block_size`` scales per page."""
    dk, dv = slot_dims(layers)
    token_heads = pool.slots * pool.heads_per_page * pool.block_size
    page = cache_bytes(token_heads * (dk + dv), token_heads, dtype, quant)
    return pool.pages_per_block * page


def pool_caches(
    pool: Any, layers: Sequence[LayerAttention], num_pages: int, dtype: Any, quant: Any = None
) -> PoolCaches:
    """The slot tensors and each layer's view for ``num_pages`` pages of ``pool``
    (:class:`~...kvcache.pools.PoolLayout`); ``ValueError`` names a layer the layout does not place."""
    check_layout_matches(layers, pool)
    dk, dv = slot_dims(layers)
    g, bs = pool.heads_per_page, pool.block_size
    rows = pool.alloc_pages(int(num_pages))
    where = pool.layer_slots()
    views = []
    for la in layers:
        group, slot = where[la.index]
        n = rows * g // la.num_kv_heads
        views.append(
            LayerView(
                la.index,
                group,
                slot,
                (n, la.num_kv_heads, bs, la.qk_head_dim),
                (n, la.num_kv_heads, bs, la.v_head_dim),
            )
        )
    fmt = cache_quant(quant)
    return PoolCaches(
        bs,
        str(dtype),
        int(num_pages),
        rows,
        pool.slots,
        (rows, g, bs, dk),
        (rows, g, bs, dv),
        tuple(views),
        None if fmt is None else fmt.name,
    )


def check_layout_matches(layers: Sequence[LayerAttention], layout: Any) -> None:
    """Every layer of this rank's plan sits in one group of ``layout`` with the same kv head count
    (the engine's tables have ``Hkv`` rows per request for head-wise groups): ``ValueError`` otherwise."""
    groups = {li: g for g in layout.groups for li in g.layers}
    for layer in layers:
        g = groups.get(layer.index)
        if g is None:
            raise ValueError(
                f"layer {layer.index} is in no group of the recycling layout "
                f"{getattr(layout, 'layout_id', '')}"
            )
        if g.num_kv_heads != layer.num_kv_heads:
            raise ValueError(
                f"layer {layer.index} has {layer.num_kv_heads} kv heads on this rank, its recycling group "
                f"{g.index} has {g.num_kv_heads}"
            )


__all__ = [
    "LayerCache",
    "LayerView",
    "PoolCaches",
    "WorkerCaches",
    "block_bytes",
    "check_layout_matches",
    "pool_block_bytes",
    "pool_caches",
    "slot_dims",
    "worker_caches",
]
