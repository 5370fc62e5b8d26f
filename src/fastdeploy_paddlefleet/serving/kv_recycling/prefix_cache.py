"""Window-aware prefix caching inside FastDeploy's radix tree, on the one recycled pool (issue 32).

``docs/prefix_caching.md`` is the design and ``kvcache/prefix.py`` the rule; this module is the
bridge the scheduler hook (``scheduler.py``) installs when FastDeploy's own
``cache_config.enable_prefix_caching`` is on for a model that recycles window pages.

FastDeploy keeps its radix tree (``PrefixCacheManager``): hashing, matching, ``shared_count``
refcounts per node, LRU order of leaves. What it calls a block id is, here, an *entry id*: one per
(request, logical block) the request allocated. :class:`PrefixCache` maps each entry to the units
(pages of the one pool) each group and lane holds for that block, and *tags* them in the pool
(``headwise._Pool.tags``):

* a tagged unit whose last holder lets go (the writer's window release, the end of a request) is
  not free but *evictable*: it keeps its content for a later hit, counts as available, and is
  reused by an allocation only when no free unit is left, least recently released first (units on
  a running request's path last); the pool then tells the entry, which reads ``-1`` there (vLLM's
  cached-but-free blocks). So a system prompt longer than a window stays servable after the first
  conversation decoded past it, as with FastDeploy alone;
* when the writer is freed (finish, abort, preemption: FastDeploy's ``_free_blocks``),
  :func:`~...kvcache.prefix.keep_plan` says which units of its cached path a later request can
  still be served from; its own entries drop the others (free at once);
* a request served ``L`` cached tokens holds (one more holder each, claiming evictable ones back)
  the units its windows need at ``L`` (``-1`` below each sliding window), as if it had computed
  them itself; no unit is reused or written while a live request holds it.

Nodes left holding nothing stay in the tree until it holds more nodes than the pool has units; then
FastDeploy's LRU leaves are dropped through its own ``free_block_ids`` (:meth:`PrefixCache.trim`).

The instance wrappers on ``PrefixCacheManager`` (never the class: other models keep FastDeploy's
behaviour exactly): ``mm_match_block`` (cut the match to the largest servable length, LRU fix-up),
``update_cache_blocks`` / ``cache_output_blocks`` (node ids never run out; output blocks cached
only up to the tokens whose KV is written; new nodes registered; a node that FastDeploy's
``mm_build_path`` replaces hands its subtree to the new one: :meth:`PrefixCache._graft`),
``recycle_gpu_blocks`` (entry ids, never pages, come back here).
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
    "free_nodes_directly",
    "gpu_lru_leaf_heap",
    "gpu_lru_leaf_set",
    "req_leaf_map",
    "req_to_radix_tree_info",
    "node_id_pool",
    "radix_tree_root",
)


#: the hash a replaced node is renamed to (``PrefixCache._graft``): no block hashes to it
ORPHAN_PREFIX = "fdfleet-replaced-"


def missing_members(cache_manager: Any) -> list[str]:
    """The members of :data:`CACHE_MANAGER_MEMBERS` this ``PrefixCacheManager`` lacks."""
    return [name for name in CACHE_MANAGER_MEMBERS if not hasattr(cache_manager, name)]


class _Entry:
    """One cached logical block: ``units[g][j]`` (``-1``: none) the units it refers to (tagged in
    the pool), ``writer`` and ``block`` while the request that allocated it runs, ``node``:
    FastDeploy's ``BlockNode`` once the block is in the tree."""

    __slots__ = ("writer", "block", "units", "node")

    def __init__(self, writer: str, block: int, units: list[list[int]]) -> None:
        self.writer: str | None = writer
        self.block = block
        self.units = units
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
        self.in_tree = 0  # entries that are nodes of FastDeploy's tree
        self._freeing: dict[str, list[Any]] = {}  # request -> its path, from before_free to after_free
        self.grafts = 0  # tree nodes replaced by a recomputed block whose subtree was kept (_graft)
        #: nodes kept at most: every unit of the pool on its own node (beyond that many nodes hold
        #: nothing); FastDeploy's LRU leaves past it are dropped (:meth:`trim`)
        self.max_nodes = max(self.mgr.total_units, self._node_ids_min)
        self.mgr.on_evict(self._evicted, self._hot)
        self._wrap()

    # ---- entries -------------------------------------------------------------------------
    def new_entry(self, rid: str, block: int) -> int:
        """A fresh entry id for ``rid``'s logical ``block`` (what FastDeploy's block_tables hold),
        referring to the units ``rid`` holds for it: tagged, so that a window release by the running
        writer leaves them evictable with their content instead of free (a later request with the
        same prefix is served from them while they survive)."""
        eid = self._free_ids.pop() if self._free_ids else self._take_id()
        units = self.mgr.units_at(rid, block)
        mgr = self.mgr
        for g, lanes in enumerate(units):
            for j, u in enumerate(lanes):
                if u >= 0:
                    mgr.tag_unit(g, u, (eid, g, j))
        self.entries[eid] = _Entry(rid, block, units)
        self.own.setdefault(rid, {})[block] = eid
        return eid

    def _evicted(self, unit: int, tag: tuple[int, int, int]) -> None:
        """The pool reused evictable ``unit``: its entry no longer has it (``-1``)."""
        eid, g, j = tag
        e = self.entries.get(eid)
        if e is not None and e.units[g][j] == unit:
            e.units[g][j] = -1

    def _hot(self, tag: tuple[int, int, int]) -> bool:
        """A unit let go now is reused last when its entry is on a running request's path (its
        writer runs, or a running request passes through its node): FastDeploy alone would evict
        nothing there, so a shared prefix some conversation is on survives pressure as it would."""
        e = self.entries.get(tag[0])
        return e is not None and (e.writer is not None or (e.node is not None and e.node.shared_count > 0))

    def _cool(self, path: list[Any]) -> None:
        """Entries of ``path`` no running request passes through any more: their evictable units
        (hot or cold) are queued again from the path's end to its root, so that LRU reuses the
        path's end first and its root (a prefix others share) last, as FastDeploy's leaf-first
        eviction would; a request's own private tail goes before the prompt it shares."""
        mgr = self.mgr
        for node in reversed(path):
            if node.shared_count > 0:
                continue
            e = self.entries.get(node.block_id)
            if e is None or e.writer is not None or e.node is not node:
                continue
            for g, lanes in enumerate(e.units):
                for u in lanes:
                    if u >= 0:
                        mgr.cool_unit(g, u)

    def _unref(self, eid: int, e: _Entry, g: int, j: int) -> None:
        """Entry ``eid`` stops referring to its unit of group ``g`` lane ``j`` (free if unheld)."""
        u = e.units[g][j]
        if u >= 0:
            e.units[g][j] = -1
            self.mgr.untag_unit(g, u, (eid, g, j))

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def units(self, eid: int) -> list[list[int]] | None:
        """The units entry ``eid`` stands for per group and lane (``None``: unknown entry)."""
        e = self.entries.get(eid)
        return None if e is None else e.units

    def _drop(self, eid: int) -> None:
        """Forget an entry: its units are no longer cached (evictable ones become free, held ones
        are freed by their last holder)."""
        e = self.entries.pop(eid, None)
        if e is None:
            return
        for g, lanes in enumerate(e.units):
            for j in range(len(lanes)):
                self._unref(eid, e, g, j)
        if e.writer is not None:
            own = self.own.get(e.writer)
            if own is not None and own.get(e.block) == eid:
                del own[e.block]
        if e.node is not None:
            self.in_tree -= 1
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
        on the request's path: its own entries keep the units the rule keeps (evictable once the
        request lets go) and drop the others (free at once: no match can read them)."""
        rid = request.request_id
        if rid not in self.mgr:
            return
        self.cache_written(request)
        path = self._path(rid)
        if not path:
            return
        self._freeing[rid] = path
        eids = [n.block_id for n in path]
        plan = keep_plan(self.windows, self._held(eids), self.bs, len(eids) * self.bs)
        own = self.own.get(rid, {})
        for k, eid in enumerate(eids):
            e = self.entries.get(eid)
            if e is None or e.writer != rid or own.get(k) != eid:
                continue
            for g, lanes in enumerate(plan.keep):
                for j, keep in enumerate(lanes):
                    if k not in keep:
                        self._unref(eid, e, g, j)
            e.writer = None
            if e.node is None:
                e.node = path[k]
                self.in_tree += 1
            del own[k]

    def after_free(self, rid: str) -> None:
        """After FastDeploy's ``_free_blocks`` and the manager's: forget what ``rid`` still owned
        (entries past its path; FastDeploy recycled the uncached ones already), and cool the path's
        hot units where no running request passes any more."""
        for eid in list(self.own.pop(rid, {}).values()):
            e = self.entries.get(eid)
            if e is None:
                continue
            if e.node is not None:  # in the tree but not on the path the keep rule saw: refers to nothing
                for g, lanes in enumerate(e.units):
                    for j in range(len(lanes)):
                        self._unref(eid, e, g, j)
                e.writer = None
            else:
                self._drop(eid)
        self.written.pop(rid, None)
        self._cool(self._freeing.pop(rid, []))

    # ---- availability --------------------------------------------------------------------
    def evictable(self) -> int:
        """Units cached entries refer to and nobody holds: available (in the manager's
        ``free_units``), reused oldest release first by an allocation that finds no free unit."""
        return self.mgr.evictable_units

    def cached_units(self) -> int:
        """Units cached entries refer to (held by running requests or evictable)."""
        return sum(len(p.tags) for p in self.mgr._distinct)

    def trim(self) -> None:
        """Drop FastDeploy's LRU leaves (``free_block_ids``, its own path) while the tree has more
        than :attr:`max_nodes` nodes: evicted units leave empty nodes behind, and node ids and
        memory must not grow without bound. A dropped leaf's evictable units become free."""
        cm = self.cm
        while self.in_tree > self.max_nodes and cm.gpu_lru_leaf_heap:
            before = (self.in_tree, len(cm.gpu_lru_leaf_heap))
            cm.free_block_ids(self.in_tree - self.max_nodes)
            if before == (self.in_tree, len(cm.gpu_lru_leaf_heap)):
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
            if e.node is None:
                self.in_tree += 1
            e.node = node
            node = node.parent

    def _graft(self, rid: str, start: Any, before: dict[str, Any]) -> None:
        """Keep the subtree of a node that FastDeploy's ``mm_build_path`` just replaced.

        A match cut below FastDeploy's (a window unit was evicted) makes the request recompute
        blocks that are already nodes of the tree; ``mm_build_path`` then writes its new node over
        the old child of the same hash (``node.children[hash] = new``, c1b7c083d
        ``prefix_cache_manager.py`` 2034) and everything cached below the old node is cut off from
        the root. Here each replaced node ``old`` hands its other children to the new node ``new``
        of the same hash (same tokens, so the same K/V above them), with the running requests that
        pass through them (``shared_count``, ``req_id_set``, which FastDeploy's release walks by
        ``parent``). The replaced chain is left with the requests that end on it; its top is
        renamed so that FastDeploy's eviction of it (``del parent.children[hash]``) cannot delete
        the new node, and what no request holds is evicted now through FastDeploy's own
        ``free_nodes_directly`` (no match can reach it any more)."""
        cm = self.cm
        info = cm.req_to_radix_tree_info.get(rid)
        node, chain = (info[0] if info else None), []
        while node is not None and node is not start and node is not cm.radix_tree_root:
            chain.append(node)
            node = node.parent
        if node is not start or not chain:
            return
        chain.reverse()
        old = before.get(chain[0].hash_value)
        replaced = []
        for i, new in enumerate(chain):
            if old is None or old is new:
                break
            nxt = chain[i + 1].hash_value if i + 1 < len(chain) else None
            following = None
            for h, child in list(old.children.items()):
                if h == nxt:  # replaced too, one level down
                    following = child
                    continue
                del old.children[h]
                child.parent = new
                new.children[h] = child
                # its requests now pass through the new chain above it instead of the old one
                for n in chain[: i + 1]:
                    n.shared_count += child.shared_count
                    n.req_id_set |= child.req_id_set
                for n in (*replaced, old):
                    n.shared_count -= child.shared_count
                    n.req_id_set -= child.req_id_set
            replaced.append(old)
            old = following
        if not replaced:
            return
        self.grafts += len(replaced)
        top = replaced[0]
        top.hash_value = f"{ORPHAN_PREFIX}{top.node_id}"
        last = replaced[-1]
        if last.shared_count == 0 and not last.children:
            cm.free_nodes_directly(last)

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
            info = cm.req_to_radix_tree_info.get(task.request_id)
            start = info[0] if info else None
            before = dict(start.children) if start is not None else {}
            out = update(task, block_size, num_computed_tokens, *a, **kw)
            if start is not None:
                self._graft(task.request_id, start, before)
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


__all__ = ["CACHE_MANAGER_MEMBERS", "ORPHAN_PREFIX", "PrefixCache", "missing_members"]
