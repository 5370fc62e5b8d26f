"""KV cache shapes in FastDeploy's layout and capacity planning (stdlib only).

Per layer ``l`` (heads and dims are per layer and per TP rank, from the plan):

* key   ``[num_blocks, kv_heads_l, block_size, qk_head_dim_l]``
* value ``[num_blocks, kv_heads_l, block_size, v_head_dim_l]``

One block id addresses the same slot range in every layer's cache, so a block
costs ``block_size * bytes_per_token`` summed over all layers. MLA layers
cache what core attention sees (one kv head per query head, q/k head and v
head dims), not the compressed latent.

Recycling model (head-wise pages, ``FDFLEET_HEADWISE_KV``): a page is one
block of one kv head of one layer. A full-attention head keeps every page of
the request: ``ceil(C / block_size)``. A sliding head with ``window_left = w``
needs only the pages that still hold a position visible to the newest token,
i.e. pages overlapping ``[C - 1 - w, C - 1]``; over every alignment of that
span to block boundaries the worst case is ``ceil(w / block_size) + 1`` pages,
capped by the request's own ``ceil(C / block_size)``. Older pages are released.

Quantized caches (FastDeploy's ``kv_cache_quant_type``, ``kvcache/quant.py``): every element is one
byte (``uint8`` codes) and a dynamic format (``block_wise_fp8``) also stores one K and one V
dequant scale per token and kv head in the model dtype (``[num_blocks, kv_heads, block_size]``):
a token of a layer costs ``Hkv * (qk + v) + 2 * Hkv * dtype_bytes`` bytes. ``dtype`` is then the
model dtype (the scales'). A static format's scales (``[kv_heads]`` / ``[kv_heads * head_dim]``
per layer, from the checkpoint) do not grow with the cache and are not counted per block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..plan.layer import AttentionPlan, LayerAttention
from .quant import KVCacheQuant, kv_cache_quant

GIB = 1 << 30

DTYPE_BYTES: dict[str, int] = {
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
    "fp32": 4,
    "float32": 4,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a cache dtype name (``bf16``, ``fp8``, ``torch.float16``, ...)."""
    name = str(dtype).strip().lower().rsplit(".", 1)[-1]
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]
    if name.startswith("float8"):
        return 1
    raise ValueError(f"unknown cache dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)} or float8_*")


#: model dtypes a quantized cache's scales may take (their bytes are the model dtype's)
SCALE_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def cache_quant(quant: Any) -> KVCacheQuant | None:
    """``quant`` as a :class:`~.quant.KVCacheQuant` (a format, FastDeploy's name, or ``None`` /
    ``"none"`` for an unquantized cache); refused and unknown names raise ``ValueError`` naming them."""
    if quant is None or isinstance(quant, KVCacheQuant):
        return quant
    return kv_cache_quant(quant)


def cache_bytes(elements: int, token_heads: int, dtype: Any, quant: Any = None) -> int:
    """Bytes of a cache span holding ``elements`` K + V elements for ``token_heads`` (token, kv
    head) pairs: ``elements * dtype_bytes(dtype)`` unquantized; quantized, one byte per element plus,
    for a dynamic format, a K and a V scale per token-head in ``dtype`` (the model dtype):
    ``elements + 2 * token_heads * dtype_bytes(dtype)``. ``ValueError`` names a ``dtype`` that
    cannot hold a quantized cache's scales (``fp8``, ``int8``: the model dtype is meant)."""
    fmt = cache_quant(quant)
    if fmt is None:
        return int(elements) * dtype_bytes(dtype)
    name = str(dtype).strip().lower().rsplit(".", 1)[-1]
    if name not in SCALE_DTYPES:
        raise ValueError(
            f"dtype={dtype!r} with kv_cache_quant_type={fmt.name!r}: the dtype is the model's (its "
            f"scales' dtype), one of {', '.join(SCALE_DTYPES)}; the codes are one byte each"
        )
    return int(elements) + (2 * int(token_heads) * dtype_bytes(dtype) if fmt.dynamic else 0)


#: sizes (tokens, block sizes) are int32 on the device
MAX_INT = 2**31 - 1
#: KV memory per rank at most (1 PiB): far above any device, low enough for exact byte counts
MAX_MEMORY_GIB = 2**20


