"""Window-aware prefix caching inside FastDeploy's radix tree, on the one recycled pool (issue 32).

``docs/prefix_caching.md`` is the design and ``kvcache/prefix.py`` the rule; this module is the
bridge the scheduler hook (``scheduler.py``) installs when FastDeploy's own
``cache_config.enable_prefix_caching`` is on for a model that recycles window pages.

FastDeploy keeps its radix tree (``PrefixCacheManager``): hashing, matching, ``shared_count``
refcounts per node, LRU order of leaves, eviction. What it calls a block id is, here, an *entry
id*: one per (request, logical block) the request allocated. :class:`PrefixCache` maps each entry
to the units (pages of the one pool) each group and lane holds for that block:

* while its writer runs, an entry is *live*: its units are whatever the writer's lanes hold for
  that block (a window release by the writer empties the entry too: a running request never pins
  what it released, so recycling keeps its capacity);
* when the writer is freed (finish, abort, preemption: FastDeploy's ``_free_blocks``), the entries
  of its cached path become *owned*: :func:`~...kvcache.prefix.keep_plan` says which units a later
  request can still be served from; those move from the writer to the entry (one holder each), the
  rest go back to the pool at once;
* a request served ``L`` cached tokens holds (one more holder each) the units its windows need at
  ``L`` (``-1`` below each sliding window), as if it had computed them itself.

A unit returns to the pool when its last holder lets go (``headwise._Pool.refs``), so no unit is
written while a live request or a cached entry still holds it. Owned units nobody else holds on
nodes no running request passes through are *evictable*: they count as available, and an
allocation that needs them evicts FastDeploy's LRU leaves (``free_block_ids``) until it has them.

The instance wrappers on ``PrefixCacheManager`` (never the class: other models keep FastDeploy's
behaviour exactly): ``mm_match_block`` (cut the match to the largest servable length, LRU fix-up),
``update_cache_blocks`` / ``cache_output_blocks`` (node ids never run out; output blocks cached
only up to the tokens whose KV is written; new nodes registered), ``recycle_gpu_blocks`` (entry
ids, never pages, come back here).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

from ...kvcache.prefix import keep_plan, match_limit, servable_tokens

logger = logging.getLogger(__name__)

#: ``PrefixCacheManager`` members the wrappers use (FastDeploy c1b7c083d); missing ones are refused by name
CACHE_MANAGER_MEMBERS = (
    "mm_match_block",
    "update_cache_blocks",
    "cache_output_blocks",
    "recycle_gpu_blocks",
    "release_block_ids",
    "free_block_ids",
    "gpu_lru_leaf_heap",
    "gpu_lru_leaf_set",
    "req_leaf_map",
    "req_to_radix_tree_info",
    "node_id_pool",
    "radix_tree_root",
)


def missing_members(cache_manager: Any) -> list[str]:
    """The members of :data:`CACHE_MANAGER_MEMBERS` this ``PrefixCacheManager`` lacks."""
    return [name for name in CACHE_MANAGER_MEMBERS if not hasattr(cache_manager, name)]


class _Entry:
    """One cached logical block: ``writer`` and ``block`` while live, ``units[g][j]`` once owned;
    ``node``: FastDeploy's ``BlockNode`` once the block is in the tree."""

    __slots__ = ("writer", "block", "units", "node")

    def __init__(self, writer: str, block: int) -> None:
        self.writer: str | None = writer
        self.block = block
        self.units: list[list[int]] | None = None
        self.node: Any = None


