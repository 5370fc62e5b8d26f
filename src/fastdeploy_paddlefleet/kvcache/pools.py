"""ONE KV pool for every layer group and lane, and the arithmetic every side calls (stdlib only).

The engine's scheduler hook (``serving/kv_recycling``), the worker's cache allocation
(``serving/model_runner``) and ``fdfleet plan`` all build :func:`pool_layout` from the same plan and
count with :meth:`PoolLayout.num_pages` and :func:`capacity`; nothing else sizes the pool.

Why one pool
------------
A split fixed in advance (so many blocks for full layers, so many for sliding ones) is sized for
one request length. Chat traffic is mostly short, and short requests would then find the full
pool empty while the sliding pool idles (or the reverse): fewer requests than FastDeploy's own
single pool serves. Here every page of KV memory can serve any group, request by request: what a
window releases is at once free for anyone, and a request holds exactly what its lanes hold.

Layout (vLLM's hybrid cache, in FastDeploy's cache shape)
---------------------------------------------------------
* Layers sharing kv heads and per-head windows form *kind groups* (``headwise.groups_from_plan``).
  Each kind group is cut into *groups* of ``slots = T`` consecutive layers, ``T`` the greatest
  common divisor of the kind groups' layer counts: every group then has the same number of layers,
  and layer ``t`` of every group reads *slot* ``t``.
* Slot ``t`` is one key tensor ``[num_pages, G, block_size, qk_head_dim]`` and one value tensor
  ``[num_pages, G, block_size, v_head_dim]`` (the largest dims over the layers), ``G =
  heads_per_page`` the greatest common divisor of the kind groups' kv heads per lane (a whole-block
  group's ``Hkv``, 1 where a layer mixes full and sliding heads). A *page* ``p`` is row ``p`` of
  every slot: it holds ``G`` kv heads of ``block_size`` tokens of ``T`` layers.
* A group's layer views its slot as ``[num_pages * G / Hkv, Hkv, block_size, D]`` (contiguous, a
  reshape; only a layer with a smaller head dim than the slot's reads the leading channels).
  A *lane* (the unit released at once: a whole-block group's ``Hkv / G`` lanes share one window, a
  head-wise group has one lane per kv head) takes ONE page per logical block, from the one free list.
  Its table entries are ``page * G + head % G`` in the layer's view (``HeadwiseKVManager.tables``);
  with ``G == Hkv`` they are plain block ids.
* FastDeploy prices a block at every layer's own shape; one such block is ``pages_per_block``
  pages (one per lane), so ``num_gpu_blocks`` FastDeploy blocks are ``num_gpu_blocks *
  pages_per_block`` pages in the same bytes, exactly, unless layers differ in head dims (then the
  pages' padding is priced: :meth:`PoolLayout.block_bytes`).

Quantized caches
----------------
With FastDeploy's ``kv_cache_quant_type`` a page's codes are one byte per element and a dynamic
format (``block_wise_fp8``) adds a K and a V scale per token and kv head in the model dtype: page
bytes = ``page_elements + 2 * page_token_heads * dtype_bytes`` (:meth:`PoolLayout.page_bytes`
with ``quant``). Each slot then also has a key and a value scale tensor ``[num_pages, G,
block_size]`` beside its codes. FastDeploy's own price of a block (``cal_theortical_kvcache``: one
byte per element, scales NOT counted, :func:`fastdeploy_claimed_block_bytes`) under-counts what it
allocates for ``block_wise_fp8``; :meth:`PoolLayout.layer_block_bytes` is the honest price of
FastDeploy's allocation, the one recycling is compared with.

Capacity
--------
A request at ``c`` tokens with ``n`` allocated holds, per lane, the blocks of ``[0, n)`` (full) or
of ``[c - window_left, n)`` (sliding; ``headwise.held_units``). FastDeploy holds ``ceil(n / bs)``
blocks of every layer. Per lane ours is never more, so at the same bytes recycling never serves
fewer requests than FastDeploy's accounting, at any length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..plan.layer import AttentionPlan
from .headwise import RECYCLE_MODES, LayerGroup, RecycleMode, groups_from_plan, held_units
from .layout import cache_bytes, cache_quant, dtype_bytes

#: tokens FastDeploy allocates beyond the computed ones for a decoding request: 2 blocks
#: (``enc_dec_block_num``) once 12 or fewer slots are left (``prealloc_dec_block_slot_num_threshold``)
FASTDEPLOY_LOOKAHEAD_BLOCKS = 2
FASTDEPLOY_LOOKAHEAD_SLOTS = 12


def fastdeploy_lookahead(block_size: int) -> int:
    """Tokens FastDeploy allocates at most beyond a decoding request's computed ones."""
    return FASTDEPLOY_LOOKAHEAD_BLOCKS * _int("block_size", block_size, 1) + FASTDEPLOY_LOOKAHEAD_SLOTS


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an int >= {low}")
    return value


