"""Batch metadata the way FastDeploy's worker builds it, for tests, ``verify`` and benchmarks.

* :class:`BlockAllocator`: a free list of physical block ids ``[0, num_blocks)``.
* :class:`PagedKVState`: per-request block lists and cached-token counts;
  :meth:`PagedKVState.schedule` turns one step's ``(request id, new tokens)``
  list into a :class:`~fastdeploy_paddlefleet.backends.base.BatchMeta`.
* :func:`build_meta`: a ``BatchMeta`` from explicit lists (no allocator).
* :func:`allocate_kv_caches`: per-layer ``(key, value)`` caches in FastDeploy's
  layout ``[num_blocks, Hkv_l, block_size, D_l]``.

Not a scheduler: no preemption or prefix sharing, just enough to drive a
backend or a patched model step by step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from ..backends.base import BatchMeta, host_int
from ..plan.layer import AttentionPlan, LayerAttention

logger = logging.getLogger(__name__)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class BlockAllocator:
    """Free-list allocator of physical block ids ``[0, num_blocks)``.

    ``shuffle_seed`` shuffles the free list once so that a request's blocks are
    not contiguous (tests and benchmarks should not rely on contiguity).
    """

    def __init__(self, num_blocks: int, *, shuffle_seed: int | None = None):
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self._free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; ``ValueError`` (and nothing taken) when fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise ValueError(
                f"cannot allocate n={n} blocks: only {len(self._free)} of {self.num_blocks} free"
            )
        blocks, self._free = self._free[:n], self._free[n:]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return ``blocks`` to the free list; ``ValueError`` on a block that is not allocated."""
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free blocks={blocks}: not allocated (or repeated): {bad or blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)


def _int32(values: Any) -> Any:
    import numpy as np
    import paddle

    return paddle.to_tensor(np.asarray(values, dtype="int32"))


def _pad_table(rows: Sequence[Sequence[int]], width: int | None) -> Any:
    """Ragged rows -> int32 numpy ``[len(rows), width]`` padded with -1."""
    import numpy as np

    need = max((len(r) for r in rows), default=0)
    width = need if width is None else width
    if need > width:
        raise ValueError(f"a block table row has {need} entries, more than the table width {width}")
    out = np.full((len(rows), max(width, 1)), -1, dtype="int32")
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _as_table(table: Any, width: int | None) -> Any:
    """A paddle int32 table from a tensor / array (kept) or ragged lists (padded with -1)."""
    import paddle

    if isinstance(table, paddle.Tensor):
        return table.astype("int32")
    if hasattr(table, "ndim") and getattr(table, "ndim", 0) == 2:
        return _int32(table)
    return _int32(_pad_table(table, width))


