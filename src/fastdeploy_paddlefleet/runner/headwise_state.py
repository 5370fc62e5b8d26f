"""Head-wise KV pages for ``verify``: :class:`~fastdeploy_paddlefleet.kvcache.headwise.HeadwiseKVManager`
behind :class:`~fastdeploy_paddlefleet.runner.batch.PagedKVState`'s surface.

:class:`HeadwiseKVState` has the same ``schedule(steps) -> BatchMeta``,
``positions(meta)``, ``release(request id)`` and ``blocks_used`` as
``PagedKVState``, so the verify driver takes either. Differences:

* every layer gets its own page table ``[bsz * Hkv_l, max_pages]`` in
  ``BatchMeta.block_tables_headwise`` (a mapping ``layer index -> table``).
  Layer groups have separate page pools, so no single ``block_tables`` is
  right for every layer: ``block_tables`` is all ``-1`` (backends read a
  layer's page table whenever it has one, ``backends/base.py``);
* after a step ran, :meth:`HeadwiseKVState.recycle` releases the pages that
  left every window of their head (manager mode ``headwise``: sliding heads of
  head-wise layers too);
* with ``caches`` given, every page the manager releases, and every page of a
  finished request, is filled with NaN in those caches at once: a later read of
  such a page turns the logits into NaN, which the verify comparison catches.

Sizes: ``num_blocks`` blocks per layer group (the manager's pools; each layer's
cache is ``[num_blocks, Hkv_l, block_size, D_l]`` as in FastDeploy).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

from ..backends.base import BatchMeta
from ..kvcache.headwise import HeadwiseKVManager, RecycleMode
from ..plan.layer import AttentionPlan
from .batch import _positive_int, build_meta, check_steps, token_positions

logger = logging.getLogger(__name__)


class HeadwiseKVState:
    """Per-request, per-kv-head page lists from a :class:`HeadwiseKVManager`; one ``BatchMeta`` per step.

    ``caches``: per layer paddle ``(key [num_blocks, Hkv_l, block_size, Dqk_l], value [..., Dv_l])``
    to poison released pages in (``runner.batch.allocate_kv_caches``); ``None``: no poisoning.
    """

    def __init__(
        self,
        plan: AttentionPlan,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        *,
        mode: RecycleMode = "headwise",
        caches: Sequence[tuple[Any, Any]] | None = None,
    ):
        self.block_size = _positive_int("block_size", block_size)
        self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        self.manager = HeadwiseKVManager(plan, _positive_int("num_blocks", num_blocks), block_size, mode)
        if caches is not None and len(caches) < len(plan):
            raise ValueError(f"caches has {len(caches)} layers, the plan has {len(plan)}")
        self.caches = caches
        #: pages released by the window rule (not by finishing requests), over the whole run
        self.pages_released = 0
        #: pages filled with NaN after their release or their request's end
        self.pages_poisoned = 0

    # ---- PagedKVState's surface -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return max(self.manager.num_blocks)

    @property
    def blocks_used(self) -> int:
        """Blocks each layer's cache needs for the pages now in use: the largest group's
        ``ceil(used pages / Hkv)`` (pages of a group are spread over its blocks)."""
        m = self.manager
        return max(
            -(-(m.group_total_pages(g.index) - m.group_free_pages(g.index)) // g.num_kv_heads)
            for g in m.groups
        )

    @property
    def pages_used(self) -> int:
        """Pages in use over every layer group."""
        return self.manager.used_pages

    @property
    def pages_total(self) -> int:
        return self.manager.total_pages

    @property
    def requests(self) -> list[Hashable]:
        return self.manager.requests

    def cached_tokens(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` with cache slots (0 for an unknown id)."""
        return self.manager.num_tokens(request_id) if request_id in self.manager else 0

    def schedule(self, steps: Sequence[tuple[Hashable, int]]) -> BatchMeta:
        """Reserve pages for one step and return its ``BatchMeta`` (page tables for every layer).

        ``steps``: ``(request id, new tokens this step)`` in batch order; an unseen id is
        admitted. ``ValueError`` for a repeated id, a bad token count, a request longer than
        ``max_blocks_per_seq`` blocks (nothing changed then) or a pool that runs dry (the
        requests before the failing one keep their reservation: a scheduler would preempt).
        """
        ids = [rid for rid, _ in steps]
        for rid in ids:  # before check_steps hashes them: named errors, not "unhashable type"
            if rid is None:
                raise ValueError("request id None: None marks an empty batch slot; use another id")
            try:
                hash(rid)
            except TypeError:
                raise TypeError(f"request id {rid!r}: expected a hashable id") from None
        check_steps(steps, self.cached_tokens, self.block_size, self.max_blocks_per_seq)
        mgr = self.manager
        before = self._owned()
        dec = []
        for rid, n in steps:
            if rid not in mgr:
                mgr.admit(rid)
            dec.append(mgr.num_tokens(rid))
            # synchronous runner: the request's previous step has run, so all it holds is computed
            result = mgr.append(rid, n, computed=dec[-1])
            if not result:
                raise ValueError(
                    f"head-wise KV pool exhausted: request {rid!r} needs {result.missing_pages} more "
                    f"pages (per group {result.missing}); {mgr.free_pages} of {mgr.total_pages} free"
                )
        # append releases what an earlier step left out of the windows if recycle() was not called
        self.pages_released += self._poison(before, self._owned())
        import numpy as np

        return build_meta(
            dec,
            [n for _, n in steps],
            np.full((len(ids), 1), -1, dtype=np.int32),
            self.block_size,
            block_tables_headwise=mgr.tables(ids, max_pages=self.max_blocks_per_seq),
        )

    def positions(self, meta: BatchMeta) -> Any:
        """Absolute position of each packed token of ``meta`` ``[T]`` (paddle int64)."""
        return token_positions(meta)

    def recycle(self, request_ids: Sequence[Hashable]) -> int:
        """After the step that computed their tokens: release (and poison) every page no current or
        future query of ``request_ids`` can see. Returns the pages released."""
        before = self._owned()
        for rid in request_ids:
            self.manager.release(rid, self.manager.num_tokens(rid))
        released = self._poison(before, self._owned())
        self.pages_released += released
        return released

    def release(self, request_id: Hashable) -> None:
        """Free (and poison) every page of ``request_id``; ``ValueError`` for an unknown id."""
        if request_id not in self.manager:
            raise ValueError(f"unknown request id {request_id!r}")
        before = self._owned()
        self.manager.finish(request_id)
        self._poison(before, self._owned())

    # ---- released pages -----------------------------------------------------------------------
    def _owned(self) -> dict[int, set[int]]:
        """Pages in use per group (every request, every head)."""
        reqs = self.manager.requests
        if not reqs:
            return {g.index: set() for g in self.manager.groups}
        return {gi: set(t[t >= 0].tolist()) for gi, t in self.manager.group_tables(reqs).items()}

    def _poison(self, before: dict[int, set[int]], after: dict[int, set[int]]) -> int:
        """NaN-fill the pages owned in ``before`` but not in ``after``; returns how many pages."""
        count = 0
        for g in self.manager.groups:
            gone = sorted(before[g.index] - after[g.index])
            count += len(gone)
            if not gone or self.caches is None:
                continue
            for li in g.layers:
                for cache in self.caches[li]:
                    _fill_nan(cache, gone, g.num_kv_heads)
            self.pages_poisoned += len(gone)
        return count


def _fill_nan(cache: Any, pages: list[int], hkv: int) -> None:
    """NaN-fill ``pages`` of ``cache [num_blocks, Hkv, block_size, D]`` (page ``p``: block ``p // Hkv``,
    head ``p % Hkv``)."""
    import numpy as np

    blocks = np.asarray(pages, dtype=np.int64) // hkv
    heads = np.asarray(pages, dtype=np.int64) % hkv
    import paddle

    index = (paddle.to_tensor(blocks, place=cache.place), paddle.to_tensor(heads, place=cache.place))
    nan = paddle.to_tensor(np.full([len(pages), *cache.shape[2:]], np.nan, np.float32), place=cache.place)
    cache.index_put_(index, nan.astype(cache.dtype))
