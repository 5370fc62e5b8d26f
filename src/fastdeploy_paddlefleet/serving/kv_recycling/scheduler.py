"""Window recycling inside FastDeploy's own scheduler (engine side), on ONE shared KV pool.

FastDeploy's ``ResourceManagerV1.schedule()`` keeps running unchanged; :func:`install` patches the
few places where it touches KV blocks so they go to a :class:`HeadwiseKVManager` over the one pool
of ``kvcache/pools.py`` (every group and lane draws pages from one free list) instead of
``PrefixCacheManager``'s single free list, for a PaddleFleet model whose plan has sliding layers or
heads:

* ``ResourceManagerV1.__init__``: :func:`decide` reads the FastDeploy config; when recycling
  applies, the instance gets a :class:`KVRecycler` (attribute :data:`RECYCLER_ATTR`) sized on
  FastDeploy's placeholder count (it builds the scheduler before profiling) without refusing
  anything, and its ``cache_manager.can_allocate_gpu_blocks`` answers from the pool. Every other
  model keeps FastDeploy's behaviour exactly (the patched methods call the originals).
* ``reset_cache_config`` (after profiling): the pool is rebuilt for the profiled count; a count too
  small for one ``max_model_len`` request is refused in FastDeploy's own words (never a count
  FastDeploy itself accepts).
* ``_allocate_gpu_blocks(request, n)``: ``reserve(request, (len(block_tables) + n) * block_size,
  computed=request.num_computed_tokens)``. At that call FastDeploy has already set a decoding
  request's ``num_computed_tokens`` to ``num_total_tokens - 1`` and has not yet added a prefill
  chunk to it, so the bound is the first query that may still run: scheduled chunks count as
  computed only from the next step on, and the look-ahead (2 blocks + 12 slots) is never counted.
* ``_free_blocks(request)``: the whole request (finish, abort, preemption all pass here).
* ``schedule()``: before FastDeploy's schedule, every running request releases the pages that
  left every window up to what is known computed (decoding: ``num_total_tokens - 1``;
  prefilling: ``num_computed_tokens``, whose chunks run in earlier batches), so FastDeploy sees
  the true free count; after it, each prefill / decode task gets the request's
  :class:`KVDelta` (``protocol.TASK_ATTR``), and a request with changes but no task gets a
  decode task carrying them (FastDeploy itself sends decode tasks only when it allocates).
* FastDeploy's V0 scheduler (``ENABLE_V1_KVCACHE_SCHEDULER=0``, the base ``ResourceManager``) is
  refused by name when recycling would apply: its accounting cannot be reached.

Admission is FastDeploy's own threshold (the chunk's blocks plus a decode reserve for every
running request, ``_get_can_schedule_prefill_threshold_block``, wrapped to record those parts),
asked of the pool by what the requests will hold: the chunk at most ``cap`` per sliding lane
(window + one step's tokens + look-ahead), each reserve on every full lane and on every sliding
lane that has not begun to release (a lane that releases gives a page back for each it takes).
Never on worse terms than FastDeploy's own pool, never by ``max_model_len``. Any other
``can_allocate_gpu_blocks(n)`` (one request's allocation) needs ``n`` pages per full lane and
``min(n, cap)`` per sliding lane; FastDeploy allocates at most ``n`` blocks after asking about
``n``, so an allocation it was promised always succeeds (checked: :class:`KVRecycler` raises
rather than over-commit).

Interactions (:func:`decide`): FastDeploy's prefix caching is served window-aware
(``prefix_cache.py``, ``docs/prefix_caching.md``; refused by name for a multimodal model); recompute
preemption, chunked
prefill and tensor parallelism (lanes merged over ranks) are handled; PD disaggregation
(``splitwise_role`` other than ``mixed``), CPU swap / KV storage, speculative decoding / MTP,
``FD_PD_REORDER``, FastDeploy's cache manager v1 and extend tables are refused by name
(``FDFLEET_KV_RECYCLE=off`` serves them without recycling).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...envs import kv_recycle
from ...kvcache.headwise import HeadwiseKVManager
from ...kvcache.pools import admission_pages, allocation_cap, min_gpu_blocks, pages_needed
from ...plan.layer import AttentionPlan
from .._fields import field
from ..names import wants_paddlefleet as _wants_paddlefleet
from .prefix_cache import PrefixCache
from .protocol import TASK_ATTR, KVDelta, RecyclingLayout, layout_from_plans, merge_tp_plans

logger = logging.getLogger(__name__)

#: the ResourceManagerV1 attribute holding its KVRecycler (None: FastDeploy's own accounting)
RECYCLER_ATTR = "_fdfleet_kv_recycler"
_PATCHED = "_fdfleet_kv_recycling_patched"
_MODULE = "fastdeploy.engine.sched.resource_manager_v1"
#: the ResourceManagerV1 methods the hook wraps (FastDeploy c1b7c083d)
_HOOKED = (
    "__init__",
    "_allocate_gpu_blocks",
    "_free_blocks",
    "schedule",
    "reset_cache_config",
    "available_block_num",
    "get_gpu_cache_usage_perc",
    "_is_decoding",
    "_prepare_decode_task",
    "_get_can_schedule_prefill_threshold_block",
)


@dataclass(frozen=True)
class RecyclingSetup:
    """What :func:`decide` found: the plan every TP rank agrees on and FastDeploy's settings."""

    plan: AttentionPlan
    layout: RecyclingLayout
    max_model_len: int
    max_num_batched_tokens: int