def build_meta(
    seq_lens_decoder: Sequence[int],
    seq_lens_this_time: Sequence[int],
    block_tables: Any,
    block_size: int,
    *,
    is_prefill: Sequence[bool] | None = None,
    block_tables_headwise: Any = None,
    max_blocks_per_seq: int | None = None,
) -> BatchMeta:
    """A ``BatchMeta`` (paddle int32 tensors) from explicit per-request lists.

    * ``seq_lens_decoder[b]``: tokens of request ``b`` already cached
    * ``seq_lens_this_time[b]``: tokens this step (0: an idle slot)
    * ``block_tables``: ``[bsz, max_blocks]`` array or ragged lists (padded
      with -1 to ``max_blocks_per_seq`` or the longest row)
    * ``is_prefill[b]``: whether ``b`` runs a prefill chunk; default
      ``this_time > 1 or (this_time > 0 and decoder == 0)``; sets
      ``seq_lens_encoder[b] = this_time`` (else 0), as FastDeploy does
    * ``block_tables_headwise``: ``[bsz * Hkv, max_pages]`` page table, or a
      mapping ``layer index -> table``, or ``None`` (ragged lists padded with -1)
    """
    import numpy as np

    _positive_int("block_size", block_size)
    # each length an int (numpy ints pass): 1.7 or True refused by name, never truncated
    dec = [host_int(f"seq_lens_decoder[{b}]", x, -(2**31)) for b, x in enumerate(seq_lens_decoder)]
    this = [host_int(f"seq_lens_this_time[{b}]", x, -(2**31)) for b, x in enumerate(seq_lens_this_time)]
    if len(dec) != len(this):
        raise ValueError(f"seq_lens_decoder={dec} and seq_lens_this_time={this} differ in length")
    if any(x < 0 for x in dec + this):
        raise ValueError(f"sequence lengths must be >= 0, got decoder={dec}, this_time={this}")
    if is_prefill is None:
        is_prefill = [n > 1 or (n > 0 and d == 0) for d, n in zip(dec, this, strict=True)]
    elif len(is_prefill) != len(dec):
        raise ValueError(f"is_prefill={list(is_prefill)} must have length bsz={len(dec)}")
    encoder = [n if p else 0 for n, p in zip(this, is_prefill, strict=True)]
    cu = np.concatenate([[0], np.cumsum(this, dtype="int64")])
    batch_id = np.repeat(np.arange(len(this)), this)
    headwise = block_tables_headwise
    if isinstance(headwise, Mapping):
        headwise = {int(i): _as_table(t, None) for i, t in headwise.items()}
    elif headwise is not None:
        headwise = _as_table(headwise, None)
    active = [(d, n) for d, n in zip(dec, this, strict=True) if n > 0]
    return BatchMeta(
        seq_lens_encoder=_int32(encoder),
        seq_lens_decoder=_int32(dec),
        seq_lens_this_time=_int32(this),
        cu_seqlens_q=_int32(cu),
        batch_id_per_token=_int32(batch_id),
        block_tables=_as_table(block_tables, max_blocks_per_seq),
        block_size=block_size,
        block_tables_headwise=headwise,
        max_seq_len_this_time=max(this, default=0),
        max_context_len=max((d + n for d, n in active), default=0),
    )


def token_positions(meta: BatchMeta) -> Any:
    """Absolute position of each packed token ``[T]`` (paddle int64):
    ``seq_lens_decoder[b] + (t - cu_seqlens_q[b])`` for token ``t`` of request ``b``."""
    import numpy as np
    import paddle

    from ..backends.checks import to_numpy

    dec = to_numpy(meta.seq_lens_decoder).astype("int64")
    this = to_numpy(meta.seq_lens_this_time).astype("int64")
    cu = to_numpy(meta.cu_seqlens_q).astype("int64")
    bid = np.repeat(np.arange(this.shape[0]), this)
    pos = dec[bid] + np.arange(int(cu[-1])) - cu[bid]
    return paddle.to_tensor(pos.astype("int64"))


def check_steps(
    steps: Sequence[tuple[Hashable, int]],
    cached_tokens: Callable[[Hashable], int],
    block_size: int,
    max_blocks_per_seq: int,
) -> list[int]:
    """Validate one step's ``(request id, new tokens)`` list; return each request's block count after it.

    ``ValueError`` for a repeated id, a token count that is not an int >= 0, or a request that would
    need more than ``max_blocks_per_seq`` blocks.
    """
    ids = [rid for rid, _ in steps]
    if len(set(ids)) != len(ids):
        raise ValueError(f"steps repeat a request id: {ids}")
    totals = []
    for rid, n in steps:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"new tokens for request {rid!r} must be an int >= 0, got {n!r}")
        total = _ceil_div(cached_tokens(rid) + n, block_size)
        if total > max_blocks_per_seq:
            raise ValueError(
                f"request {rid!r} needs {total} blocks for {cached_tokens(rid) + n} tokens, "
                f"max_blocks_per_seq={max_blocks_per_seq}"
            )
        totals.append(total)
    return totals


