"""What the engine's scheduler hook tells the worker: lanes, groups and per-task page deltas.

Stdlib only (no FastDeploy, no paddle): the engine process (``scheduler``) writes these objects,
the worker process (``serving/model_runner/``) reads them, and both build the same
:class:`RecyclingLayout` from the same plans with :func:`layout_from_plans`.

Groups and lanes
----------------
The layout is the one pool's (``kvcache/pools.py``, :class:`~...kvcache.pools.PoolLayout`): layers
sharing kv heads and per-head windows, cut into *groups* of ``slots`` layers, each group one table.
A group is cut into *lanes*, the units that are released independently; a lane's logical block
holds ONE page of the shared pool, whichever group it is in:

* whole-block groups (``unit == heads_per_page``; all heads full, all sliding, or any group when
  head-wise release is off) have ``Hkv / unit`` lanes sharing one window (one lane when a page holds
  every kv head); lane ``j`` holds kv heads ``[j * unit, (j + 1) * unit)``.
* head-wise groups (``unit == 1``: one layer mixes full and sliding kv heads) have one lane per
  local kv head ``h``.

A lane's entries are page ids of the pool; in the layer's cache view ``[pages * unit / Hkv, Hkv,
block_size, D]`` the page of head ``h`` is ``page * unit + h % unit`` (plain block ids when a
page holds every kv head).

Tensor parallelism: every rank shares the engine's one set of tables, so a lane slides only if
it slides on EVERY rank (:func:`merge_tp_plans`); where ranks' windows differ the lane keeps the
largest (it releases later, never too early).

Deltas
------
The scheduler attaches one :class:`KVDelta` per request to the task it sends that step (the
prefill ``Request`` or the ``ScheduledDecodeTask``) under the attribute :data:`TASK_ATTR`; it
survives pickle. It lists every table entry that changed since the request's previous delta,
in order: ``(group, lane, logical_block, unit_id)`` with ``unit_id == -1`` for a released entry.

What the worker must do, for each task of a batch, BEFORE it runs that batch:

1. ``delta.layout_id`` must equal its own layout's ``layout_id`` (else refuse: engine and worker
   planned different lanes).
2. Order: keep the last ``seq`` applied per request. ``seq == last + 1``: apply.
   ``seq <= last``: already applied (a task delivered twice): skip. ``seq > last + 1``: a delta
   was lost: refuse, the tables would be wrong. A request's first delta has ``seq == 1``.
3. ``reset``: the request (re)starts from zero tokens (first delta, or after preemption): set
   every row of the request's batch slot (``task.idx``) in every group to ``-1`` first.
4. For each change, in order, write ``unit_id`` at row ``slot * lanes_g + lane``, column
   ``logical_block`` of group ``group``'s table ``[max_num_seqs * lanes_g, max_blocks]``.
5. Columns ``>= delta.num_blocks`` of the request's rows are ``-1`` afterwards (the request holds
   ``num_blocks`` logical blocks; the changes already say so, this is a check).

A request that finishes, is aborted or preempted gets no further delta for that incarnation: the
worker clears its slot when FastDeploy frees the slot (``ScheduledPreemptTask`` /
``ScheduledAbortTask`` / a finished request), and the next incarnation starts with ``reset``.
A released entry is ``-1`` in the same batch that may hand its page to another request, and
pages are only released for keys no query of that batch or a later one can see (the engine
counts tokens as computed when scheduled, and batches run in order), so applying deltas batch
by batch is always safe however far the worker lags.

:class:`LaneTables` is the reference implementation of these rules on plain lists (tests, and
the worker's own check).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...kvcache.headwise import RECYCLE_MODES, LayerGroup, RecycleMode
from ...kvcache.pools import PoolLayout, pool_layout
from ...plan.layer import AttentionPlan, LayerAttention

#: the attribute of a scheduled task (``Request`` / ``ScheduledDecodeTask``) holding its KVDelta
TASK_ATTR = "fdfleet_kv_delta"
#: bumped when the meaning of a delta changes
PROTOCOL_VERSION = 2

#: ``(group, lane, logical_block, unit_id)``; ``unit_id == -1``: released
Change = tuple[int, int, int, int]


def _merge_layer(layers: Sequence[LayerAttention]) -> LayerAttention:
    """One layer as every rank sees it: a kv head slides only if it slides on every rank."""
    first = layers[0]
    for other in layers[1:]:
        if other.num_kv_heads != first.num_kv_heads:
            raise ValueError(
                f"layer {first.index}: ranks hold {first.num_kv_heads} and {other.num_kv_heads} kv heads; "
                "one shared page table needs the same count on every rank"
            )
    ranges = [la.sliding_kv_heads for la in layers]
    if any(r is None for r in ranges):
        start, stop = 0, 0
    else:
        start, stop = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if start >= stop:
        if first.kind == "full":
            return first
        return replace(first, kind="full", window_left=None, sliding_kv_heads=None)
    window = max(la.window_left for la in layers)
    kind = "sliding" if (start, stop) == (0, first.num_kv_heads) else "headwise"
    return replace(first, kind=kind, window_left=window, sliding_kv_heads=(start, stop))


def merge_tp_plans(plans: Sequence[AttentionPlan]) -> AttentionPlan:
    """The plan whose windows hold on every TP rank (``plans``: one per rank, any order)."""
    plans = list(plans)
    if not plans or not all(isinstance(p, AttentionPlan) for p in plans):
        raise TypeError(f"plans={plans!r}: expected a non-empty list of AttentionPlan (one per TP rank)")
    if len(plans) == 1:
        return plans[0]
    n = {len(p) for p in plans}
    if len(n) != 1:
        raise ValueError(f"TP plans have different layer counts {sorted(n)}")
    layers = tuple(_merge_layer([p[i] for p in plans]) for i in range(len(plans[0])))
    return replace(plans[0], layers=layers, tp_rank=0, source=f"{plans[0].source} (merged over TP ranks)")


@dataclass(frozen=True)
class RecyclingLayout:
    """The one pool's layout (``kvcache/pools.py``) shared by the engine's manager and the worker's
    caches and tables."""

    pool: PoolLayout

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def mode(self) -> str:
        return self.pool.mode

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.pool.groups

    @functools.cached_property
    def layout_id(self) -> str:
        """Short digest of everything the tables depend on (engine and worker must agree)."""
        text = repr((PROTOCOL_VERSION, self.pool))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def lanes(self, group: int) -> int:
        """Rows per request in ``group``'s table."""
        return len(self.groups[group].lanes)

    @property
    def slides(self) -> bool:
        """True when some lane releases pages (else recycling gains nothing)."""
        return self.pool.slides

    def layer_group(self) -> dict[int, int]:
        """``{layer index: group index}``."""
        return self.pool.layer_group()

    def to_dict(self) -> dict[str, Any]:
        return {"layout_id": self.layout_id, **self.pool.to_dict()}


