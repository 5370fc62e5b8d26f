"""The pools report of ``fdfleet plan``: FastDeploy's accounting beside window recycling's one
pool, for a mix of request lengths (stdlib only).

The pool is :func:`kvcache.pools.pool_layout` over the plan every TP rank agrees on
(``protocol.merge_tp_plans``, via :func:`protocol.layout_from_plans`), the same layout the
scheduler hook and the worker build; every count is :func:`kvcache.pools.capacity`,
:func:`~kvcache.pools.budget_blocks` and :func:`~kvcache.pools.min_gpu_blocks`, the functions
they count with.

Per request length (``context``) the report compares, in the same bytes per rank:

* FastDeploy: ``memory // (block_size * sum_l Hkv_l * (qk_l + v_l) * dtype_bytes)`` blocks (every
  layer at its own shape, ``sizing.block_bytes``), each request holding
  ``ceil((context + 2 * block_size + 12) / block_size)`` blocks of every layer (its decode
  look-ahead included);
* recycling: the blocks the pool's price buys (:func:`~kvcache.pools.budget_blocks`: the same
  count unless layers differ in head dims, whose padding the pool pays for), as pages of the one
  pool, each request holding what its lanes hold at ``context`` tokens, less the pages one step's
  prefill chunk (``max_num_batched_tokens``) takes on the sliding lanes
  (:class:`~kvcache.pools.Capacity`).

With a quantized cache (``kv_cache_quant``, FastDeploy's ``kv_cache_quant_type``) both prices count
one byte per element plus a dynamic format's scales (``PoolLayout.layer_block_bytes`` /
``block_bytes``): FastDeploy's own ``cal_theortical_kvcache`` leaves ``block_wise_fp8``'s scales
out, so the block count it claims (``fastdeploy_claimed_num_blocks``) over-commits the memory; the
comparison uses what its allocation really takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ...kvcache.headwise import MAX_TOKENS, LayerGroup
from ...kvcache.layout import GIB, cache_quant, format_bytes
from ...kvcache.pools import (
    FASTDEPLOY_LOOKAHEAD_BLOCKS,
    Capacity,
    PoolLayout,
    budget_blocks,
    capacity,
    fastdeploy_claimed_block_bytes,
    fastdeploy_lookahead,
    min_gpu_blocks,
)
from .protocol import layout_from_plans, merge_tp_plans

#: FastDeploy's ``max_num_batched_tokens`` assumed by the report unless told (one step's prefill tokens)
REPORT_BATCHED_TOKENS = 8192
#: the report's answer for a plan with no lane that releases pages on every TP rank
NOTHING_TO_RECYCLE = (
    "no lane slides on every rank: nothing to recycle, FastDeploy's own accounting serves this model"
)


@dataclass(frozen=True)
class ContextRow:
    """One request length: FastDeploy's max concurrent requests beside recycling's.

    ``fastdeploy``: :func:`capacity` at FastDeploy's own block count (its ``fastdeploy_*`` fields
    are FastDeploy's accounting); ``recycling``: :func:`capacity` at the pool's block count (its
    ``recycling_requests``, ``pages_per_request``, ``transient_pages``). The two are one call's
    result unless the pool pays for padding.
    """

    fastdeploy: Capacity
    recycling: Capacity

    @property
    def context(self) -> int:
        return self.recycling.context

    @property
    def fastdeploy_requests(self) -> int:
        return self.fastdeploy.fastdeploy_requests

    @property
    def recycling_requests(self) -> int:
        return self.recycling.recycling_requests

    @property
    def ratio(self) -> float | None:
        """Recycling's requests over FastDeploy's; None when FastDeploy holds none."""
        fd = self.fastdeploy_requests
        return self.recycling_requests / fd if fd else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "fastdeploy_requests": self.fastdeploy_requests,
            "recycling_requests": self.recycling_requests,
            "ratio": self.ratio,
            "fastdeploy_blocks_per_request": self.fastdeploy.fastdeploy_blocks_per_request,
            "fastdeploy_pages_per_request": self.recycling.fastdeploy_pages_per_request,
            "pages_per_request": self.recycling.pages_per_request,
            "transient_pages": self.recycling.transient_pages,
        }


@dataclass(frozen=True)
class PoolsReport:
    """The one pool for ``memory_bytes`` per rank and its max concurrent requests per context.

    ``fastdeploy_num_blocks`` / ``fastdeploy_block_bytes``: FastDeploy's own count and price of a
    block (every layer at its shape); ``num_gpu_blocks`` / ``block_bytes``: the pool's
    (:func:`budget_blocks`, :meth:`PoolLayout.block_bytes`), ``num_pages`` its pages.
    ``min_gpu_blocks``: the fewest blocks that hold one ``max_model_len`` request (at most
    ``num_gpu_blocks``: a report is only built when one fits).
    """

    layout: PoolLayout
    dtype: str
    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    fastdeploy_num_blocks: int
    fastdeploy_block_bytes: int
    num_gpu_blocks: int
    block_bytes: int
    min_gpu_blocks: int
    rows: tuple[ContextRow, ...]
    kv_cache_quant: str | None = None
    fastdeploy_claimed_block_bytes: int | None = None

    @property
    def fastdeploy_claimed_num_blocks(self) -> int:
        """Blocks FastDeploy's own ``cal_theortical_kvcache`` says the memory holds (more than it
        does for ``block_wise_fp8``: the scale tensors are not counted)."""
        return self.memory_bytes // (self.fastdeploy_claimed_block_bytes or self.fastdeploy_block_bytes)

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages(self.num_gpu_blocks)

    @property
    def fastdeploy_min_gpu_blocks(self) -> int:
        """FastDeploy's own minimum for one ``max_model_len`` request (``CacheConfig.reset``:
        ``max_model_len // block_size + enc_dec_block_num``)."""
        return self.max_model_len // self.layout.block_size + FASTDEPLOY_LOOKAHEAD_BLOCKS

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "kv_cache_quant": self.kv_cache_quant,
            "memory_bytes": self.memory_bytes,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "layout": self.layout.to_dict(),
            "fastdeploy_num_blocks": self.fastdeploy_num_blocks,
            "fastdeploy_block_bytes": self.fastdeploy_block_bytes,
            "fastdeploy_claimed_num_blocks": self.fastdeploy_claimed_num_blocks,
            "fastdeploy_claimed_block_bytes": self.fastdeploy_claimed_block_bytes
            or self.fastdeploy_block_bytes,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_bytes": self.block_bytes,
            "num_pages": self.num_pages,
            "page_bytes": self.layout.page_bytes(self.dtype, self.kv_cache_quant),
            "min_gpu_blocks": self.min_gpu_blocks,
            "fastdeploy_min_gpu_blocks": self.fastdeploy_min_gpu_blocks,
            "contexts": [row.to_dict() for row in self.rows],
        }