@dataclass(frozen=True)
class PoolLayout:
    """Groups, lanes and slots of the one pool (module docstring). Pure data; counts in pages.

    ``layer_elements``: elements (K + V) one FastDeploy block holds at every layer's own shape,
    ``sum_l Hkv_l * (qk_l + v_l) * block_size`` (FastDeploy's accounting, the runner's price
    basis).
    """

    block_size: int
    mode: str
    heads_per_page: int
    slots: int
    qk_head_dim: int
    v_head_dim: int
    groups: tuple[LayerGroup, ...]
    layer_elements: int

    @property
    def page_elements(self) -> int:
        """Elements of one page over every slot, K and V."""
        return self.slots * self.heads_per_page * self.block_size * (self.qk_head_dim + self.v_head_dim)

    @property
    def pages_per_block(self) -> int:
        """Pages one FastDeploy block of every layer stands for: one per lane of every group."""
        return sum(len(g.lanes) for g in self.groups)

    @property
    def padding(self) -> float:
        """Share of the pool's bytes no layer reads (head dims padded to the slot's; 0 when alike)."""
        total = self.pages_per_block * self.page_elements
        return 1.0 - self.layer_elements / total

    @property
    def page_multiple(self) -> int:
        """The slot tensors' page count must be a multiple of this (each layer's reshaped view
        ``[pages * G / Hkv, Hkv, ...]``)."""
        out = 1
        for g in self.groups:
            out = math.lcm(out, g.num_kv_heads // self.heads_per_page)
        return out

    @property
    def page_token_heads(self) -> int:
        """(token, kv head) pairs one page holds over every slot: each has a K and a V scale in a
        dynamic quantized cache."""
        return self.slots * self.heads_per_page * self.block_size

    @property
    def layer_token_heads(self) -> int:
        """(token, kv head) pairs one FastDeploy block holds over every layer at its own shape,
        ``block_size * sum_l Hkv_l``."""
        return self.block_size * sum(g.num_kv_heads * len(g.layers) for g in self.groups)

    def page_bytes(self, dtype: Any, quant: Any = None) -> int:
        """Bytes of one page: ``page_elements`` in ``dtype``, or quantized (``quant``, a
        ``kv_cache_quant_type``) one byte each plus a dynamic format's scales in ``dtype``."""
        return cache_bytes(self.page_elements, self.page_token_heads, dtype, quant)

    def block_bytes(self, dtype: Any, quant: Any = None) -> int:
        """What one FastDeploy block costs in this pool: ``pages_per_block`` pages (the runner's
        ``cal_theortical_kvcache``). Equals :meth:`layer_block_bytes` when nothing is padded."""
        return self.pages_per_block * self.page_bytes(dtype, quant)

    def layer_block_bytes(self, dtype: Any, quant: Any = None) -> int:
        """Bytes one FastDeploy block takes with every layer at its own shape (no pool): what
        FastDeploy's allocation of it really holds, codes and scales included."""
        return cache_bytes(self.layer_elements, self.layer_token_heads, dtype, quant)

    def num_pages(self, num_gpu_blocks: int) -> int:
        """Pages the pool manages for ``num_gpu_blocks`` FastDeploy blocks (engine and worker)."""
        return _int("num_gpu_blocks", num_gpu_blocks, 0) * self.pages_per_block

    def alloc_pages(self, num_pages: int) -> int:
        """Rows the worker allocates per slot for ``num_pages`` managed pages (rounded up to
        :attr:`page_multiple`; the extra rows are never handed out)."""
        m = self.page_multiple
        return -(-_int("num_pages", num_pages, 0) // m) * m

    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """``{layer index: (group, slot)}``."""
        return {li: (g.index, t) for g in self.groups for t, li in enumerate(g.layers)}

    def layer_group(self) -> dict[int, int]:
        """``{layer index: group index}``."""
        return {li: g.index for g in self.groups for li in g.layers}

    def lanes(self, group: int) -> int:
        """Lanes (table rows per request in the protocol) of ``group``."""
        return len(self.groups[group].lanes)

    @property
    def slides(self) -> bool:
        """True when some lane releases pages (else recycling gains nothing)."""
        return any(w is not None for g in self.groups for w in g.lanes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "mode": self.mode,
            "heads_per_page": self.heads_per_page,
            "slots": self.slots,
            "qk_head_dim": self.qk_head_dim,
            "v_head_dim": self.v_head_dim,
            "pages_per_block": self.pages_per_block,
            "padding": self.padding,
            "groups": [{**g.describe(), "lanes": list(g.lanes)} for g in self.groups],
        }


def pool_layout(plan: AttentionPlan, block_size: int, mode: RecycleMode = "headwise") -> PoolLayout:
    """The one pool's layout for ``plan`` (the plan whose windows hold on every TP rank,
    ``serving/kv_recycling/protocol.py`` ``merge_tp_plans``) at FastDeploy's ``block_size``."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    bs = _int("block_size", block_size, 1)
    if mode not in RECYCLE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {RECYCLE_MODES}")
    kinds = groups_from_plan(plan, mode)
    if not kinds:
        raise ValueError(f"plan has no layers: {plan!r}")
    slots = 0
    heads = 0
    for k in kinds:
        slots = math.gcd(slots, len(k.layers))
        heads = math.gcd(heads, k.unit)  # a whole-block kind's Hkv, 1 for a head-wise one
    groups: list[LayerGroup] = []
    for k in kinds:
        for start in range(0, len(k.layers), slots):
            lanes = k.lanes if k.unit == 1 else k.lanes * (k.num_kv_heads // heads)
            unit = 1 if k.unit == 1 else heads
            groups.append(
                LayerGroup(
                    len(groups), k.layers[start : start + slots], k.num_kv_heads, k.windows, unit, lanes
                )
            )
    return PoolLayout(
        block_size=bs,
        mode=mode,
        heads_per_page=heads,
        slots=slots,
        qk_head_dim=max(la.qk_head_dim for la in plan),
        v_head_dim=max(la.v_head_dim for la in plan),
        groups=tuple(groups),
        layer_elements=bs * sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) for la in plan),
    )


def allocation_cap(window_left: int, block_size: int, max_num_batched_tokens: int) -> int:
    """Most pages one FastDeploy allocation can add to a sliding lane with ``window_left``.

    After ``reserve(target, computed)`` a sliding lane holds the blocks of
    ``[computed - window_left, target)``; FastDeploy's ``target - computed`` is at most one
    step's tokens plus a partial block (prefill) or 2 blocks + 12 slots + 1 (decode).
    """
    step = max(
        max_num_batched_tokens + block_size,
        FASTDEPLOY_LOOKAHEAD_BLOCKS * block_size + FASTDEPLOY_LOOKAHEAD_SLOTS + 1,
    )
    return -(-(window_left + step) // block_size) + 2


def pages_needed(layout: PoolLayout, num_blocks: int, caps: list[list[int | None]]) -> int:
    """Pages the pool must have free so that ANY request can grow by ``num_blocks`` FastDeploy
    blocks: ``num_blocks`` per full lane, at most ``cap`` per sliding lane (``caps`` per group and
    lane, :func:`allocation_cap`; ``None`` for a full lane). What ``can_allocate_gpu_blocks``
    answers with, so a promised allocation always succeeds."""
    n = max(0, int(num_blocks))
    return sum(n if cap is None else min(n, cap) for lanes in caps for cap in lanes)


def admission_pages(
    layout: PoolLayout,
    chunk_blocks: int,
    reserves: list[tuple[int, frozenset[int]]],
    caps: list[list[int | None]],
) -> int:
    """Pages FastDeploy's prefill admission threshold stands for when its parts are known: the
    chunk's ``chunk_blocks`` for the request being admitted (at most ``cap`` per sliding lane, as
    :func:`pages_needed`) plus each running request's decode reserve. ``reserves``: per running
    request ``(blocks, releasing)``, ``blocks`` FastDeploy's reserve for it
    (``_get_running_request_reserve_blocks``, its estimate of the growth still to come),
    ``releasing`` the windows whose lanes have begun to give pages back
    (``HeadwiseKVManager.releasing_windows``). A full lane is charged the reserve, and so is a
    sliding lane that has not outgrown its window yet (a request shorter than the window grows like
    a full one); a lane that releases gives a page back for every page it takes from then on and
    is charged nothing (FastDeploy's look-ahead, which comes and goes every two blocks, is not in
    FastDeploy's reserve for any lane). FastDeploy prices the same threshold at ``chunk +
    sum(blocks)`` blocks of every lane: this is never more, and equal where no lane releases."""
    chunk = max(0, int(chunk_blocks))
    parts = [(max(0, int(r)), releasing) for r, releasing in reserves]
    total = sum(r for r, _ in parts)
    growth: dict[int, int] = {}  # window -> the reserves of the requests whose lanes of it still grow
    need = 0
    for g, lanes in zip(layout.groups, caps, strict=True):
        for w, cap in zip(g.lanes, lanes, strict=True):
            if cap is None:
                need += chunk + total
                continue
            if w not in growth:
                growth[w] = sum(r for r, releasing in parts if w not in releasing)
            need += min(chunk, cap) + growth[w]
    return need


def request_pages(layout: PoolLayout, num_tokens: int, computed: int | None = None) -> int:
    """Pages one request holds with ``num_tokens`` tokens allocated once every query before
    ``computed`` (default ``num_tokens``) has run (``headwise.held_units``)."""
    return sum(held_units(layout.groups, layout.block_size, num_tokens, computed))


@dataclass(frozen=True)
class Capacity:
    """Requests of ``context`` tokens held at once in ``num_gpu_blocks`` FastDeploy blocks.

    ``fastdeploy_requests``: FastDeploy's accounting (every layer keeps every block, its decode
    look-ahead included). ``recycling_requests``: the one pool, each request holding what its
    lanes hold at ``context`` tokens decoding (look-ahead included), less ``transient_pages`` (one
    step's prefill on the sliding lanes, beyond their windows). Both capped at
    ``max_num_seqs`` when given.
    """

    context: int
    num_gpu_blocks: int
    num_pages: int
    fastdeploy_blocks_per_request: int
    fastdeploy_requests: int
    pages_per_request: int
    fastdeploy_pages_per_request: int
    transient_pages: int
    recycling_requests: int

    @property
    def ratio(self) -> float:
        return self.recycling_requests / max(1, self.fastdeploy_requests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_pages": self.num_pages,
            "fastdeploy_blocks_per_request": self.fastdeploy_blocks_per_request,
            "fastdeploy_requests": self.fastdeploy_requests,
            "pages_per_request": self.pages_per_request,
            "fastdeploy_pages_per_request": self.fastdeploy_pages_per_request,
            "transient_pages": self.transient_pages,
            "recycling_requests": self.recycling_requests,
            "ratio": self.ratio,
        }


def capacity(
    layout: PoolLayout,
    num_gpu_blocks: int,
    context: int,
    *,
    max_num_batched_tokens: int = 0,
    max_num_seqs: int | None = None,
) -> Capacity:
    """FastDeploy vs the one pool for requests of ``context`` tokens (:class:`Capacity`)."""
    blocks = _int("num_gpu_blocks", num_gpu_blocks, 0)
    ctx = _int("context", context, 1)
    batched = _int("max_num_batched_tokens", max_num_batched_tokens, 0)
    seqs = None if max_num_seqs is None else _int("max_num_seqs", max_num_seqs, 1)
    bs = layout.block_size
    held = ctx + fastdeploy_lookahead(bs)
    fd_blocks = -(-held // bs)
    per_req = request_pages(layout, held, ctx)
    full = layout.pages_per_block * fd_blocks
    # one step's prefill sits on the sliding lanes on top of their windows: ``batched`` tokens, spread
    # over up to ``ceil(batched / context) + 1`` requests, none holding more than it saves
    chunk = -(-batched // bs)
    prefilling = -(-batched // ctx) + 1 if batched else 0
    units = held_units(layout.groups, bs, held, ctx)
    transient = sum(
        min(chunk * sum(1 for w in g.lanes if w is not None), prefilling * (len(g.lanes) * fd_blocks - n))
        for g, n in zip(layout.groups, units, strict=True)
    )
    pages = layout.num_pages(blocks)
    fd = blocks // fd_blocks
    ours = max(0, pages - transient) // per_req
    if seqs is not None:
        fd, ours = min(fd, seqs), min(ours, seqs)
    return Capacity(ctx, blocks, pages, fd_blocks, fd, per_req, full, transient, ours)


def min_gpu_blocks(layout: PoolLayout, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
    """Fewest FastDeploy blocks whose pages carry one request of ``max_model_len`` tokens through
    its life: its last prefill chunk (``max_num_batched_tokens`` tokens, the sliding lanes holding
    the chunk on top of their windows; ``None``: the whole prompt in one chunk) and its decode with
    FastDeploy's look-ahead (``max_model_len // block_size + enc_dec_block_num`` blocks). Never more
    than FastDeploy's own minimum for that length, so recycling refuses no engine start FastDeploy
    accepts."""
    ctx = _int("max_model_len", max_model_len, 1)
    bs = layout.block_size
    decode = request_pages(layout, (ctx // bs + FASTDEPLOY_LOOKAHEAD_BLOCKS) * bs, ctx)
    chunk = (
        ctx if max_num_batched_tokens is None else _int("max_num_batched_tokens", max_num_batched_tokens, 1)
    )
    prefill = request_pages(layout, -(-ctx // bs) * bs, max(0, ctx - chunk))
    return -(-max(decode, prefill) // layout.pages_per_block)


def budget_blocks(layout: PoolLayout, budget_bytes: int, dtype: Any, quant: Any = None) -> int:
    """FastDeploy blocks ``budget_bytes`` of KV memory buy in this pool (the runner's
    ``available // cal_theortical_kvcache``), codes and scales counted when ``quant`` is given."""
    return _int("budget_bytes", budget_bytes, 0) // layout.block_bytes(dtype, quant)


def fastdeploy_claimed_block_bytes(layout: PoolLayout, dtype: Any, quant: Any = None) -> int:
    """FastDeploy's own price of one block for this model at every layer's own shape, as its
    ``cal_theortical_kvcache`` counts (``worker/gpu_model_runner.py``): ``byte_of_dtype`` = 1 for
    ANY ``kv_cache_quant_type`` (else 2) times the elements; a ``block_wise_fp8`` cache's scale
    tensors are not counted, so FastDeploy's block count over-commits by their bytes
    (:meth:`PoolLayout.layer_block_bytes` is what it allocates)."""
    return layout.layer_elements * (1 if cache_quant(quant) is not None else dtype_bytes(dtype))


__all__ = [
    "FASTDEPLOY_LOOKAHEAD_BLOCKS",
    "FASTDEPLOY_LOOKAHEAD_SLOTS",
    "Capacity",
    "PoolLayout",
    "admission_pages",
    "allocation_cap",
    "budget_blocks",
    "capacity",
    "fastdeploy_claimed_block_bytes",
    "fastdeploy_lookahead",
    "min_gpu_blocks",
    "pages_needed",
    "pool_layout",
    "request_pages",
]