def _int(obj: Any, name: str, default: int) -> int:
    value = field(obj, name)
    return default if value is None else int(value)


def _refusals(fd_config: Any, environ: Mapping[str, str]) -> list[str]:
    """Settings window recycling cannot serve, each named with its value and why."""
    cache = field(fd_config, "cache_config")
    sched = field(fd_config, "scheduler_config")
    spec = field(fd_config, "speculative_config")
    out = []
    role = field(sched, "splitwise_role") or "mixed"
    if role != "mixed":
        out.append(
            f"splitwise_role={role!r}: PD disaggregation hands block tables between instances, "
            "per-lane tables are not transferred"
        )
    cpu = field(cache, "num_cpu_blocks") or 0
    if cpu or field(cache, "swap_space"):
        out.append(
            f"CPU swap (swap_space={field(cache, 'swap_space')!r}, num_cpu_blocks={cpu}): swapped "
            "blocks follow FastDeploy's one table, not the lanes"
        )
    if field(cache, "kvcache_storage_backend"):
        out.append(
            f"kvcache_storage_backend={field(cache, 'kvcache_storage_backend')!r}: stored blocks "
            "follow FastDeploy's one table"
        )
    if field(cache, "enable_prefix_caching") and field(field(fd_config, "model_config"), "enable_mm"):
        out.append(
            "enable_prefix_caching with a multimodal model (model_config.enable_mm=True): multimodal "
            "hash keys and chunked-input reverts are not matched window-aware "
            "(pass --no-enable-prefix-caching)"
        )
    if field(spec, "method") is not None:
        out.append(
            f"speculative_config.method={field(spec, 'method')!r} (MTP / speculative decoding): draft "
            "tokens and MTP layers' caches are not planned by the lanes"
        )
    for name in ("FD_PD_REORDER", "ENABLE_V1_KVCACHE_MANAGER"):
        value = str(environ.get(name, 0)).strip()
        if value not in ("", "0"):
            why = (
                "the worker reorders batch rows, per-group tables would not follow"
                if name == "FD_PD_REORDER"
                else "FastDeploy's cache manager v1 is not routed through the hook"
            )
            out.append(f"{name}={value!r}: {why}")
    if str(environ.get("ENABLE_V1_KVCACHE_SCHEDULER", 1)).strip() == "0":
        out.append("ENABLE_V1_KVCACHE_SCHEDULER=0: the hook lives in ResourceManagerV1")
    return out


_FD_SWITCHES = ("FD_PD_REORDER", "ENABLE_V1_KVCACHE_MANAGER", "ENABLE_V1_KVCACHE_SCHEDULER")


def fastdeploy_switches() -> dict[str, Any]:
    """FastDeploy's own switches as FastDeploy sees them: ``fastdeploy.envs`` (which FastDeploy
    overrides at run time, e.g. V1 scheduling off on unsupported platforms), else the environment."""
    try:
        import fastdeploy.envs as fd_envs
    except Exception:  # noqa: BLE001 - no FastDeploy: the raw environment
        fd_envs = None
    out = {}
    for name in _FD_SWITCHES:
        value = getattr(fd_envs, name, None) if fd_envs is not None else None
        out[name] = os.environ.get(name) if value is None else value
    return {k: v for k, v in out.items() if v is not None}