def _count(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise ValueError(f"{name} must be an integer in [{minimum}, {MAX_INT}], got {value!r}")
    return value


def cache_shapes(
    layer: LayerAttention, num_blocks: int, block_size: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """``(key_shape, value_shape)`` of ``layer``'s cache:
    ``[num_blocks, kv_heads, block_size, qk_head_dim]`` and ``[..., v_head_dim]``."""
    nb = _count(num_blocks, "num_blocks", 0)
    bs = _count(block_size, "block_size")
    return (
        (nb, layer.num_kv_heads, bs, layer.qk_head_dim),
        (nb, layer.num_kv_heads, bs, layer.v_head_dim),
    )


def layer_bytes_per_token(layer: LayerAttention, dtype: Any, quant: Any = None) -> int:
    """K + V bytes one token takes in ``layer`` (all its kv heads on this rank): unquantized
    ``Hkv * (qk + v) * dtype_bytes``; quantized (``quant``, a ``kv_cache_quant_type``)
    ``Hkv * (qk + v)`` code bytes plus, dynamic, ``2 * Hkv * dtype_bytes`` of scales."""
    return cache_bytes(
        layer.num_kv_heads * (layer.qk_head_dim + layer.v_head_dim), layer.num_kv_heads, dtype, quant
    )


def blocks_for(context: int, block_size: int) -> int:
    """Blocks holding ``context`` tokens: ``ceil(context / block_size)``."""
    return -(-_count(context, "context") // _count(block_size, "block_size"))


def window_blocks(window_left: int, context: int, block_size: int) -> int:
    """Pages a sliding head keeps at context ``context`` with recycling (worst case
    over alignment): ``min(ceil(C / bs), ceil(window_left / bs) + 1)``."""
    w = _count(window_left, "window_left", 0)
    return min(blocks_for(context, block_size), -(-w // block_size) + 1)


def layer_request_pages(layer: LayerAttention, context: int, block_size: int, recycle: bool) -> int:
    """Pages (block x kv head) one request holds in ``layer`` at ``context`` tokens."""
    full = blocks_for(context, block_size)
    if not recycle or layer.sliding_kv_heads is None or layer.window_left is None:
        return layer.num_kv_heads * full
    start, stop = layer.sliding_kv_heads
    n_slide = stop - start
    return (layer.num_kv_heads - n_slide) * full + n_slide * window_blocks(
        layer.window_left, context, block_size
    )


@dataclass(frozen=True)
class KVBudget:
    """KV cache budget of one TP rank (all sizes in bytes, counts are whole requests/blocks).

    ``max_requests_recycled`` sizes each layer's cache to its demand;
    ``max_requests_recycled_equal_pools`` keeps FastDeploy's equal ``num_blocks``
    per layer, where the layer that recycles least decides. ``kv_cache_quant``: FastDeploy's
    ``kv_cache_quant_type`` (``None``: unquantized, ``dtype`` the cache's); quantized, ``dtype``
    is the model's (the scales') and every byte count includes the codes and the scales.
    """

    dtype: str
    dtype_bytes: int
    block_size: int
    memory_gib: float
    context: int
    tp_size: int
    tp_rank: int
    bytes_per_token_per_layer: tuple[int, ...]
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    bytes_per_request: int
    bytes_per_request_recycled: int
    max_requests: int
    max_requests_recycled: int
    max_requests_recycled_equal_pools: int
    kv_cache_quant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes_per_token_per_layer"] = list(self.bytes_per_token_per_layer)
        return d


def kv_budget(
    plan: AttentionPlan,
    block_size: int = 64,
    dtype: Any = "bf16",
    memory_gib: float = 40.0,
    context: int = 8192,
    kv_cache_quant: Any = None,
) -> KVBudget:
    """Capacity of ``memory_gib`` GiB of KV cache for ``plan`` at ``context`` tokens per request;
    ``kv_cache_quant``: FastDeploy's ``kv_cache_quant_type`` (codes and scales counted)."""
    bs = _count(block_size, "block_size")
    ctx = _count(context, "context")
    if isinstance(memory_gib, bool) or not isinstance(memory_gib, int | float):
        raise ValueError(f"memory_gib must be a positive number, got {memory_gib!r}")
    if not 0 < memory_gib <= MAX_MEMORY_GIB:
        raise ValueError(f"memory_gib must be a number in (0, {MAX_MEMORY_GIB}] GiB, got {memory_gib!r}")
    if len(plan) == 0:
        raise ValueError("plan has no layers")
    nbytes = dtype_bytes(dtype)
    quant = cache_quant(kv_cache_quant)
    memory = int(memory_gib * GIB)

    per_layer = tuple(layer_bytes_per_token(layer, dtype, quant) for layer in plan)
    per_token = sum(per_layer)
    per_block = per_token * bs
    num_blocks = memory // per_block
    req_blocks = blocks_for(ctx, bs)

    recycled = 0
    equal_pools = None
    for layer in plan:
        pages = layer_request_pages(layer, ctx, bs, recycle=True)
        # a page is one block of one kv head: bs tokens x (qk + v) elements, bs token-heads of scales
        recycled += cache_bytes(pages * bs * (layer.qk_head_dim + layer.v_head_dim), pages * bs, dtype, quant)
        fits = num_blocks * layer.num_kv_heads // pages
        equal_pools = fits if equal_pools is None else min(equal_pools, fits)

    return KVBudget(
        dtype=str(dtype),
        dtype_bytes=nbytes,
        block_size=bs,
        memory_gib=float(memory_gib),
        context=ctx,
        tp_size=plan.tp_size,
        tp_rank=plan.tp_rank,
        bytes_per_token_per_layer=per_layer,
        bytes_per_token=per_token,
        bytes_per_block=per_block,
        num_blocks=num_blocks,
        blocks_per_request=req_blocks,
        bytes_per_request=req_blocks * per_block,
        bytes_per_request_recycled=recycled,
        max_requests=num_blocks // req_blocks,
        max_requests_recycled=memory // recycled,
        max_requests_recycled_equal_pools=int(equal_pools or 0),
        kv_cache_quant=None if quant is None else quant.name,
    )


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human string (``1.50 MiB``)."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.2f} {unit}"


__all__ = [
    "DTYPE_BYTES",
    "KVBudget",
    "SCALE_DTYPES",
    "blocks_for",
    "cache_bytes",
    "cache_quant",
    "cache_shapes",
    "dtype_bytes",
    "format_bytes",
    "kv_budget",
    "layer_bytes_per_token",
    "layer_request_pages",
    "window_blocks",
]