def _count(name: str, value: Any, low: int, high: int = MAX_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r}: expected an int in [{low}, {high}]")
    return value


def high_gap(block_size: int) -> int:
    """Tokens a request may hold beyond its length: FastDeploy's decode look-ahead, plus the partial
    block :func:`min_gpu_blocks` rounds up."""
    return fastdeploy_lookahead(block_size) + block_size


def _length(name: str, value: Any, block_size: int) -> int:
    """A request length: an int >= 1 whose look-ahead still fits int32 sequence lengths."""
    high = MAX_TOKENS - high_gap(block_size)
    try:
        return _count(name, value, 1, high)
    except ValueError as e:
        if value <= high:
            raise
        raise ValueError(
            f"{e} (the {high_gap(block_size)} tokens of FastDeploy's decode look-ahead and block "
            "rounding must fit int32 sequence lengths)"
        ) from None


def check_contexts(
    contexts: Iterable[int], max_model_len: int | None, block_size: int
) -> tuple[tuple[int, ...], int]:
    """``(contexts, max_model_len)`` checked: ints >= 1, none twice, none longer than
    ``max_model_len`` (default: the longest), and room for FastDeploy's decode look-ahead within
    int32 sequence lengths. ``ValueError`` / ``TypeError`` name the bad value."""
    bs = _count("block_size", block_size, 1)
    ctxs = tuple(_length("context", c, bs) for c in contexts)
    if not ctxs:
        raise ValueError("contexts=(): expected at least one request length")
    twice = sorted({c for c in ctxs if ctxs.count(c) > 1})
    if twice:
        raise ValueError(f"context={twice[0]!r} is given twice in {list(ctxs)}")
    mml = max(ctxs) if max_model_len is None else _length("max_model_len", max_model_len, bs)
    longer = [c for c in ctxs if c > mml]
    if longer:
        raise ValueError(
            f"context={max(longer)!r} is longer than max_model_len={mml!r}: FastDeploy admits no such request"
        )
    return ctxs, mml


