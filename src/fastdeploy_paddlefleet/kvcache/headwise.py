"""Head-wise KV block manager with sliding-window recycling (stdlib; numpy only in ``tables``).

Page pool
---------
A layer's cache ``[num_blocks, Hkv, block_size, D]`` is viewed as ``num_blocks * Hkv`` pages of
``[block_size, D]``; page ``p = block * Hkv + head`` (see ``backends/base.py``). Layers that share
their kv head count and per-head windows form a *group*; a group has ONE pool spanning every
(block, head) slot, shared by all requests and all heads, and one page id means the same slot in
every layer of the group. A page a sliding head releases can therefore hold any request's any
head's next block. (A separate pool per head, each as large as a full head needs, would gain
nothing: the full heads fill theirs first and the sliding heads' spare pages cannot be lent.)

Allocation unit: a group whose heads always live and die together (full layers, sliding layers,
or any group in mode ``none``/``layer``) allocates whole blocks (``Hkv`` pages ``b*Hkv .. b*Hkv +
Hkv-1``), so an ordinary ``block_tables [bsz, max_blocks]`` exists for it too. A group mixing
full and sliding heads in mode ``headwise`` allocates single pages per head.

Release rule
------------
Query ``i`` of a head with ``window_left = W`` sees keys ``j`` with ``i - W <= j <= i``. Once
every query before position ``c`` has run (``c`` = computed tokens), no current or future query
sees a key ``j < c - W``, so logical block ``k`` (tokens ``[k*bs, (k+1)*bs)``) is released once
``(k+1) * bs <= c - W``; its table entries read ``-1``. Full heads never release. Sinks in this
project are logits without values, so no "sink tokens" are kept.

Modes: ``headwise`` (every sliding head releases), ``layer`` (only groups whose heads all slide
release, whole blocks at once: what a layer-level SWA manager can do; head-wise layers keep
everything), ``none``.

Scheduler integration (FastDeploy ``ResourceManagerV1``-style; FastDeploy's scheduler is not
part of this package, ``docs/kvcache.md`` has the details):

* pools: size each group's caches with :func:`size_pools` (or one ``num_blocks`` for all) and
  allocate layer ``l``'s cache with its group's ``num_blocks``.
* a waiting request is admitted with :meth:`admit`; where V1 allocates blocks (a prefill
  chunk, or decode blocks allocated ahead) call :meth:`reserve` with the token target and the
  computed bound; ``insufficient`` means "keep it waiting" (nothing was allocated).
  :meth:`held_pages` prices the pages a request will still need, for admission reservations.
* the computed bound is explicit: tokens before the earliest query that may still run. Under
  FastDeploy that is ``num_computed_tokens`` before the step's chunk (a chunk is counted as
  computed when scheduled, and the worker lags the engine), never the allocated target, which
  runs up to 2 blocks + 12 tokens ahead.
* :meth:`release` releases out-of-window pages without allocating (the next ``reserve`` does
  it too); :meth:`preempt` frees everything and re-queues with zero tokens.
* :meth:`finish` frees everything when the request ends or is aborted.
* :meth:`tables` gives ``{layer index: int32 [bsz * Hkv, max_pages]}`` in batch-slot order
  (``None`` for an empty slot); the worker copies it into ``ForwardMeta.block_tables_headwise``
  (a mapping layer -> table, see ``BatchMeta.headwise_table``); :meth:`block_tables` gives the
  ordinary ``[bsz, max_blocks]`` tables of whole-block groups.

Contract: ``reserve`` / ``append`` / ``release`` are atomic and self-sufficient: each releases
what the windows allow up to its ``computed`` bound (every group) before it allocates, and the
dry runs (``can_reserve``, ``can_append``) give their answer on every state. A synchronous driver
whose previous step has run passes ``computed = num_tokens(req_id)``. The bound never moves
backwards for a request (``ValueError`` naming the request and its last bound; nothing changes):
only :meth:`preempt` (or :meth:`finish` and a new :meth:`admit`) restarts it from 0.

Bounds: a group holds at most ``MAX_PAGES`` (``2**31 - 1``, int32 page ids) pages and a request
at most ``MAX_TOKENS`` tokens (int32 sequence lengths); larger sizes are refused at construction
(``ValueError``). Pools are lazy: memory grows with the pages in use, not with the pool size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..plan.layer import AttentionPlan

logger = logging.getLogger(__name__)

RecycleMode = Literal["headwise", "layer", "none"]
RECYCLE_MODES: tuple[str, ...] = ("headwise", "layer", "none")
_INF = float("inf")
#: pages of one group's pool at most: page ids must fit the int32 tables
MAX_PAGES = 2**31 - 1
#: tokens of one request at most (int32 ``seq_lens_*``)
MAX_TOKENS = 2**31 - 1


def _unhashable(req_id: Any) -> TypeError:
    return TypeError(f"req_id={req_id!r}: expected a hashable id, got {type(req_id).__name__}")


def _count(name: str, value: Any, lo: int = 0, hi: int = MAX_TOKENS) -> int:
    """``value`` as an int in ``[lo, hi]``: ``TypeError`` for a non-integer (``bool`` and ``2.0``
    included), ``ValueError`` out of range; both name ``name`` and the value."""
    if type(value) is int and lo <= value <= hi:  # the common case, cheap
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
    v = value.__index__()
    if not lo <= v <= hi:
        raise ValueError(f"{name}={value!r}: expected an int in [{lo}, {hi}]")
    return v


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing kv head count and per-head windows; one page pool.

    ``windows[h]`` is kv head ``h``'s ``window_left`` (``None``: full attention). ``unit`` is the
    allocation unit in pages (``num_kv_heads``: whole blocks, ``1``: single pages). ``lanes``
    lists the windows of the independently released lanes (one lane per unit of a block).
    """

    index: int
    layers: tuple[int, ...]
    num_kv_heads: int
    windows: tuple[int | None, ...]
    unit: int
    lanes: tuple[int | None, ...]

    @property
    def kind(self) -> str:
        slides = [w is not None for w in self.windows]
        return "sliding" if all(slides) else ("full" if not any(slides) else "headwise")

    def describe(self) -> dict[str, Any]:
        """The group's identity for logs and JSON: index, kind, layers, kv heads, allocation unit."""
        return {
            "index": self.index,
            "kind": self.kind,
            "layers": list(self.layers),
            "num_kv_heads": self.num_kv_heads,
            "unit": self.unit,
        }