def wants_paddlefleet(fd_config: Any) -> bool:
    """Whether ``--model-impl paddlefleet`` serves this config (the plugin's own routing rule)."""
    return _wants_paddlefleet(field(fd_config, "model_config"))


def decide(
    fd_config: Any, environ: Mapping[str, Any] | None = None, *, warn: bool = True
) -> RecyclingSetup | None:
    """Whether window recycling runs for ``fd_config``, and with what (``None``: FastDeploy's own
    accounting). ``ValueError`` naming each setting it cannot serve; prefix caching stays on
    (window-aware). The worker calls this too, so both sides agree.
    ``environ``: FastDeploy's switches (default :func:`fastdeploy_switches`). ``warn``: kept for
    callers (the worker passes False); nothing is warned about any more."""
    if not wants_paddlefleet(fd_config):
        return None
    if kv_recycle() == "off":
        logger.info("FDFLEET_KV_RECYCLE=off: every layer keeps every block (FastDeploy's accounting)")
        return None
    from ...plan import plan_from_config

    mc = field(fd_config, "model_config")
    cache = field(fd_config, "cache_config")
    sched = field(fd_config, "scheduler_config")
    model_dir = field(mc, "model")
    if not model_dir:
        raise ValueError(f"fd_config.model_config.model must name the model directory, got {model_dir!r}")
    tp = _int(field(fd_config, "parallel_config"), "tensor_parallel_size", 1)
    plans = [plan_from_config(str(model_dir), tp_size=tp, tp_rank=r) for r in range(tp)]
    plan = merge_tp_plans(plans)
    layout = layout_from_plans(plan, _int(cache, "block_size", 64))
    if not layout.slides:
        logger.info("window recycling: the plan of %s has no lane that slides on every rank", model_dir)
        return None
    refused = _refusals(fd_config, fastdeploy_switches() if environ is None else environ)
    if not install():
        refused.append(
            f"FastDeploy's {_MODULE}.ResourceManagerV1 cannot take the hook (missing or other methods "
            f"than {', '.join(_HOOKED)})"
        )
    if refused:
        raise ValueError(
            "window recycling (FDFLEET_KV_RECYCLE=auto, the plan of "
            f"{model_dir} has sliding windows) cannot serve: "
            + "; ".join(refused)
            + ". Set FDFLEET_KV_RECYCLE=off to serve this model without recycling"
        )
    if field(cache, "enable_prefix_caching"):
        logger.debug("window recycling with window-aware prefix caching (docs/prefix_caching.md)")
    return RecyclingSetup(
        plan=plan,
        layout=layout,
        max_model_len=_int(mc, "max_model_len", 2048),
        max_num_batched_tokens=_int(sched, "max_num_batched_tokens", 0),
    )


def fastdeploy_pool_refusal(num_gpu_blocks: int, needed: int) -> str:
    """FastDeploy's own words for a pool too small for one ``max_model_len`` request
    (``CacheConfig.reset``, c1b7c083d ``config.py``)."""
    return (
        f"current device block num: {num_gpu_blocks} should be larger than or equal to {needed}, please "
        "reduce the max_model_len or replace the machine with larger GPU cards"
    )