def cannot_hold(num_gpu_blocks: int, needed: int, max_model_len: int, memory_bytes: int) -> str:
    """The report's answer when the pool cannot hold one ``max_model_len`` request (the engine then
    refuses to start, in FastDeploy's words)."""
    return (
        f"one request of max_model_len={max_model_len} tokens needs {needed} FastDeploy blocks even with "
        f"recycling, {format_bytes(memory_bytes)} buys {num_gpu_blocks}: the engine refuses to start "
        f"(current device block num: {num_gpu_blocks} should be larger than or equal to {needed}); "
        "give more memory or a smaller max_model_len"
    )


def pools_report(
    layout: PoolLayout,
    memory_bytes: int,
    dtype: str,
    contexts: Sequence[int],
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = REPORT_BATCHED_TOKENS,
    kv_cache_quant: Any = None,
) -> PoolsReport | str:
    """The report for ``layout`` (:func:`pool_layout` of the plan every rank agrees on) in
    ``memory_bytes`` per rank, one row per ``contexts`` entry (in the order given); or why there is
    none (:data:`NOTHING_TO_RECYCLE`, :func:`cannot_hold`). ``max_model_len`` defaults to the
    longest context and may not be shorter than any. ``kv_cache_quant``: FastDeploy's
    ``kv_cache_quant_type`` (``dtype`` is then the model's, the scales' dtype)."""
    if not isinstance(layout, PoolLayout):
        raise TypeError(f"layout must be a PoolLayout, got {type(layout).__name__}")
    memory = _count("memory_bytes", memory_bytes, 0, 2**62)
    batched = _count("max_num_batched_tokens", max_num_batched_tokens, 0)
    ctxs, mml = check_contexts(contexts, max_model_len, layout.block_size)
    if not layout.slides:
        return NOTHING_TO_RECYCLE
    quant = cache_quant(kv_cache_quant)
    fd_price = layout.layer_block_bytes(dtype, quant)  # what FastDeploy's allocation of a block takes
    fd_blocks = memory // fd_price
    blocks = budget_blocks(layout, memory, dtype, quant)
    needed = min_gpu_blocks(layout, mml, batched or None)
    if blocks < needed:
        return cannot_hold(blocks, needed, mml, memory)
    rows = []
    for c in ctxs:
        ours = capacity(layout, blocks, c, max_num_batched_tokens=batched)
        fd = ours if fd_blocks == blocks else capacity(layout, fd_blocks, c, max_num_batched_tokens=batched)
        rows.append(ContextRow(fd, ours))
    return PoolsReport(
        layout=layout,
        dtype=str(dtype),
        memory_bytes=memory,
        max_model_len=mml,
        max_num_batched_tokens=batched,
        fastdeploy_num_blocks=fd_blocks,
        fastdeploy_block_bytes=fd_price,
        num_gpu_blocks=blocks,
        block_bytes=layout.block_bytes(dtype, quant),
        min_gpu_blocks=needed,
        rows=tuple(rows),
        kv_cache_quant=None if quant is None else quant.name,
        fastdeploy_claimed_block_bytes=fastdeploy_claimed_block_bytes(layout, dtype, quant),
    )