def groups_from_plan(plan: AttentionPlan, mode: RecycleMode = "headwise") -> list[LayerGroup]:
    """Group ``plan``'s layers by (kv heads, per-head windows); order of first appearance."""
    if mode not in RECYCLE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {RECYCLE_MODES}")
    keys: dict[tuple, list[int]] = {}
    for layer in plan:
        windows = tuple(layer.head_window(h) for h in range(layer.num_kv_heads))
        keys.setdefault((layer.num_kv_heads, windows), []).append(layer.index)
    groups = []
    for gi, ((hkv, windows), layers) in enumerate(keys.items()):
        uniform = len(set(windows)) == 1
        if mode == "headwise" and not uniform:
            unit, lanes = 1, windows
        else:
            releases = uniform and windows[0] is not None and mode != "none"
            unit, lanes = hkv, (windows[0] if releases else None,)
        groups.append(LayerGroup(gi, tuple(layers), hkv, windows, unit, lanes))
    return groups


@dataclass(frozen=True)
class AllocResult:
    """Outcome of :meth:`HeadwiseKVManager.append`; truthy when ``ok``.

    ``missing`` maps group index -> pages that could not be found (empty when ``ok``).
    """

    ok: bool
    missing: dict[int, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "ok" if self.ok else "insufficient"

    @property
    def missing_pages(self) -> int:
        return sum(self.missing.values())

    def __bool__(self) -> bool:
        return self.ok


_OK = AllocResult(True)


class _Pool:
    """Free allocation units (blocks or pages) of one group, handed out lazily.

    Units ``fresh .. num_units - 1`` have never been used; ``free`` holds the ones given back
    (reused first, last in first out). Construction costs nothing whatever the pool size.
    """

    __slots__ = ("num_units", "free", "fresh", "refs")

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self.free: list[int] = []
        self.fresh = 0
        #: holders beyond the first of a shared unit (prefix caching: cached entries and the
        #: requests served from them); empty without sharing, so ``give`` stays one append
        self.refs: dict[int, int] = {}

    def available(self) -> int:
        return len(self.free) + self.num_units - self.fresh

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.fresh >= self.num_units:  # callers check available() first
            raise RuntimeError("head-wise KV pool: allocation past the checked capacity")
        self.fresh += 1
        return self.fresh - 1

    def give(self, unit: int) -> None:
        """One holder lets go of ``unit``; it is free once no holder is left."""
        extra = self.refs.get(unit)
        if extra:
            if extra == 1:
                del self.refs[unit]
            else:
                self.refs[unit] = extra - 1
            return
        self.free.append(unit)

    def share(self, unit: int) -> None:
        """One more holder of ``unit`` (a held unit: callers never share a free one)."""
        self.refs[unit] = self.refs.get(unit, 0) + 1


class _Lane:
    """Unit ids of one lane by logical block (``-1``: released); ``released`` leading ones gone."""

    __slots__ = ("window", "ids", "released")

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.ids: list[int] = []
        self.released = 0

    def release_target(self, computed: int, block_size: int) -> int:
        if self.window is None:
            return 0
        return max(0, computed - self.window) // block_size

    def next_release_at(self, block_size: int) -> float:
        """Smallest ``computed`` that releases another block."""
        if self.window is None:
            return _INF
        return (self.released + 1) * block_size + self.window


class _Request:
    __slots__ = ("num_tokens", "computed", "lanes", "next_release")

    def __init__(self, groups: Sequence[LayerGroup]) -> None:
        self.num_tokens = 0
        self.computed = 0
        self.lanes = [[_Lane(w) for w in g.lanes] for g in groups]
        self.next_release = _INF


class HeadwiseKVManager:
    """Per-request, per-group, per-kv-head page lists over shared page pools.

    ``num_blocks``: blocks of every layer's cache (int: same for all groups, FastDeploy's
    layout) or per group (sequence / mapping group index -> blocks); group ``g`` has
    ``num_blocks[g] * num_kv_heads`` pages. ``block_size``: tokens per block.
    """

    def __init__(
        self,
        plan: AttentionPlan,
        num_blocks: int | Sequence[int] | Mapping[int, int],
        block_size: int,
        mode: RecycleMode = "headwise",
    ) -> None:
        block_size = _count("block_size", block_size, 1, MAX_TOKENS)
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        self.groups = groups_from_plan(plan, mode)
        if not self.groups:
            raise ValueError(f"plan has no layers: {plan!r}")
        self.mode = mode
        self.block_size = block_size
        ng = len(self.groups)
        if isinstance(num_blocks, Mapping):
            extra = sorted(set(num_blocks) - set(range(ng)), key=repr)
            if extra:
                raise ValueError(f"num_blocks names groups {extra!r}; the plan has groups 0..{ng - 1}")
            lacking = [g for g in range(ng) if g not in num_blocks]
            if lacking:
                raise ValueError(f"num_blocks has no entry for layer group(s) {lacking} (of {ng})")
            blocks = [num_blocks[g] for g in range(ng)]
        elif isinstance(num_blocks, Sequence) and not isinstance(num_blocks, str | bytes):
            if len(num_blocks) != ng:
                raise ValueError(
                    f"num_blocks={list(num_blocks)!r} has {len(num_blocks)} entries; the plan has "
                    f"{ng} layer groups (see groups_from_plan)"
                )
            blocks = list(num_blocks)
        elif isinstance(num_blocks, bool) or not hasattr(num_blocks, "__index__"):
            raise TypeError(
                f"num_blocks={num_blocks!r}: expected an int or one int per layer group, "
                f"got {type(num_blocks).__name__}"
            )
        else:
            blocks = [num_blocks] * ng
        for i, (g, nb) in enumerate(zip(self.groups, blocks, strict=True)):
            blocks[i] = _count(f"num_blocks[{g.index}]", nb, 0, MAX_PAGES // g.num_kv_heads)
        self.num_blocks: list[int] | None = blocks
        self._setup([_Pool(nb * g.num_kv_heads // g.unit) for g, nb in zip(self.groups, blocks, strict=True)])

    @classmethod
    def shared(
        cls, groups: Sequence[LayerGroup], num_pages: int, block_size: int, mode: RecycleMode = "headwise"
    ) -> HeadwiseKVManager:
        """One pool of ``num_pages`` pages for every group and lane (``kvcache/pools.py``,
        :class:`~.pools.PoolLayout`): a lane's logical block takes one page from the same free list
        whichever group it belongs to, and a page a window releases can at once serve any request's
        any group. ``groups``: the layout's groups, all with the same ``unit`` (kv heads per page).
        ``num_blocks`` is ``None`` for such a manager; ``num_pages`` holds the pool size."""
        groups = tuple(groups)
        if not groups or not all(isinstance(g, LayerGroup) for g in groups):
            raise TypeError(
                f"groups={groups!r}: expected a non-empty sequence of LayerGroup (PoolLayout.groups)"
            )
        if len({g.unit for g in groups}) != 1:
            raise ValueError(
                f"groups have units {sorted({g.unit for g in groups})}: one shared pool needs one unit"
            )
        if [g.index for g in groups] != list(range(len(groups))):
            raise ValueError(
                f"groups must be indexed 0..{len(groups) - 1} in order, got {[g.index for g in groups]}"
            )
        if mode not in RECYCLE_MODES:
            raise ValueError(f"mode={mode!r}: expected one of {RECYCLE_MODES}")
        self = cls.__new__(cls)
        self.block_size = _count("block_size", block_size, 1, MAX_TOKENS)
        self.groups = list(groups)
        self.mode = mode
        self.num_blocks = None
        self.num_pages = _count("num_pages", num_pages, 0, MAX_PAGES // groups[0].unit)
        pool = _Pool(self.num_pages)
        self._setup([pool] * len(groups))
        return self

    def _setup(self, pools: list[_Pool]) -> None:
        """Per group, its pool (groups may share one); the distinct pools in first-use order."""
        self._pools = pools
        distinct: list[_Pool] = []
        self._pool_index = []
        for pool in pools:
            if not any(pool is p for p in distinct):
                distinct.append(pool)
            self._pool_index.append(next(i for i, p in enumerate(distinct) if p is pool))
        self._distinct = distinct
        self._pool_unit = [self.groups[self._pool_index.index(i)].unit for i in range(len(distinct))]
        self._reqs: dict[Any, _Request] = {}
        self._layer_group = {li: g.index for g in self.groups for li in g.layers}
        logger.debug(
            "head-wise KV manager, mode %s, %d pool(s): %s",
            self.mode,
            len(distinct),
            [(g.kind, g.layers, g.num_kv_heads, self.group_total_pages(g.index)) for g in self.groups],
        )

    # ---- requests -------------------------------------------------------------------------
    def admit(self, req_id: Any) -> None:
        """Register a request with no tokens (allocation happens in :meth:`append`).

        ``req_id``: any hashable but ``None`` (``None`` marks an empty batch slot in :meth:`tables`).
        """
        if req_id is None:
            raise ValueError("req_id=None: None marks an empty batch slot in tables(); use another id")
        try:
            hash(req_id)
        except TypeError:
            raise _unhashable(req_id) from None
        if req_id in self._reqs:
            raise ValueError(f"req_id={req_id!r} is already admitted")
        self._reqs[req_id] = _Request(self.groups)

    def _req(self, req_id: Any) -> _Request:
        try:
            r = self._reqs.get(req_id)
        except TypeError:
            raise _unhashable(req_id) from None
        if r is None:
            raise ValueError(f"req_id={req_id!r} is not admitted")
        return r

    def __contains__(self, req_id: Any) -> bool:
        try:
            return req_id in self._reqs
        except TypeError:  # unhashable: never admitted
            return False

    @property
    def requests(self) -> list[Any]:
        return list(self._reqs)

    def num_tokens(self, req_id: Any) -> int:
        """Tokens with cache slots (including the ones reserved for the running step)."""
        return self._req(req_id).num_tokens

    def reserve(self, req_id: Any, target_tokens: int, computed: int) -> AllocResult:
        """Give every lane of every group slots for ``target_tokens`` tokens, after releasing the
        pages no query at position ``computed`` or later can see.

        ``computed``: tokens before the earliest query that may still run (FastDeploy: the
        request's ``num_computed_tokens`` BEFORE this step's chunk, since a scheduled chunk counts
        as computed while it has not run, and the worker may lag); at most the tokens held after
        the call. A target below the tokens already held allocates nothing (slots never shrink).
        On ``insufficient`` nothing changes (no release, no allocation).
        """
        r = self._req(req_id)
        new_n = max(r.num_tokens, _count("target_tokens", target_tokens))
        c = self._computed(req_id, r, computed, new_n)
        bs = self.block_size
        have = -(-r.num_tokens // bs)
        need = -(-new_n // bs)
        if need == have and c < r.next_release:  # fast path: nothing to free or allocate
            r.num_tokens, r.computed = new_n, c
            return _OK
        missing = self._missing(r, c, need)
        if missing:
            return AllocResult(False, missing)
        self._apply(r, c, need)
        r.num_tokens = new_n
        return _OK

    def can_reserve(self, req_id: Any, target_tokens: int, computed: int) -> AllocResult:
        """Dry run of :meth:`reserve`: would it succeed now? Changes nothing."""
        r = self._req(req_id)
        new_n = max(r.num_tokens, _count("target_tokens", target_tokens))
        c = self._computed(req_id, r, computed, new_n)
        missing = self._missing(r, c, -(-new_n // self.block_size))
        return AllocResult(not missing, missing)

    def append(self, req_id: Any, n_tokens: int, computed: int) -> AllocResult:
        """:meth:`reserve` for ``n_tokens`` more tokens than the request holds."""
        r = self._req(req_id)
        return self.reserve(req_id, r.num_tokens + self._n_tokens(r, n_tokens), computed)

    def can_append(self, req_id: Any, n_tokens: int, computed: int) -> AllocResult:
        """Dry run of :meth:`append`."""
        r = self._req(req_id)
        return self.can_reserve(req_id, r.num_tokens + self._n_tokens(r, n_tokens), computed)

    def _n_tokens(self, r: _Request, n_tokens: Any) -> int:
        n = _count("n_tokens", n_tokens)
        if r.num_tokens + n > MAX_TOKENS:
            raise ValueError(
                f"n_tokens={n_tokens!r}: the request would hold {r.num_tokens + n} tokens, "
                f"more than MAX_TOKENS={MAX_TOKENS}"
            )
        return n

    def release(self, req_id: Any, computed: int) -> int:
        """Release the pages no query at position ``computed`` or later can see (``computed`` as
        in :meth:`reserve`, at most the tokens held). Returns the number of pages released."""
        r = self._req(req_id)
        c = self._computed(req_id, r, computed, r.num_tokens)
        if c < r.next_release:  # fast path: no block left every window yet
            r.computed = c
            return 0
        before = self.free_pages
        self._apply(r, c, None)
        return self.free_pages - before

    @staticmethod
    def _computed(req_id: Any, r: _Request, computed: Any, hi: int) -> int:
        """``computed`` as an int in ``[r.computed, hi]``: the bound never moves backwards for one
        incarnation of a request (pages released up to the last bound cannot come back; a lower
        bound means the caller's count is wrong). :meth:`preempt` restarts it from 0."""
        c = _count("computed", computed, 0, hi)
        if c < r.computed:
            raise ValueError(
                f"computed={computed!r} for req_id={req_id!r} is below its last computed bound "
                f"{r.computed}: the bound never moves backwards (preempt() restarts a request)"
            )
        return c

    def next_release(self, req_id: Any) -> float:
        """The smallest ``computed`` bound at which ``req_id`` releases another block (``inf``:
        never, e.g. only full lanes): schedulers skip :meth:`release` below it."""
        return self._req(req_id).next_release

    def computed(self, req_id: Any) -> int:
        """The largest ``computed`` bound given for the request so far."""
        return self._req(req_id).computed

    def admit_served(self, req_id: Any, ids: Sequence[Sequence[Sequence[int]]], tokens: int) -> None:
        """Admit a request served ``tokens`` cached tokens (prefix caching): ``ids[g][j]`` are lane
        ``j`` of group ``g``'s units of the first ``tokens // block_size`` blocks, ``-1`` for the
        blocks below the lane's window at ``tokens`` (``kvcache/prefix.py``: exactly the blocks the
        release rule gives back at computed bound ``tokens``, so the request starts in the state it
        would be in had it computed them). Each unit gains one holder; the request's computed bound
        and held tokens are ``tokens``."""
        bs = self.block_size
        tokens = _count("tokens", tokens)
        if tokens % bs:
            raise ValueError(f"tokens={tokens!r}: expected a multiple of block_size={bs}")
        self.admit(req_id)
        r = self._reqs[req_id]
        m = tokens // bs
        if len(ids) != len(self.groups):
            raise ValueError(f"ids has {len(ids)} groups, the manager {len(self.groups)}")
        nxt = _INF
        for gi, (lanes, gids, pool) in enumerate(zip(r.lanes, ids, self._pools, strict=True)):
            if len(gids) != len(lanes):
                raise ValueError(f"ids[{gi}] has {len(gids)} lanes, group {gi} has {len(lanes)}")
            for j, (lane, lids) in enumerate(zip(lanes, gids, strict=True)):
                lo = lane.release_target(tokens, bs)
                row = list(lids)
                if len(row) != m:
                    raise ValueError(f"ids[{gi}][{j}] has {len(row)} blocks, tokens={tokens} needs {m}")
                for k, u in enumerate(row):
                    if k < lo:
                        row[k] = -1
                    elif u < 0:
                        del self._reqs[req_id]
                        raise ValueError(
                            f"ids[{gi}][{j}][{k}] is -1 but the window at {tokens} tokens needs block {k}"
                        )
                for u in row:
                    if u >= 0:
                        pool.share(u)
                lane.ids = row
                lane.released = lo
                nxt = min(nxt, lane.next_release_at(bs))
        r.num_tokens = r.computed = tokens
        r.next_release = nxt

    def detach(self, req_id: Any, group: int, lane: int, block: int) -> int:
        """Take ``req_id``'s unit of ``block`` on ``lane`` of ``group`` out of its lane without
        freeing it (its holder becomes the caller, e.g. a cached prefix entry); ``-1`` if none."""
        ids = self._req(req_id).lanes[group][lane].ids
        if block >= len(ids):
            return -1
        u = ids[block]
        ids[block] = -1
        return u

    def units_at(self, req_id: Any, block: int) -> list[list[int]]:
        """``req_id``'s unit of logical ``block`` per group and lane (``-1``: none), cheaply."""
        return [
            [lane.ids[block] if block < len(lane.ids) else -1 for lane in lanes]
            for lanes in self._req(req_id).lanes
        ]

    def share_unit(self, group: int, unit: int) -> None:
        """One more holder of ``unit`` of ``group``'s pool."""
        self._pools[group].share(unit)

    def give_unit(self, group: int, unit: int) -> None:
        """One holder of ``unit`` of ``group``'s pool lets go (free at the last)."""
        self._pools[group].give(unit)

    def holders(self, group: int, unit: int) -> int:
        """How many holders ``unit`` of ``group``'s pool has beyond the first."""
        return self._pools[group].refs.get(unit, 0)

    def finish(self, req_id: Any) -> None:
        """Free every page of the request and forget it."""
        self._free_all(self._req(req_id))
        del self._reqs[req_id]

    def preempt(self, req_id: Any) -> None:
        """Free every page; the request stays admitted with zero tokens (it will recompute)."""
        r = self._req(req_id)
        self._free_all(r)
        self._reqs[req_id] = _Request(self.groups)

    # ---- internals ------------------------------------------------------------------------
    def _missing(self, r: _Request, computed: int, need: int) -> dict[int, int]:
        """Pages per pool that releasing up to ``computed`` and growing to ``need`` blocks lacks
        (exactly what :meth:`_apply` would take from and give back to each pool). Pools are
        numbered like the groups when each group has its own, ``0`` for a shared one."""
        bs = self.block_size
        demand = [0] * len(self._distinct)
        for lanes, pi in zip(r.lanes, self._pool_index, strict=True):
            d = 0
            refs = self._distinct[pi].refs
            for lane in lanes:
                target = lane.release_target(computed, bs)
                have = len(lane.ids)
                top = min(target, have)
                if refs:  # a shared unit released by one holder stays with the others
                    ids = lane.ids
                    d -= sum(1 for k in range(lane.released, top) if ids[k] >= 0 and ids[k] not in refs)
                else:
                    d -= max(0, top - lane.released)  # pages given back
                d += max(0, need - max(have, target))  # pages taken
            demand[pi] += d
        missing = {}
        for pi, d in enumerate(demand):
            short = d - self._distinct[pi].available()
            if short > 0:
                missing[pi] = short * self._pool_unit[pi]
        return missing

    def _apply(self, r: _Request, computed: int, need: int | None) -> None:
        """Release up to ``computed`` in every group, THEN grow every lane to ``need`` blocks
        (the caller checked with :meth:`_missing` that the pools hold enough)."""
        bs = self.block_size
        nxt = _INF
        for lanes, pool in zip(r.lanes, self._pools, strict=True):
            for lane in lanes:
                target = lane.release_target(computed, bs)
                ids = lane.ids
                while lane.released < target:
                    k = lane.released
                    if k < len(ids):
                        pool.give(ids[k])
                        ids[k] = -1
                    else:  # never allocated and already out of the window
                        ids.append(-1)
                    lane.released += 1
                nxt = min(nxt, lane.next_release_at(bs))
        if need is not None:
            for lanes, pool in zip(r.lanes, self._pools, strict=True):
                for lane in lanes:
                    ids = lane.ids
                    while len(ids) < need:
                        ids.append(pool.take())
        r.computed = computed
        r.next_release = nxt

    def _free_all(self, r: _Request) -> None:
        for lanes, pool in zip(r.lanes, self._pools, strict=True):
            for lane in lanes:
                if pool.refs:
                    for u in lane.ids:
                        if u >= 0:
                            pool.give(u)
                else:
                    pool.free.extend(u for u in lane.ids if u >= 0)
                lane.ids = []

    # ---- counters -------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        """Pages of every pool (head pages: a unit of ``unit`` kv heads counts ``unit`` pages)."""
        return sum(p.num_units * u for p, u in zip(self._distinct, self._pool_unit, strict=True))

    @property
    def free_pages(self) -> int:
        return sum(p.available() * u for p, u in zip(self._distinct, self._pool_unit, strict=True))

    @property
    def free_units(self) -> int:
        """Free allocation units of every pool (a shared pool's pages)."""
        return sum(p.available() for p in self._distinct)

    @property
    def total_units(self) -> int:
        return sum(p.num_units for p in self._distinct)

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages

    def group_free_pages(self, group: int) -> int:
        return self._pools[self._group(group)].available() * self.groups[group].unit

    def group_total_pages(self, group: int) -> int:
        return self._pools[self._group(group)].num_units * self.groups[group].unit

    def _group(self, group: Any) -> int:
        return _count("group", group, 0, len(self.groups) - 1)

    def request_pages(self, req_id: Any) -> dict[int, int]:
        """Pages held by ``req_id`` per group."""
        r = self._req(req_id)
        return {
            g.index: sum(1 for lane in lanes for u in lane.ids if u >= 0) * g.unit
            for g, lanes in zip(self.groups, r.lanes, strict=True)
        }

    def releasing_windows(self, req_id: Any) -> frozenset[int]:
        """The windows whose lanes have given pages back for ``req_id``: from then on they release
        a block for every block they take (lanes of one window release together)."""
        return frozenset(
            lane.window for lanes in self._req(req_id).lanes for lane in lanes if lane.released > 0
        )

    def lane_ids(self, req_id: Any) -> list[list[list[int]]]:
        """Copies of ``req_id``'s unit ids ``[group][lane][logical block]`` (``-1``: released);
        a unit is a block of the group's cache (whole-block groups) or a page (head-wise)."""
        return [[list(lane.ids) for lane in lanes] for lanes in self._req(req_id).lanes]

    def held_pages(self, num_tokens: int, computed: int | None = None) -> dict[int, int]:
        """Pages per group one request holds with ``num_tokens`` cached once every query before
        ``computed`` (default ``num_tokens``) has run: the release rule in closed form, for
        schedulers that reserve room for future tokens. Touches no state."""
        units = held_units(self.groups, self.block_size, num_tokens, computed)
        return {g.index: n * g.unit for g, n in zip(self.groups, units, strict=True)}

    def stats(self) -> dict[str, Any]:
        """Counters for logs/metrics: totals and per group."""
        return {
            "mode": self.mode,
            "total_pages": self.total_pages,
            "free_pages": self.free_pages,
            "used_pages": self.used_pages,
            "requests": len(self._reqs),
            "groups": [
                {
                    **g.describe(),
                    "total_pages": self.group_total_pages(g.index),
                    "free_pages": self.group_free_pages(g.index),
                }
                for g in self.groups
            ],
        }

    # ---- tables ---------------------------------------------------------------------------
    def head_pages(self, req_id: Any, group: int, head: int) -> list[int]:
        """Page ids of ``req_id``'s kv ``head`` in ``group`` by logical block (``-1``: absent)."""
        g = self.groups[self._group(group)]
        lanes = self._req(req_id).lanes[group]
        head = _count("head", head, 0, g.num_kv_heads - 1)
        if g.unit == 1:
            return list(lanes[head].ids)
        unit = g.unit  # lane ``head // unit`` holds units of ``unit`` heads: page ``u * unit + head % unit``
        return [u * unit + head % unit if u >= 0 else -1 for u in lanes[head // unit].ids]

    def _slots(self, req_ids: Iterable[Any]) -> list[_Request | None]:
        if isinstance(req_ids, str | bytes) or not isinstance(req_ids, Iterable):
            raise TypeError(f"req_ids={req_ids!r}: expected a sequence of request ids (None: empty slot)")
        return [None if q is None else self._req(q) for q in req_ids]

    def group_tables(self, req_ids: Iterable[Any], max_pages: int | None = None) -> dict[int, Any]:
        """``{group index: int32 [bsz * Hkv, max_pages]}``; row ``b * Hkv + h``, ``-1`` absent.

        A ``None`` in ``req_ids`` is an empty batch slot (rows of ``-1``), for hosts with fixed slots.
        """
        import numpy as np

        reqs = self._slots(req_ids)
        width = max((len(lanes[0].ids) for r in reqs if r for lanes in r.lanes), default=0)
        if max_pages is None:
            max_pages = width
        elif _count("max_pages", max_pages) < width:
            raise ValueError(f"max_pages={max_pages!r}: expected an int >= {width} (longest page list)")
        out = {}
        for g in self.groups:
            hkv = g.num_kv_heads
            t = np.full((len(reqs) * hkv, max_pages), -1, dtype=np.int32)
            for b, r in enumerate(reqs):
                if r is None:
                    continue
                unit = g.unit  # lane j: heads [j * unit, (j + 1) * unit), page u * unit + head % unit
                for j, lane in enumerate(r.lanes[g.index]):
                    ids = np.asarray(lane.ids, dtype=np.int64)
                    rows = np.where(ids[None, :] >= 0, ids[None, :] * unit + np.arange(unit)[:, None], -1)
                    t[b * hkv + j * unit : b * hkv + (j + 1) * unit, : len(ids)] = rows
            out[g.index] = t
        return out

    def tables(self, req_ids: Iterable[Any], max_pages: int | None = None) -> dict[int, Any]:
        """``{layer index: int32 [bsz * Hkv_layer, max_pages]}`` for ``BatchMeta.block_tables_headwise``.

        Layers of one group share one array object.
        """
        per_group = self.group_tables(req_ids, max_pages)
        return {li: per_group[gi] for li, gi in self._layer_group.items()}

    def block_tables(self, req_ids: Iterable[Any], max_blocks: int | None = None) -> dict[int, Any]:
        """``{layer index: int32 [bsz, max_blocks]}`` block ids for whole-block groups only
        (``None`` in ``req_ids``: an empty slot)."""
        import numpy as np

        reqs = self._slots(req_ids)
        width = max((len(lanes[0].ids) for r in reqs if r for lanes in r.lanes), default=0)
        if max_blocks is None:
            max_blocks = width
        elif _count("max_blocks", max_blocks) < width:
            raise ValueError(f"max_blocks={max_blocks!r}: expected an int >= {width} (longest block list)")
        out = {}
        for g in self.groups:
            if g.unit != g.num_kv_heads:
                continue
            t = np.full((len(reqs), max_blocks), -1, dtype=np.int32)
            for b, r in enumerate(reqs):
                if r is not None:
                    ids = r.lanes[g.index][0].ids
                    t[b, : len(ids)] = ids
            for li in g.layers:
                out[li] = t
        return out


def held_units(
    groups: Sequence[LayerGroup], block_size: int, num_tokens: int, computed: int | None = None
) -> list[int]:
    """Units per group one request holds with ``num_tokens`` cached once every query before
    ``computed`` (default ``num_tokens``) has run: the release rule in closed form (a lane with
    ``window_left = w`` has given back its first ``max(0, computed - w) // block_size`` blocks,
    a full lane none). The manager (:meth:`HeadwiseKVManager.held_pages`), the pool arithmetic
    (``kvcache/pools.py``) and ``fdfleet plan`` all count with this."""
    num_tokens = _count("num_tokens", num_tokens)
    c = num_tokens if computed is None else _count("computed", computed, 0, num_tokens)
    bs = _count("block_size", block_size, 1)
    blocks = -(-num_tokens // bs)
    return [
        sum(blocks if w is None else blocks - min(blocks, max(0, c - w) // bs) for w in g.lanes)
        for g in groups
    ]


def pool_demand(
    groups: Sequence[LayerGroup],
    block_size: int,
    context_len: int,
    max_batched_tokens: int = 0,
    lookahead_tokens: int = 0,
) -> tuple[list[float], list[float]]:
    """Blocks per group ``(per_request, transient)``: what one request at ``context_len`` tokens
    holds, and what a step's prefill chunks (``max_batched_tokens`` in all) hold on top.

    A full lane holds ``ceil((context_len + lookahead_tokens) / bs)`` blocks (FastDeploy's
    decode look-ahead is not capped at ``max_model_len``); a releasing lane at most
    ``ceil((W + lookahead_tokens) / bs) + 2`` (window plus the partial blocks at both ends, plus
    what a scheduler allocates ahead of the computed tokens: FastDeploy's decode look-ahead is up
    to 2 blocks + 12 tokens), and ``ceil(max_batched_tokens / bs)`` more while a chunk runs. A
    head-wise group counts each lane as ``1 / num_kv_heads`` of a block.
    """
    groups = list(groups)
    if not groups or not all(isinstance(g, LayerGroup) for g in groups):
        raise TypeError(f"groups={groups!r}: expected a non-empty list of LayerGroup (groups_from_plan)")
    block_size = _count("block_size", block_size, 1)
    context_len = _count("context_len", context_len, 1)
    max_batched_tokens = _count("max_batched_tokens", max_batched_tokens)
    lookahead_tokens = _count("lookahead_tokens", lookahead_tokens)
    per_req, trans = [], []
    full_blocks = -(-(context_len + lookahead_tokens) // block_size)
    for g in groups:
        share = g.unit / g.num_kv_heads  # blocks' worth per lane
        pr = tr = 0.0
        for w in g.lanes:
            if w is None:
                pr += full_blocks * share
            else:
                pr += min(full_blocks, -(-(w + lookahead_tokens) // block_size) + 2) * share
                tr += -(-max_batched_tokens // block_size) * share
        per_req.append(pr)
        trans.append(tr)
    return per_req, trans


def size_pools(
    groups: Sequence[LayerGroup],
    budget_bytes: int,
    block_bytes: Mapping[int, int],
    block_size: int,
    context_len: int,
    max_batched_tokens: int = 0,
    lookahead_tokens: int = 0,
) -> list[int]:
    """Split ``budget_bytes`` of KV memory into blocks per group (static sizing).

    ``block_bytes[g]``: bytes of one block over all of group ``g``'s layers (K and V, all heads).
    Per-request and transient blocks per group come from :func:`pool_demand`. The split makes
    every group run out at the same concurrency ``N``: ``blocks_g = N * per_request_g +
    transient_g``. Without releasing lanes it is FastDeploy's uniform ``num_blocks``.
    (``kvcache/pools.py`` ``split_kv_pools`` is the serving-side split built on this.)
    """
    import math

    groups = list(groups)
    per_req, trans = pool_demand(groups, block_size, context_len, max_batched_tokens, lookahead_tokens)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | float):
        raise TypeError(f"budget_bytes={budget_bytes!r}: expected a number of bytes")
    if not math.isfinite(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r}: expected a finite number > 0")
    if not isinstance(block_bytes, Mapping):
        raise TypeError(f"block_bytes={block_bytes!r}: expected a mapping group index -> bytes per block")
    for g in groups:
        if g.index not in block_bytes:
            raise ValueError(f"block_bytes has no entry for group {g.index} (keys {sorted(block_bytes)})")
        _count(f"block_bytes[{g.index}]", block_bytes[g.index], 1, 2**62)
    fixed = sum(block_bytes[g.index] * t for g, t in zip(groups, trans, strict=True))
    per_n = sum(block_bytes[g.index] * p for g, p in zip(groups, per_req, strict=True))
    if budget_bytes <= fixed or per_n <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r}: too small for the transient prefill pages")
    n = (budget_bytes - fixed) / per_n
    blocks = [int(n * p + t) for p, t in zip(per_req, trans, strict=True)]
    check_pool_pages(groups, blocks, f"budget_bytes={budget_bytes!r}")
    return blocks


def check_pool_pages(groups: Sequence[LayerGroup], blocks: Sequence[int], why: str) -> None:
    """Refuse a group whose pool would hold more than ``MAX_PAGES`` pages (int32 page ids)."""
    for g, nb in zip(groups, blocks, strict=True):
        if nb * g.num_kv_heads > MAX_PAGES:
            raise ValueError(
                f"{why} gives group {g.index} {nb} blocks x {g.num_kv_heads} kv heads, "
                f"more than MAX_PAGES={MAX_PAGES} pages (int32 page ids); use a larger block_size"
            )