class PagedKVState:
    """Per-request block lists and cached-token counts; builds one ``BatchMeta`` per step."""

    def __init__(
        self, num_blocks: int, block_size: int, max_blocks_per_seq: int, *, shuffle_seed: int | None = None
    ):
        self.block_size = _positive_int("block_size", block_size)
        self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        self.allocator = BlockAllocator(num_blocks, shuffle_seed=shuffle_seed)
        self._blocks: dict[Hashable, list[int]] = {}
        self._cached: dict[Hashable, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def blocks_used(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def requests(self) -> list[Hashable]:
        """Request ids holding blocks, in admission order."""
        return list(self._blocks)

    def cached_tokens(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` in the cache (0 for an unknown id)."""
        return self._cached.get(request_id, 0)

    def block_table(self, request_id: Hashable) -> list[int]:
        """The physical blocks of ``request_id`` in logical order (a copy)."""
        return list(self._blocks.get(request_id, []))

    def schedule(self, steps: Sequence[tuple[Hashable, int]]) -> BatchMeta:
        """Allocate blocks for one step and return its ``BatchMeta``.

        ``steps``: ``(request id, new tokens this step)`` in batch order; an
        unseen id starts with 0 cached tokens. All-or-nothing: on
        ``ValueError`` (too few free blocks, a row longer than
        ``max_blocks_per_seq``, a repeated id) no state changes.
        """
        ids = [rid for rid, _ in steps]
        totals = check_steps(steps, self.cached_tokens, self.block_size, self.max_blocks_per_seq)
        held = [len(self._blocks.get(rid, [])) for rid in ids]
        need = [max(0, total - h) for total, h in zip(totals, held, strict=True)]
        if sum(need) > self.allocator.num_free:
            raise ValueError(f"step needs {sum(need)} new blocks, only {self.allocator.num_free} free")
        new = self.allocator.allocate(sum(need))
        for (rid, _), m in zip(steps, need, strict=True):
            self._blocks.setdefault(rid, []).extend(new[:m])
            new = new[m:]
        dec = [self.cached_tokens(rid) for rid in ids]
        this = [n for _, n in steps]
        meta = build_meta(
            dec,
            this,
            [self._blocks[rid] for rid in ids],
            self.block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )
        for rid, n in steps:
            self._cached[rid] = self.cached_tokens(rid) + n
        return meta

    def positions(self, meta: BatchMeta) -> Any:
        """Absolute position of each packed token of ``meta`` ``[T]`` (paddle int64)."""
        return token_positions(meta)

    def release(self, request_id: Hashable) -> None:
        """Free every block of ``request_id``; ``ValueError`` for an unknown id."""
        if request_id not in self._blocks:
            raise ValueError(f"unknown request id {request_id!r}")
        self.allocator.free(self._blocks.pop(request_id))
        self._cached.pop(request_id, None)


def allocate_kv_caches(
    plan: AttentionPlan | Iterable[LayerAttention],
    num_blocks: int,
    block_size: int,
    dtype: str = "float32",
    fill: float | None = None,
    uniform: bool = False,
) -> list[tuple[Any, Any]]:
    """Per-layer ``(key [num_blocks, Hkv_l, block_size, Dqk_l], value [..., Dv_l])`` paddle caches.

    ``fill``: initial value (``None``: zeros; ``float('nan')`` in tests proves
    unwritten slots are never read). ``uniform=True`` allocates the way FastDeploy
    does, one shape ``[num_blocks, max Hkv, block_size, max head dim]`` for every
    layer's K and V, and returns each layer's strided views of it
    (``serving/cache_views.py``).
    """
    import paddle

    _positive_int("num_blocks", num_blocks)
    _positive_int("block_size", block_size)
    layers = plan.layers if isinstance(plan, AttentionPlan) else tuple(plan)
    value = 0.0 if fill is None else float(fill)
    if uniform:
        from ..serving.cache_views import layer_cache_views, uniform_cache

        shape = uniform_cache(layers)
        full = [num_blocks, shape.num_kv_heads, block_size, shape.head_dim]
        pairs = [
            (paddle.full(full, value, dtype=dtype), paddle.full(full, value, dtype=dtype)) for _ in layers
        ]
        return layer_cache_views(pairs, layers)  # layer.index is the layer's place in the plan
    caches = []
    for layer in layers:
        if not isinstance(layer, LayerAttention):
            raise TypeError(f"plan must hold LayerAttention objects, got {type(layer).__name__}")
        shape = [num_blocks, layer.num_kv_heads, block_size]
        key = paddle.full(shape + [layer.qk_head_dim], value, dtype=dtype)
        val = paddle.full(shape + [layer.v_head_dim], value, dtype=dtype)
        caches.append((key, val))
    return caches


def nan_code(quant: Any) -> int:
    """The byte a quantized cache reads as NaN: ``0x7F`` (e4m3fn) or ``0`` (int8, ``-128``)."""
    return 0x7F if quant.code == "fp8" else 0


def allocate_quantized_kv_caches(
    plan: AttentionPlan | Iterable[LayerAttention],
    num_blocks: int,
    block_size: int,
    quant: Any,
    dtype: str = "float32",
    static_scales: Mapping[int, tuple[Any, Any]] | None = None,
    fill_nan: bool = True,
) -> list[Any]:
    """Per-layer :class:`~fastdeploy_paddlefleet.backends.base.QuantizedKVCache` in FastDeploy's layout.

    ``quant``: a ``kv_cache_quant_type`` (a name or a ``kvcache.quant.KVCacheQuant``).
    Codes ``uint8 [num_blocks, Hkv_l, block_size, D_l]`` (K: ``qk_head_dim``, V: ``v_head_dim``);
    a dynamic format's scales ``[num_blocks, Hkv_l, block_size]`` in ``dtype`` (the model's);
    a static format's scales are ``static_scales[layer.index] = (key [S], value [S])`` dequant
    multipliers (``S`` = ``Hkv_l`` or, per channel, ``Hkv_l * D_l``), with their quant multipliers
    where the mapping has ``quant_multipliers(index)`` (``serving.kv_scales.StaticKVScales``):
    ``ValueError`` naming the layer when absent or misshapen. ``fill_nan``: every code (and dynamic
    scale) starts as NaN, so a read of a never-written slot shows as a NaN logit; else codes 0 and
    scales 0 (reads as zeros).
    """
    import paddle

    from ..backends.base import QuantizedKVCache
    from ..kvcache.quant import KVCacheQuant, kv_cache_quant

    fmt = quant if isinstance(quant, KVCacheQuant) else kv_cache_quant(quant)
    if fmt is None:
        raise ValueError(f"quant={quant!r} is no quantized format (use allocate_kv_caches)")
    _positive_int("num_blocks", num_blocks)
    _positive_int("block_size", block_size)
    layers = plan.layers if isinstance(plan, AttentionPlan) else tuple(plan)
    code = nan_code(fmt) if fill_nan else 0
    out = []
    for layer in layers:
        if not isinstance(layer, LayerAttention):
            raise TypeError(f"plan must hold LayerAttention objects, got {type(layer).__name__}")
        shape = [num_blocks, layer.num_kv_heads, block_size]
        key = paddle.full(shape + [layer.qk_head_dim], code, dtype="uint8")
        val = paddle.full(shape + [layer.v_head_dim], code, dtype="uint8")
        mult: tuple[Any, Any] = (None, None)
        if fmt.dynamic:
            fill = float("nan") if fill_nan else 0.0
            k_scale, v_scale = (paddle.full(shape, fill, dtype=dtype) for _ in range(2))
        else:
            pair = (static_scales or {}).get(layer.index)
            if pair is None:
                raise ValueError(f"layer {layer.index}: kv_cache_quant_type={fmt.name!r} needs static scales")
            for what, sc, dim in (("key", pair[0], layer.qk_head_dim), ("value", pair[1], layer.v_head_dim)):
                want = [layer.num_kv_heads * dim] if fmt.channel_wise else [layer.num_kv_heads]
                if [int(s) for s in sc.shape] != want:
                    raise ValueError(
                        f"layer {layer.index}: {what} scales have shape {list(sc.shape)}, "
                        f"{fmt.name} needs {want}"
                    )
            k_scale, v_scale = pair
            # FastDeploy's own quant multipliers (cache_k_scale) where the scales carry them
            # (serving.kv_scales.StaticKVScales): the write multiplies by them, not by 1 / dequant
            mults = getattr(static_scales, "quant_multipliers", None)
            mult = (mults(layer.index) if mults is not None else None) or mult
        out.append(QuantizedKVCache(key, val, k_scale, v_scale, fmt, *mult))
    return out
