"""Per-group page tables on the device, at fixed addresses, updated in place from KVDeltas.

One int32 table per group of the recycling layout (``serving/kv_recycling/protocol.py``, the one
pool of ``kvcache/pools.py``), in the kernels' page format (``backends/base.py``):
``[max_num_seqs * Hkv_g, max_blocks]``, row ``slot * Hkv_g + h`` is batch slot ``slot``'s kv
head ``h``, ``-1`` absent. Its entries index the layer's view of its slot, ``[pages * G / Hkv_g,
Hkv_g, block_size, D]``: a lane of ``unit`` kv heads holds pool page ``u`` for a logical block,
which is entry ``u * unit + h % unit`` on the rows of its heads (``unit == Hkv``: ``u * Hkv + h``,
one lane; ``unit == 1``: the page itself, one lane per head).

The tables are allocated once and only ever written in place (``table[rows] = ...``), so a CUDA
graph captured with them reads the new entries on replay. The delta rules (layout id, order,
reset, ``num_blocks``) are applied by the protocol's own :class:`LaneTables`; this class mirrors
the rows of the groups a delta touched into the device tables.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import paddle

from ..kv_recycling.protocol import KVDelta, LaneTables, RecyclingLayout

logger = logging.getLogger(__name__)


class DevicePageTables:
    """The per-group device tables of one worker (see the module docstring)."""

    def __init__(self, layout: RecyclingLayout, max_num_seqs: int, max_blocks: int) -> None:
        if not isinstance(layout, RecyclingLayout):
            raise TypeError(f"layout must be a RecyclingLayout, got {type(layout).__name__}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_blocks", max_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        self.layout = layout
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.lanes = LaneTables(layout)
        self._heads = [g.num_kv_heads for g in layout.groups]
        self._host = [np.full((max_num_seqs * h, max_blocks), -1, np.int32) for h in self._heads]
        #: the device tables (never reallocated)
        self.tables = [paddle.to_tensor(t) for t in self._host]
        self._layer_group = layout.layer_group()
        self._slot_request: dict[int, str] = {}

    # -- updates ------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"batch slot {slot!r} is outside [0, max_num_seqs={self.max_num_seqs})")
        return slot

    def _write_slot(self, slot: int, rows: list[list[list[int]]] | None, groups: Any = None) -> None:
        """Set the slot's rows of ``groups`` (default: every group) from ``rows[group][lane]``
        (None: all ``-1``) and copy them to the device in place."""
        for g in range(len(self.layout.groups)) if groups is None else sorted(groups):
            group, heads = self.layout.groups[g], self._heads[g]
            block = self._host[g][slot * heads : (slot + 1) * heads]
            block.fill(-1)
            if rows is not None:
                unit = group.unit  # lane j: heads [j * unit, (j + 1) * unit), entry u * unit + h % unit
                for j, ids in enumerate(rows[g]):
                    if len(ids) > self.max_blocks:
                        raise ValueError(self._too_wide(slot, g, len(ids)))
                    lane = np.asarray(ids, dtype=np.int64)
                    entries = np.where(
                        lane[None, :] >= 0, lane[None, :] * unit + np.arange(unit)[:, None], -1
                    )
                    block[j * unit : (j + 1) * unit, : len(ids)] = entries
            self.tables[g][slot * heads : (slot + 1) * heads] = paddle.to_tensor(block)

    def _too_wide(self, slot: int, group: int, n: int) -> str:
        return (
            f"batch slot {slot}: group {group} holds {n} logical blocks, the page tables have "
            f"max_blocks={self.max_blocks} columns (FastDeploy's block_tables width)"
        )

    def apply(self, slot: int, delta: KVDelta) -> bool:
        """Apply ``delta`` (the protocol's rules) for the request in batch slot ``slot``; False when
        it was already applied. ``ValueError`` names a lost delta or a layout mismatch."""
        slot = self._check_slot(slot)
        if isinstance(delta, KVDelta) and delta.num_blocks > self.max_blocks:  # before any row changes
            raise ValueError(self._too_wide(slot, 0, delta.num_blocks))
        if not self.lanes.apply(delta):
            return False
        moved = self._slot_request.get(slot) != delta.request_id
        self._slot_request[slot] = delta.request_id
        # only the groups the delta changed (a whole slot after a reset or when the request is new here)
        groups = None if delta.reset or moved else {c[0] for c in delta.changes}
        self._write_slot(slot, self.lanes.rows[delta.request_id], groups)
        return True

    def clear_slot(self, slot: int, request_id: str | None = None) -> None:
        """FastDeploy freed ``slot`` (preemption, abort): its rows become ``-1``; the request's rows
        are forgotten (its sequence number is kept, the next incarnation starts with a reset)."""
        slot = self._check_slot(slot)
        rid = request_id if request_id is not None else self._slot_request.get(slot)
        if rid is not None:
            self.lanes.drop(rid)
        self._slot_request.pop(slot, None)
        self._write_slot(slot, None)

    def fill_dummy(self, slot: int, num_blocks: int, num_pages: int) -> None:
        """Rows for a dummy (profile / capture) request in ``slot`` holding ``num_blocks`` blocks:
        valid pages of the pool (``num_pages`` of them, wrapped around), never ``-1`` in the used range."""
        slot = self._check_slot(slot)
        n = min(int(num_blocks), self.max_blocks)
        pages = max(1, int(num_pages))
        rows = [
            [
                [(slot * n * len(g.lanes) + j * len(g.lanes) + k) % pages for j in range(n)]
                for k in range(len(g.lanes))
            ]
            for g in self.layout.groups
        ]
        self._write_slot(slot, rows)

    # -- reads --------------------------------------------------------------------------------
    def group_table(self, group: int) -> paddle.Tensor:
        """Group ``group``'s whole device table ``[max_num_seqs * Hkv, max_blocks]``."""
        return self.tables[group]

    def host_table(self, group: int) -> np.ndarray:
        """A copy of the host mirror of group ``group``'s table."""
        return self._host[group].copy()

    def forward_tables(self, batch_size: int) -> dict[int, Any]:
        """``{layer index: table[: batch_size * Hkv]}`` for ``ForwardMeta.block_tables_headwise``
        (the leading rows, as FastDeploy slices ``block_tables[:num_running_requests]``)."""
        sliced = [t[: int(batch_size) * h] for t, h in zip(self.tables, self._heads, strict=True)]
        return {li: sliced[g] for li, g in self._layer_group.items()}


__all__ = ["DevicePageTables"]