class KVRecycler:
    """The one pool behind one ``ResourceManagerV1`` and the deltas it owes the worker.

    ``num_gpu_blocks``: FastDeploy's block count (``cache_manager.num_gpu_blocks``); the pool holds
    ``layout.pool.num_pages(num_gpu_blocks)`` pages. ``placeholder``: FastDeploy's count before
    profiling (``EngineService`` builds the scheduler first and calls ``reset_cache_config`` once
    the worker has measured the memory): nothing is refused then. After profiling a count too small
    for one ``max_model_len`` request is refused in FastDeploy's own words (never a count
    FastDeploy accepts: :func:`~...kvcache.pools.min_gpu_blocks`).
    """

    def __init__(
        self, setup: RecyclingSetup, num_gpu_blocks: int, block_size: int, *, placeholder: bool
    ) -> None:
        pool = setup.layout.pool
        if int(block_size) != pool.block_size:
            raise ValueError(
                f"block_size={block_size!r}: the recycling layout was planned for "
                f"block_size={pool.block_size}"
            )
        self.setup = setup
        self.layout = setup.layout
        self.block_size = int(block_size)
        self.num_gpu_blocks = int(num_gpu_blocks)
        self.placeholder = placeholder
        needed = min_gpu_blocks(pool, setup.max_model_len, setup.max_num_batched_tokens or None)
        if not placeholder and self.num_gpu_blocks < needed:
            raise ValueError(
                fastdeploy_pool_refusal(self.num_gpu_blocks, needed)
                + f" (window recycling, max_model_len={setup.max_model_len})"
            )
        self.num_pages = pool.num_pages(self.num_gpu_blocks)
        self.manager = HeadwiseKVManager.shared(pool.groups, self.num_pages, self.block_size, pool.mode)
        self._seq: dict[str, int] = {}
        self._sent: dict[str, list[list[list[int]]]] = {}
        self._pending: dict[str, tuple[bool, list[tuple[int, int, int, int]]]] = {}
        self._due: dict[str, float] = {}  # rid -> computed bound of its next release
        #: window-aware prefix caching (FastDeploy's enable_prefix_caching), set by the hook
        self.prefix: PrefixCache | None = None
        #: the admission threshold FastDeploy computed last and its parts (``expect_threshold``)
        self._threshold: tuple[int, tuple[int, list[int]] | None] | None = None
        # the most pages one allocation can take on a sliding lane: window + one step + look-ahead
        self._caps = [
            [
                None if w is None else allocation_cap(w, self.block_size, setup.max_num_batched_tokens)
                for w in g.lanes
            ]
            for g in pool.groups
        ]
        logger.info(
            "paddlefleet window recycling: %d FastDeploy blocks -> one pool of %d pages (%d groups, %d "
            "pages per FastDeploy block)%s",
            self.num_gpu_blocks,
            self.num_pages,
            len(pool.groups),
            pool.pages_per_block,
            " (placeholder until profiling)" if placeholder else "",
        )

    # ---- what FastDeploy asks ------------------------------------------------------------
    def can_allocate(self, num_blocks: int, *args: Any, **kwargs: Any) -> bool:
        """FastDeploy's ``can_allocate_gpu_blocks(n)`` (no release credit). A prefill admission
        threshold whose parts :meth:`expect_threshold` recorded is priced by them
        (``pools.admission_pages``: the chunk, and each running request's decode reserve, which a
        sliding lane that already releases does not need); one whose parts do not add up at FastDeploy's
        own price (``n`` pages per lane); any other ``n`` (one request's allocation) as ``n`` pages
        per full lane and at most ``cap`` per sliding lane (``pools.pages_needed``)."""
        pool = self.layout.pool
        expected, self._threshold = self._threshold, None
        n = max(0, int(num_blocks))
        if expected is not None and expected[0] == n:
            parts = expected[1]
            if parts is None:
                need = n * pool.pages_per_block
            else:
                need = admission_pages(pool, parts[0], parts[1], self._caps)
        else:
            need = pages_needed(pool, n, self._caps)
        prefix = self.prefix
        if prefix is not None and need > self.manager.free_units:
            try_free = args[0] if args else kwargs.get("try_free_gpu_blocks", True)
            if try_free:  # cached units nobody runs on are available: evict FastDeploy's LRU leaves
                prefix.evict(need)
        return need <= self.manager.free_units

    def expect_threshold(
        self, threshold: int, chunk_blocks: int, reserves: list[tuple[str, int]] | None
    ) -> None:
        """FastDeploy computed a prefill admission threshold (``_get_can_schedule_prefill_threshold_
        block``): ``chunk_blocks`` for the request plus ``reserves`` (``(request id, blocks)`` per
        running request). The next ``can_allocate(threshold)`` is priced by these parts if they add
        up, else at FastDeploy's own price."""
        parts = None
        if reserves is not None and int(chunk_blocks) + sum(int(r) for _, r in reserves) == int(threshold):
            mgr = self.manager
            none: frozenset[int] = frozenset()
            state = [(int(r), mgr.releasing_windows(rid) if rid in mgr else none) for rid, r in reserves]
            parts = (int(chunk_blocks), state)
        self._threshold = (int(threshold), parts)

    def free_blocks(self) -> int:
        """FastDeploy's free count: the free pages in FastDeploy blocks of every layer (``free //
        pages_per_block``, at most ``num_gpu_blocks``). Never a promise the pool cannot keep: a block
        of every lane costs at least as many pages as a capped sliding lane's growth does."""
        free = self.manager.free_units
        if self.prefix is not None:
            free += self.prefix.evictable()
        return min(self.num_gpu_blocks, free // self.layout.pool.pages_per_block)

    def usage(self) -> float:
        mgr = self.manager
        free = mgr.free_units + (self.prefix.evictable() if self.prefix is not None else 0)
        return (mgr.total_units - free) / max(1, mgr.total_units)

    def allocate(self, request: Any, num_blocks: int) -> list[int]:
        """FastDeploy's ``_allocate_gpu_blocks``: the ids to extend ``request.block_tables`` with
        (group 0, lane 0 of the layout: block or page ids, ``-1`` once released)."""
        rid = request.request_id
        if getattr(request, "use_extend_tables", False):
            raise ValueError(
                f"request {rid!r} uses extend tables (use_extend_tables=True), which window "
                "recycling does not support; set FDFLEET_KV_RECYCLE=off"
            )
        mgr = self.manager
        if rid not in mgr:
            mgr.admit(rid)
            self._sent[rid] = [[[] for _ in g.lanes] for g in self.layout.groups]
            self._pending[rid] = (True, [])
        tables = request.block_tables
        n = max(0, int(num_blocks))
        target = (len(tables) + n) * self.block_size
        computed = min(int(request.num_computed_tokens), max(target, mgr.num_tokens(rid)))
        prefix = self.prefix
        if prefix is not None:  # released up to a block boundary: the cached path stays servable at its end
            prefix.written[rid] = max(prefix.written.get(rid, 0), computed)
            computed = max(computed // self.block_size * self.block_size, mgr.computed(rid))
        result = mgr.reserve(rid, target, computed)
        if not result:
            raise RuntimeError(
                f"window recycling: request {rid!r} was promised {n} blocks but the pool lacks "
                f"{result.missing} pages (free {mgr.free_units} of {mgr.total_units}); this is a bug"
            )
        ids = self._collect(rid)[0][0]
        self._due[rid] = mgr.next_release(rid)
        if prefix is not None:  # FastDeploy's tables hold entry ids: its radix tree caches them
            return [prefix.new_entry(rid, k) for k in range(len(tables), len(tables) + n)]
        for k in range(min(len(tables), len(ids))):  # released entries read -1 in FastDeploy's copy
            if ids[k] < 0:
                tables[k] = -1
        return ids[len(tables) : len(tables) + n]

    def admit_served(self, request: Any, held: list[list[list[int]]], tokens: int) -> None:
        """A request FastDeploy served ``tokens`` cached tokens: it holds the units its windows need
        (``held[g][j][k]`` along the matched path) and its first delta maps them."""
        rid = request.request_id
        mgr = self.manager
        if rid in mgr:
            raise ValueError(f"request {rid!r} was served a cached prefix while it holds KV blocks")
        m = tokens // self.block_size
        mgr.admit_served(rid, [[row[:m] for row in lanes] for lanes in held], tokens)
        self._sent[rid] = [[[] for _ in g.lanes] for g in self.layout.groups]
        self._pending[rid] = (True, [])
        self._collect(rid)
        self._due[rid] = mgr.next_release(rid)

    def free(self, request: Any) -> None:
        """FastDeploy's ``_free_blocks``: the whole request (finish, abort, preemption)."""
        rid = request.request_id
        if rid in self.manager:
            self.manager.finish(rid)
        self._sent.pop(rid, None)
        self._pending.pop(rid, None)
        self._due.pop(rid, None)
        request.block_tables = []

    def release_computed(self, rm: Any) -> int:
        """Before FastDeploy schedules: release every running request's pages that left every
        window, up to what is known computed (decoding: ``num_total_tokens - 1``, prefilling:
        ``num_computed_tokens``, i.e. every chunk already scheduled: those batches run before this
        one). Queues the changes; :meth:`attach` delivers them in this step's batch."""
        mgr = self.manager
        due = self._due
        prefix = self.prefix
        bs = self.block_size
        released = 0
        for request in rm.running:
            rid = request.request_id
            threshold = due.get(rid)
            if threshold is None:
                continue
            computed = request.num_computed_tokens
            if computed >= request.need_prefill_tokens:  # decoding (FastDeploy's _is_decoding)
                computed = request.num_total_tokens - 1
            if prefix is not None:  # known written; released only up to a block boundary
                computed = min(int(computed), mgr.num_tokens(rid))
                prefix.written[rid] = max(prefix.written.get(rid, 0), computed)
                computed = computed // bs * bs
            if computed < threshold:  # no block left every window yet: the common case
                continue
            computed = min(int(computed), mgr.num_tokens(rid))
            # a shared unit (prefix caching) leaves the lane without freeing a page: diff the lanes then too
            if computed > 0 and (mgr.release(rid, computed) or prefix is not None):
                released += 1
                ids = self._collect(rid)[0][0]
                if prefix is None:
                    tables = request.block_tables
                    for k in range(min(len(tables), len(ids))):  # FastDeploy's copy reads -1 too
                        if ids[k] < 0:
                            tables[k] = -1
            due[rid] = mgr.next_release(rid)
        return released

    # ---- deltas ---------------------------------------------------------------------------
    def _collect(self, rid: str) -> list[list[list[int]]]:
        """Diff the request's lanes against what was last recorded; queue the changes."""
        now = self.manager.lane_ids(rid)
        old = self._sent[rid]
        reset, changes = self._pending.get(rid, (False, []))
        for gi, (lanes_now, lanes_old) in enumerate(zip(now, old, strict=True)):
            for li, (ids, prev) in enumerate(zip(lanes_now, lanes_old, strict=True)):
                for k, unit in enumerate(ids):
                    if k >= len(prev) or prev[k] != unit:
                        changes.append((gi, li, k, unit))
        self._pending[rid] = (reset, changes)
        self._sent[rid] = now
        return now

    def take_delta(self, rid: str) -> KVDelta | None:
        """The request's delta since the last one (None: nothing changed)."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            return None
        reset, changes = pending
        seq = self._seq.get(rid, 0) + 1
        self._seq[rid] = seq
        return KVDelta(
            request_id=rid,
            seq=seq,
            reset=reset,
            num_blocks=len(self._sent[rid][0][0]),
            changes=tuple(changes),
            layout_id=self.layout.layout_id,
        )

    def _freed_delta(self, rid: str) -> KVDelta:
        """A reset to nothing for a request freed after its task was made (:meth:`attach`)."""
        seq = self._seq.get(rid, 0) + 1
        self._seq[rid] = seq
        return KVDelta(
            request_id=rid, seq=seq, reset=True, num_blocks=0, changes=(), layout_id=self.layout.layout_id
        )

    def attach(self, rm: Any, batch_request: Any) -> None:
        """Give each prefill / decode task its request's delta; a request with changes but no task
        in this batch (pages released by :meth:`release_computed`) gets a decode task carrying
        them (the worker only updates that slot's tables from it).

        A task whose request was freed later in the same ``schedule()`` (FastDeploy gave it a decode
        task, then preempted it for another request's blocks: its status still read prefill while
        the worker lagged) gets a reset delta holding nothing: the worker empties the slot's rows
        before the batch's preemption task clears the slot, and never runs a request whose tables
        it was not told about."""
        sent = set()
        for task in list(getattr(batch_request, "requests", []) or []):
            if not hasattr(task, "block_tables"):  # preempt / abort tasks carry no tables
                continue
            rid = task.request_id
            delta = self.take_delta(rid)
            if delta is None and rid not in self.manager:
                delta = self._freed_delta(rid)
            setattr(task, TASK_ATTR, delta)
            sent.add(rid)
        for request in list(rm.running):
            rid = request.request_id
            if rid in sent or rid not in self._pending:
                continue
            task = rm._prepare_decode_task(request)
            setattr(task, TASK_ATTR, self.take_delta(rid))
            batch_request.add_request(task)


def running_reserves(rm: Any) -> list[tuple[str, int]] | None:
    """Each running request's id and decode reserve in FastDeploy's admission threshold (c1b7c083d
    ``_get_can_schedule_prefill_threshold_block``): its own per-request estimate under
    ``FD_USE_NEW_TOKEN_RATIO_RESERVE``, else ``current_reserve_output_block_num`` each unless the
    relaxed strategy adds none. ``None`` when this FastDeploy keeps other state (priced as a whole)."""
    try:
        if rm.use_new_token_ratio_reserve:
            return [(r.request_id, int(rm._get_running_request_reserve_blocks(r))) for r in rm.running]
        if rm.can_relax_prefill_strategy:
            return []
        return [(r.request_id, int(rm.current_reserve_output_block_num)) for r in rm.running]
    except (AttributeError, TypeError, ValueError):
        return None


def recycler_of(rm: Any) -> KVRecycler | None:
    """The recycler of a ``ResourceManagerV1`` (None: FastDeploy's own accounting)."""
    return getattr(rm, RECYCLER_ATTR, None)


def _attach_recycler(rm: Any) -> None:
    setup = decide(rm.config)
    if setup is None:
        setattr(rm, RECYCLER_ATTR, None)
        return
    cache = rm.config.cache_config
    # FastDeploy builds the scheduler before profiling, on a placeholder count: size, refuse nothing
    rec = KVRecycler(setup, int(rm.cache_manager.num_gpu_blocks), int(cache.block_size), placeholder=True)
    _attach_prefix(rm, rec)
    setattr(rm, RECYCLER_ATTR, rec)
    rm.cache_manager.can_allocate_gpu_blocks = rec.can_allocate


def _attach_prefix(rm: Any, rec: KVRecycler) -> None:
    """FastDeploy's ``enable_prefix_caching`` on: window-aware prefix caching (``prefix_cache.py``)
    over this ``ResourceManagerV1``'s radix tree; FastDeploy internals it needs are checked by name."""
    cache = rm.config.cache_config
    if not field(cache, "enable_prefix_caching"):
        rm.enable_prefix_cache = False
        return
    if not callable(getattr(type(rm), "get_prefix_cached_blocks", None)):
        raise ValueError(
            "window-aware prefix caching needs ResourceManagerV1.get_prefix_cached_blocks, which this "
            "FastDeploy lacks; pass --no-enable-prefix-caching or set FDFLEET_KV_RECYCLE=off"
        )
    max_blocks = -(-rec.setup.max_model_len // rec.block_size) + 2
    rec.prefix = PrefixCache(rec, rm.cache_manager, max_blocks)


def install() -> bool:
    """Patch FastDeploy's ``ResourceManagerV1`` (idempotent). False when it cannot be imported."""
    import importlib

    try:
        module = importlib.import_module(_MODULE)
    except Exception as exc:  # noqa: BLE001 - FastDeploy missing or half-imported: nothing to patch
        logger.debug("window recycling hook not installed: %s unavailable (%s)", _MODULE, exc)
        return False
    cls = getattr(module, "ResourceManagerV1", None)
    if cls is None or getattr(cls, _PATCHED, False):
        return cls is not None
    missing = [name for name in _HOOKED if not callable(getattr(cls, name, None))]
    if missing:  # another FastDeploy generation: leave it alone, decide() refuses by name
        logger.warning("window recycling hook not installed: ResourceManagerV1 has no %s", ", ".join(missing))
        return False

    init, allocate, free_blocks, schedule = (
        cls.__init__,
        cls._allocate_gpu_blocks,
        cls._free_blocks,
        cls.schedule,
    )
    reset, available, usage = cls.reset_cache_config, cls.available_block_num, cls.get_gpu_cache_usage_perc
    threshold = cls._get_can_schedule_prefill_threshold_block

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _attach_recycler(self)

    @functools.wraps(allocate)
    def _allocate_gpu_blocks(self: Any, request: Any, num_blocks: int) -> list[int]:
        rec = recycler_of(self)
        return allocate(self, request, num_blocks) if rec is None else rec.allocate(request, num_blocks)

    @functools.wraps(free_blocks)
    def _free_blocks(self: Any, request: Any) -> None:
        rec = recycler_of(self)
        if rec is None:
            return free_blocks(self, request)
        prefix = rec.prefix
        if prefix is None:
            rec.free(request)
            return None
        # keep rule first (the path's kept units move to its entries), then FastDeploy's own release
        # (shared counts, LRU leaf, uncached entry ids back through recycle_gpu_blocks), then the rest
        prefix.before_free(request)
        free_blocks(self, request)
        rec.free(request)
        prefix.after_free(request.request_id)
        return None

    prefix_blocks = getattr(cls, "get_prefix_cached_blocks", None)

    def get_prefix_cached_blocks(self: Any, request: Any) -> Any:
        ok = prefix_blocks(self, request)
        rec = recycler_of(self)
        if ok and rec is not None and rec.prefix is not None:
            rec.prefix.admit(request)
        return ok

    @functools.wraps(schedule)
    def schedule_(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = recycler_of(self)
        if rec is not None:
            with self.lock:
                rec.release_computed(self)
        out = schedule(self, *args, **kwargs)
        rec = recycler_of(self)
        if rec is not None:
            batch = out[0] if isinstance(out, tuple) else out
            with self.lock:
                rec.attach(self, batch)
        return out

    @functools.wraps(reset)
    def reset_cache_config(self: Any, cfg: Any) -> None:
        reset(self, cfg)
        rec = recycler_of(self)
        if rec is not None:
            if rec.manager.requests:
                raise RuntimeError("reset_cache_config with requests holding KV blocks")
            # the profiled count: refused in FastDeploy's words if it cannot hold one max_model_len request
            new = KVRecycler(
                rec.setup, int(self.cache_manager.num_gpu_blocks), rec.block_size, placeholder=False
            )
            if rec.prefix is not None and (rec.prefix.entries or self.cache_manager.req_leaf_map):
                raise RuntimeError("reset_cache_config with cached prefix blocks")
            _attach_prefix(self, new)
            setattr(self, RECYCLER_ATTR, new)
            self.cache_manager.can_allocate_gpu_blocks = new.can_allocate

    @functools.wraps(threshold)
    def _get_can_schedule_prefill_threshold_block(self: Any, num_chunk_new_block: int) -> int:
        n = threshold(self, num_chunk_new_block)
        rec = recycler_of(self)
        if rec is not None:  # the next can_allocate_gpu_blocks(n) is priced by n's parts
            rec.expect_threshold(n, num_chunk_new_block, running_reserves(self))
        return n

    @functools.wraps(available)
    def available_block_num(self: Any) -> int:
        rec = recycler_of(self)
        return available(self) if rec is None else rec.free_blocks()

    @functools.wraps(usage)
    def get_gpu_cache_usage_perc(self: Any) -> float:
        rec = recycler_of(self)
        return usage(self) if rec is None else rec.usage()

    _refuse_v0_scheduler(cls)
    cls.__init__ = __init__
    cls._allocate_gpu_blocks = _allocate_gpu_blocks
    cls._free_blocks = _free_blocks
    cls.schedule = schedule_
    cls.reset_cache_config = reset_cache_config
    cls._get_can_schedule_prefill_threshold_block = _get_can_schedule_prefill_threshold_block
    cls.available_block_num = available_block_num
    cls.get_gpu_cache_usage_perc = get_gpu_cache_usage_perc
    if callable(prefix_blocks):
        cls.get_prefix_cached_blocks = functools.wraps(prefix_blocks)(get_prefix_cached_blocks)
    setattr(cls, _PATCHED, True)
    logger.info("paddlefleet window recycling hook installed on %s.ResourceManagerV1", _MODULE)
    return True


def _refuse_v0_scheduler(v1: type) -> None:
    """FastDeploy's V0 scheduler (``ENABLE_V1_KVCACHE_SCHEDULER=0``: ``EngineService`` builds the base
    ``ResourceManager``) keeps its own accounting, which the hook cannot reach: building it for a
    plan that recycles is refused by name (``decide`` names the switch), before any request runs.
    ``ResourceManagerV1`` calls the same ``__init__`` and passes untouched."""
    base = next((c for c in v1.__mro__[1:] if c.__name__ == "ResourceManager"), None)
    if base is None or getattr(base, _PATCHED, False):
        return
    init = base.__init__

    @functools.wraps(init)
    def __init__(self: Any, max_num_seqs: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(self, v1) and decide(config, warn=False) is not None:
            raise ValueError(
                "window recycling (FDFLEET_KV_RECYCLE=auto, the plan has sliding windows) runs inside "
                "FastDeploy's V1 scheduler (ResourceManagerV1), but the V0 ResourceManager is being built; "
                "set ENABLE_V1_KVCACHE_SCHEDULER=1, or FDFLEET_KV_RECYCLE=off to serve this model "
                "without recycling"
            )
        init(self, max_num_seqs, config, *args, **kwargs)

    base.__init__ = __init__
    setattr(base, _PATCHED, True)


class _PatchAfterImport:
    """``sys.meta_path`` finder: runs :func:`install` right after FastDeploy imports the module."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)  # find the real spec, and patch once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module: Any) -> None:
            exec_module(module)
            sys.modules[name] = module  # install() imports it by name
            install()

        spec.loader.exec_module = exec_then_install
        return spec


def install_when_imported() -> bool:
    """Install now if FastDeploy's scheduler module is loaded, else right after it is imported
    (safe to call while ``import fastdeploy`` runs: imports nothing of FastDeploy's). Idempotent."""
    import sys

    if _MODULE in sys.modules:
        return install()
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
    return False


__all__ = [
    "RECYCLER_ATTR",
    "KVRecycler",
    "RecyclingSetup",
    "decide",
    "fastdeploy_switches",
    "install",
    "install_when_imported",
    "recycler_of",
    "fastdeploy_pool_refusal",
    "wants_paddlefleet",
]