class PrefixCache:
    """The side table entry id -> units, and the steps of the hook (module docstring).

    ``rec``: the :class:`~.scheduler.KVRecycler` (its manager holds the units); ``cache_manager``:
    FastDeploy's ``PrefixCacheManager`` of the same ``ResourceManagerV1``.
    """

    def __init__(self, rec: Any, cache_manager: Any, max_blocks_per_request: int) -> None:
        missing = missing_members(cache_manager)
        if missing:
            raise ValueError(
                "window-aware prefix caching needs FastDeploy's PrefixCacheManager members "
                f"{', '.join(missing)}, which this FastDeploy lacks; pass --no-enable-prefix-caching "
                "or set FDFLEET_KV_RECYCLE=off"
            )
        self.rec = rec
        self.mgr = rec.manager
        self.cm = cache_manager
        self.bs = rec.block_size
        self.windows = [list(g.lanes) for g in rec.layout.pool.groups]
        self.ppb = rec.layout.pool.pages_per_block
        self.entries: dict[int, _Entry] = {}
        self.own: dict[str, dict[int, int]] = {}  # writer -> {block: entry id} of its live entries
        self.written: dict[str, int] = {}  # request -> tokens whose KV is known written
        self._free_ids: list[int] = []
        self._next_id = 0
        self._node_ids_min = max_blocks_per_request + 2
        pool = cache_manager.node_id_pool
        self._next_node = max(pool) + 1 if pool else 0
        self.served_tokens = 0  # tokens served from cache (what FastDeploy's metrics count too)
        self._wrap()

    # ---- entries -------------------------------------------------------------------------
    def new_entry(self, rid: str, block: int) -> int:
        """A fresh entry id for ``rid``'s logical ``block`` (what FastDeploy's block_tables hold)."""
        eid = self._free_ids.pop() if self._free_ids else self._take_id()
        self.entries[eid] = _Entry(rid, block)
        self.own.setdefault(rid, {})[block] = eid
        return eid

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def units(self, eid: int) -> list[list[int]] | None:
        """The units entry ``eid`` stands for per group and lane (``None``: unknown entry)."""
        e = self.entries.get(eid)
        if e is None:
            return None
        if e.units is not None:
            return e.units
        return self.mgr.units_at(e.writer, e.block)

    def _drop(self, eid: int) -> None:
        """Forget an entry: an owned one's units lose their holder; a live one's stay the writer's."""
        e = self.entries.pop(eid, None)
        if e is None:
            return
        if e.units is not None:
            for g, lanes in enumerate(e.units):
                for u in lanes:
                    if u >= 0:
                        self.mgr.give_unit(g, u)
        elif e.writer is not None:
            own = self.own.get(e.writer)
            if own is not None and own.get(e.block) == eid:
                del own[e.block]
        self._free_ids.append(eid)

    def _held(self, eids: list[int]) -> list[list[list[int]]]:
        """``held[g][j][k]`` along a path of entry ids (``kvcache/prefix.py``'s ``held``)."""
        held = [[[] for _ in lanes] for lanes in self.windows]
        for eid in eids:
            units = self.units(eid)
            for g, lanes in enumerate(held):
                for j, row in enumerate(lanes):
                    row.append(-1 if units is None else units[g][j])
        return held

    # ---- matching ------------------------------------------------------------------------
    def cut_match(self, request: Any, out: tuple) -> tuple:
        """FastDeploy's match (``mm_match_block``'s result) cut to the largest servable length."""
        gpu_ids, cpu_ids, swap, node, gpu_tok, cpu_tok = out
        if cpu_ids or swap:
            raise ValueError("window-aware prefix caching: CPU cache blocks matched, but CPU swap is refused")
        bs = self.bs
        limit = min(int(gpu_tok), match_limit(int(request.need_prefill_tokens), bs))
        top = limit // bs
        L = servable_tokens(self.windows, self._held(list(gpu_ids[:top])), bs, limit) if top else 0
        m = L // bs
        if m == len(gpu_ids):
            return out
        cm = self.cm
        cut, below = node, []
        for _ in range(len(gpu_ids) - m):
            below.append(cut)
            cut = cut.parent
        for n in below:  # FastDeploy took the matched leaf out of the LRU heap: put back what is not served
            if (
                n not in cm.gpu_lru_leaf_set
                and n.shared_count == 0
                and n.is_gpu_leaf_node
                and n.is_persistent is False
            ):
                cm.gpu_lru_leaf_set.add(n)
                heapq.heappush(cm.gpu_lru_leaf_heap, n)
        return list(gpu_ids[:m]), cpu_ids, swap, cut, L, cpu_tok

    def admit(self, request: Any) -> None:
        """After FastDeploy's ``get_prefix_cached_blocks``: the request holds the served units."""
        rid = request.request_id
        tables = request.block_tables
        m = len(tables)
        L = int(request.num_computed_tokens)
        if m == 0:
            return
        if L != m * self.bs:
            raise ValueError(
                f"window-aware prefix caching: request {rid!r} was matched {m} blocks but "
                f"num_computed_tokens={L} (a multimodal revert?); expected {m * self.bs}"
            )
        held = self._held(list(tables))
        self.rec.admit_served(request, held, L)
        self.written[rid] = L
        self.served_tokens += L

    # ---- keeping -------------------------------------------------------------------------
    def _path(self, rid: str) -> list[Any]:
        """FastDeploy's nodes of ``rid``'s cached path, root side first."""
        info = self.cm.req_to_radix_tree_info.get(rid)
        if info is None:
            return []
        node, root, path = info[0], self.cm.radix_tree_root, []
        while node is not None and node is not root:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def cache_written(self, request: Any) -> None:
        """Extend ``request``'s cached path over its written output tokens (FastDeploy's
        ``cache_output_blocks``): a recycled path serves only near its end, so the end is cached."""
        rid = request.request_id
        info = self.cm.req_to_radix_tree_info.get(rid)
        if info is None or not getattr(request, "output_token_ids", None):
            return
        written = self.written.get(rid, 0)
        if written // self.bs <= int(info[1]) // self.bs:
            return
        self.cm.cache_output_blocks(request, self.bs)

    def before_free(self, request: Any) -> None:
        """Before FastDeploy's ``_free_blocks``: cache the written outputs, then run the keep rule
        on the request's path and move the kept units of its own entries into them."""
        rid = request.request_id
        if rid not in self.mgr:
            return
        self.cache_written(request)
        path = self._path(rid)
        if not path:
            return
        eids = [n.block_id for n in path]
        plan = keep_plan(self.windows, self._held(eids), self.bs, len(eids) * self.bs)
        own = self.own.get(rid, {})
        for k, eid in enumerate(eids):
            e = self.entries.get(eid)
            if e is None or e.writer != rid or own.get(k) != eid:
                continue
            units = []
            for g, lanes in enumerate(plan.keep):
                row = []
                for j, keep in enumerate(lanes):
                    row.append(self.mgr.detach(rid, g, j, k) if k in keep else -1)
                units.append(row)
            e.units, e.writer = units, None
            if e.node is None:
                e.node = path[k]
            del own[k]

    def after_free(self, rid: str) -> None:
        """After FastDeploy's ``_free_blocks`` and the manager's: forget what ``rid`` still owned
        (entries past its path; FastDeploy recycled the uncached ones already)."""
        for eid in list(self.own.pop(rid, {}).values()):
            e = self.entries.get(eid)
            if e is None:
                continue
            if e.node is not None:  # in the tree but not on the path the keep rule saw: holds nothing
                e.units, e.writer = [[-1 for _ in lanes] for lanes in self.windows], None
            else:
                self._drop(eid)
        self.written.pop(rid, None)

    # ---- availability --------------------------------------------------------------------
    def evictable(self) -> int:
        """Units only cached entries hold, on nodes no running request passes through."""
        mgr, n = self.mgr, 0
        for e in self.entries.values():
            if e.units is None or e.node is None or e.node.shared_count != 0:
                continue
            for g, lanes in enumerate(e.units):
                for u in lanes:
                    if u >= 0 and mgr.holders(g, u) == 0:
                        n += 1
        return n

    def cached_units(self) -> int:
        """Units held by owned entries (cached), shared or not."""
        return sum(
            1
            for e in self.entries.values()
            if e.units is not None
            for lanes in e.units
            for u in lanes
            if u >= 0
        )

    def evict(self, units: int) -> None:
        """Evict FastDeploy's LRU leaves until ``units`` units are free or none is left."""
        cm, mgr = self.cm, self.mgr
        while mgr.free_units < units and cm.gpu_lru_leaf_heap:
            before = (mgr.free_units, len(cm.gpu_lru_leaf_heap), len(self.entries))
            cm.free_block_ids(max(1, (units - mgr.free_units) // max(1, self.ppb)))
            if before == (mgr.free_units, len(cm.gpu_lru_leaf_heap), len(self.entries)):
                break  # FastDeploy evicted nothing (an eviction still in flight): ask again later

    # ---- FastDeploy instance wrappers ----------------------------------------------------
    def _ensure_node_ids(self) -> None:
        pool = self.cm.node_id_pool
        while len(pool) < self._node_ids_min:
            pool.append(self._next_node)
            self._next_node += 1

    def _register(self, rid: str) -> None:
        """Record the node of every entry on ``rid``'s path built since the last call."""
        info = self.cm.req_to_radix_tree_info.get(rid)
        node, root = (info[0] if info else None), self.cm.radix_tree_root
        while node is not None and node is not root:
            e = self.entries.get(node.block_id)
            if e is None:
                break
            if e.node is node:
                break
            e.node = node
            node = node.parent

    def _wrap(self) -> None:
        cm = self.cm
        cls = type(cm)  # FastDeploy's own methods, never an earlier wrapper (reset_cache_config rebuilds)
        match, update, cache_out = (
            getattr(cls, name).__get__(cm, cls)
            for name in ("mm_match_block", "update_cache_blocks", "cache_output_blocks")
        )

        def mm_match_block(request: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
            return self.cut_match(request, match(request, block_size, *args, **kwargs))

        def update_cache_blocks(
            task: Any, block_size: int, num_computed_tokens: int, *a: Any, **kw: Any
        ) -> Any:
            self._ensure_node_ids()
            out = update(task, block_size, num_computed_tokens, *a, **kw)
            self._register(task.request_id)
            return out

        def cache_output_blocks(task: Any, block_size: int, *a: Any, **kw: Any) -> Any:
            # only blocks whose every token's KV is written: the last sampled token never is
            rid = task.request_id
            written = self.written.get(rid, 0)
            prompt = int(task.prompt_token_ids_len)
            outputs = task.output_token_ids
            keep = max(0, written - prompt)
            self._ensure_node_ids()
            if keep < len(outputs):
                task.output_token_ids = outputs[:keep]
                try:
                    out = cache_out(task, block_size, *a, **kw)
                finally:
                    task.output_token_ids = outputs
            else:
                out = cache_out(task, block_size, *a, **kw)
            self._register(rid)
            return out

        def recycle_gpu_blocks(gpu_block_ids: Any, req_id: Any = None, *a: Any, **kw: Any) -> None:
            ids = gpu_block_ids if isinstance(gpu_block_ids, list | tuple) else [gpu_block_ids]
            for eid in ids:
                if eid is not None and eid >= 0:
                    self._drop(int(eid))

        cm.mm_match_block = mm_match_block
        cm.update_cache_blocks = update_cache_blocks
        cm.cache_output_blocks = cache_output_blocks
        cm.recycle_gpu_blocks = recycle_gpu_blocks


__all__ = ["CACHE_MANAGER_MEMBERS", "PrefixCache", "missing_members"]