def pools_for(
    source: Any,
    tp_size: int,
    block_size: int,
    dtype: str,
    memory_gib: float,
    contexts: Sequence[int],
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = REPORT_BATCHED_TOKENS,
    kv_cache_quant: Any = None,
) -> PoolsReport | str:
    """:func:`pools_report` for ``source`` (``plan_from_config``'s input) over ``tp_size`` ranks,
    ``memory_gib`` GiB of KV cache per rank."""
    from ...plan.config import plan_from_config

    plans = [plan_from_config(source, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    layout = layout_from_plans(merge_tp_plans(plans), block_size).pool
    return pools_report(
        layout,
        int(memory_gib * GIB),
        dtype,
        contexts,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_quant=kv_cache_quant,
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _lanes(g: LayerGroup) -> str:
    windows = [w for w in g.lanes if w is not None]
    n = len(g.lanes)
    if not windows:
        return _n(n, "full lane")
    what = "window_left " + "/".join(str(w) for w in sorted(set(windows)))
    if len(windows) == n:
        return f"{_n(n, 'lane')}, {what}"
    return f"{_n(n, 'lane')}: {n - len(windows)} full, {len(windows)} {what}"


def group_summary(layout: PoolLayout) -> str:
    """The groups by kind: ``12 sliding (8 kv heads, 1 lane, window_left 127), 12 full (...)``,
    counted in groups of ``slots`` layers."""
    kinds: dict[tuple[str, int, str], int] = {}
    for g in layout.groups:
        key = (g.kind, g.num_kv_heads, _lanes(g))
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {kind} ({_n(hkv, 'kv head')}, {lanes})" for (kind, hkv, lanes), n in kinds.items())


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"x{r:.2f}"


def recycle_head(recycle: str = "auto", source: str = "default") -> str:
    """The report's first line, naming the ``FDFLEET_KV_RECYCLE`` value in effect and where it came
    from (``env`` or ``default``): ``off`` says the figures below are what recycling would give."""
    if recycle not in ("auto", "off"):
        raise ValueError(f"recycle={recycle!r}: expected 'auto' or 'off'")
    if source not in ("env", "default"):
        raise ValueError(f"source={source!r}: expected 'env' or 'default'")
    where = "from the environment" if source == "env" else "the default"
    head = f"Window recycling (FDFLEET_KV_RECYCLE={recycle}, {where})"
    if recycle == "off":
        return head + ": OFF, FastDeploy's own accounting serves; one KV pool would give, same bytes:"
    return head + ": one KV pool for every layer, same bytes:"


def format_pools(report: PoolsReport | str, recycle: str = "auto", source: str = "default") -> str:
    """Text lines: the one pool's layout and, per context, FastDeploy's max concurrent requests
    beside recycling's, under :func:`recycle_head` (``recycle``, ``source``: the
    ``FDFLEET_KV_RECYCLE`` value in effect and where it came from)."""
    head = recycle_head(recycle, source)
    if not isinstance(report, str) and report.kv_cache_quant:
        head = head[:-1] + f" ({report.kv_cache_quant} cache, codes and scales counted):"
    if isinstance(report, str):
        return f"{head}\n  {report}"
    lay = report.layout
    pad = f", padding {lay.padding:.1%} of the pool" if lay.padding else ", no padding"
    fd_price, price = format_bytes(report.fastdeploy_block_bytes), format_bytes(report.block_bytes)
    fd_line = f"{report.fastdeploy_num_blocks} FastDeploy blocks ({fd_price} each)"
    if report.fastdeploy_claimed_num_blocks != report.fastdeploy_num_blocks:
        fd_line += (
            f" (FastDeploy's own count says {report.fastdeploy_claimed_num_blocks}: it leaves the "
            f"{report.kv_cache_quant} scales out)"
        )
    if report.num_gpu_blocks != report.fastdeploy_num_blocks:
        fd_line += f"; the padded pool buys {report.num_gpu_blocks} ({price} each)"
    rows = [
        (
            "layout",
            f"{_n(len(lay.groups), 'group')} of {_n(lay.slots, 'layer')} (slots), "
            f"{_n(lay.heads_per_page, 'kv head')} per page, {_n(lay.pages_per_block, 'page')} per "
            f"FastDeploy block{pad}",
        ),
        ("groups", group_summary(lay)),
        (
            "memory",
            f"{format_bytes(report.memory_bytes)}: {fd_line} -> {report.num_pages} pages of "
            f"{format_bytes(lay.page_bytes(report.dtype, report.kv_cache_quant))}",
        ),
        (
            "max_model_len",
            f"{report.max_model_len}: one request fits, needing {report.min_gpu_blocks} of the "
            f"{report.num_gpu_blocks} blocks (FastDeploy alone: {report.fastdeploy_min_gpu_blocks})",
        ),
    ]
    lines = [head] + [f"  {label:<14} {value}" for label, value in rows]
    table = [("context", "FastDeploy", "recycling", "ratio", "pages/request FD -> recycling", "chunk pages")]
    for row in report.rows:
        table.append(
            (
                str(row.context),
                str(row.fastdeploy_requests),
                str(row.recycling_requests),
                _ratio(row.ratio),
                f"{row.recycling.fastdeploy_pages_per_request} -> {row.recycling.pages_per_request}",
                str(row.recycling.transient_pages),
            )
        )
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    for r in table:
        lines.append("  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    lines.append(
        f"  (max concurrent requests per rank at each length; FastDeploy's 2-block look-ahead; "
        f"chunk pages: kept free for one step's {report.max_num_batched_tokens}-token prefill chunk)"
    )
    return "\n".join(lines)


__all__ = [
    "NOTHING_TO_RECYCLE",
    "REPORT_BATCHED_TOKENS",
    "ContextRow",
    "PoolsReport",
    "cannot_hold",
    "check_contexts",
    "format_pools",
    "group_summary",
    "pools_for",
    "pools_report",
    "recycle_head",
]