def layout_from_plans(
    plans: AttentionPlan | Sequence[AttentionPlan], block_size: int, mode: RecycleMode = "headwise"
) -> RecyclingLayout:
    """The layout for ``plans`` (one plan, or one per TP rank) at ``block_size`` tokens per block."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected an int >= 1")
    if mode not in RECYCLE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {RECYCLE_MODES}")
    plan = plans if isinstance(plans, AttentionPlan) else merge_tp_plans(plans)
    return RecyclingLayout(pool_layout(plan, block_size, mode))


def layout_from_config(
    config: Any, tp_size: int, block_size: int, mode: RecycleMode = "headwise"
) -> RecyclingLayout:
    """:func:`layout_from_plans` over every TP rank's plan of ``config`` (plan_from_config's input)."""
    from ...plan.config import plan_from_config

    plans = [plan_from_config(config, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    return layout_from_plans(plans, block_size, mode)


@dataclass(frozen=True, slots=True)
class KVDelta:
    """Table changes of one request since its previous delta (see the module docstring)."""

    request_id: str
    seq: int
    reset: bool
    num_blocks: int
    changes: tuple[Change, ...]
    layout_id: str

    def __post_init__(self) -> None:
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise ValueError(
                f"KVDelta(request_id={self.request_id!r}).seq={self.seq!r}: expected an int >= 1"
            )
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 0:
            raise ValueError(
                f"KVDelta(request_id={self.request_id!r}).num_blocks={self.num_blocks!r}: "
                "expected an int >= 0"
            )
        if not isinstance(self.reset, bool):
            raise TypeError(f"KVDelta(request_id={self.request_id!r}).reset={self.reset!r}: expected a bool")


#: unit ids at most: a lane's unit ``u`` is entry ``u * unit + h`` of an int32 table
_INT32_MAX = 2**31 - 1


def _is_int(x: Any) -> bool:
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, int))


class LaneTables:
    """Reference worker tables on plain lists: ``rows[request][group][lane] -> [unit ids]``.

    Applies :class:`KVDelta` objects exactly as the module docstring prescribes (the worker's
    device tables hold the same values at row ``slot * lanes + lane``). A delta is checked whole
    before any row is written (request id, every change's group, lane, logical block and unit id,
    and what the rows hold afterwards): a refused delta leaves every table as it was.

    ``num_units``: the pool's unit count when known (unit ids must be below it); else unit ids are
    bounded by the int32 tables (``u * unit + unit - 1 <= 2**31 - 1``).
    """

    def __init__(self, layout: RecyclingLayout, num_units: int | None = None) -> None:
        if num_units is not None and (not _is_int(num_units) or num_units < 0):
            raise ValueError(f"num_units={num_units!r}: expected an int >= 0 (the pool's units) or None")
        self.layout = layout
        self.rows: dict[str, list[list[list[int]]]] = {}
        self.last_seq: dict[str, int] = {}
        widest = max((g.unit for g in layout.groups), default=1)
        #: unit ids must be below this
        self.unit_limit = (_INT32_MAX + 1) // widest if num_units is None else num_units

    def check(self, delta: KVDelta) -> None:
        """Every field and change of ``delta`` is valid for this layout (no write): ``ValueError`` /
        ``TypeError`` naming the request, the change's index and the bad value."""
        rid = delta.request_id
        if not isinstance(rid, str) or not rid:
            raise TypeError(f"delta.request_id={rid!r}: expected a non-empty str")
        if not isinstance(delta.changes, tuple | list):
            raise TypeError(f"delta for {rid!r}: changes={delta.changes!r}: expected a tuple of changes")
        groups = self.layout.groups
        n = delta.num_blocks
        for i, change in enumerate(delta.changes):
            where = f"delta for {rid!r} (seq={delta.seq}), change {i} {change!r}"
            if not isinstance(change, tuple | list) or len(change) != 4 or not all(map(_is_int, change)):
                raise TypeError(f"{where}: expected (group, lane, logical_block, unit_id), four ints")
            group, lane, block, unit = change
            if not 0 <= group < len(groups):
                raise ValueError(f"{where}: group={group} is outside [0, {len(groups)})")
            lanes = len(groups[group].lanes)
            if not 0 <= lane < lanes:
                raise ValueError(f"{where}: lane={lane} is outside [0, {lanes}) of group {group}")
            if not 0 <= block < n:
                raise ValueError(
                    f"{where}: logical_block={block} is outside [0, num_blocks={n}) of the request"
                )
            if not -1 <= unit < self.unit_limit:
                raise ValueError(f"{where}: unit_id={unit} is outside [-1, {self.unit_limit}) (-1: released)")

    def apply(self, delta: KVDelta) -> bool:
        """Apply ``delta``; False when it was already applied. ``ValueError`` on a gap or layout."""
        if not isinstance(delta, KVDelta):
            raise TypeError(f"delta={delta!r}: expected a KVDelta")
        if delta.layout_id != self.layout.layout_id:
            raise ValueError(
                f"delta for {delta.request_id!r} has layout_id={delta.layout_id!r}, the worker's is "
                f"{self.layout.layout_id!r}: engine and worker planned different lanes"
            )
        self.check(delta)
        last = self.last_seq.get(delta.request_id, 0)
        if delta.seq <= last:
            return False
        if delta.seq != last + 1:
            raise ValueError(
                f"delta for {delta.request_id!r} has seq={delta.seq}, expected {last + 1}: a delta was lost"
            )
        n = delta.num_blocks
        old = None if delta.reset else self.rows.get(delta.request_id)
        if old is not None:  # changes lie below num_blocks (checked): what the rows hold past it stays
            for g, lanes in enumerate(old):
                for j, ids in enumerate(lanes):
                    kept = [k for k in range(n, len(ids)) if ids[k] >= 0]
                    if kept:
                        raise ValueError(
                            f"delta for {delta.request_id!r} (seq={delta.seq}) leaves group {g} lane {j} "
                            f"holding logical block {kept[0]}, past num_blocks={n}"
                        )
        # everything is checked: the writes below cannot fail half-way
        rows = [[[] for _ in g.lanes] for g in self.layout.groups] if old is None else old
        for group, lane, block, unit in delta.changes:
            ids = rows[group][lane]
            if block >= len(ids):
                ids.extend([-1] * (block + 1 - len(ids)))
            ids[block] = unit
        for lanes in rows:
            for ids in lanes:
                del ids[n:]
        self.rows[delta.request_id] = rows
        self.last_seq[delta.request_id] = delta.seq
        return True

    def apply_all(self, deltas: Iterable[KVDelta]) -> None:
        for d in deltas:
            self.apply(d)

    def drop(self, request_id: str) -> None:
        """The request's slot was freed (finish, abort, preemption): forget its rows, keep its seq."""
        self.rows.pop(request_id, None)


def task_delta(task: Any) -> KVDelta | None:
    """The delta a scheduled task carries, or None."""
    return getattr(task, TASK_ATTR, None)


__all__ = [
    "PROTOCOL_VERSION",
    "TASK_ATTR",
    "Change",
    "KVDelta",
    "LaneTables",
    "RecyclingLayout",
    "layout_from_config",
    "layout_from_plans",
    "merge_tp_plans",
    "task_delta",
]
