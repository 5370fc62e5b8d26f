"""Per-group page tables on the device, at fixed addresses, updated in place from KVDeltas.

One int32 table per layer group of the recycling layout (``serving/kv_recycling/protocol.py``),
in the kernels' page format (``backends/base.py``): ``[max_num_seqs * Hkv_g, max_blocks]``, row
``slot * Hkv_g + h`` is batch slot ``slot``'s kv head ``h``, entry ``page = block * Hkv_g + h`` of
the group's cache viewed as ``[num_blocks_g * Hkv_g, block_size, D]``, ``-1`` absent.

* whole-block groups (one lane) hold block ids in the delta: lane entry ``u`` becomes
  ``u * Hkv + h`` on each of the slot's ``Hkv`` rows;
* head-wise groups (one lane per kv head) hold page ids: lane ``h`` is row ``slot * Hkv + h``.

The tables are allocated once and only ever written in place (``table[rows] = ...``), so a CUDA
graph captured with them reads the new entries on replay. The delta rules (layout id, order,
reset, ``num_blocks``) are applied by the protocol's own :class:`LaneTables`; this class mirrors
its rows into the device tables.
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

    def _write_slot(self, slot: int, rows: list[list[list[int]]] | None) -> None:
        """Set the slot's rows of every group from ``rows[group][lane]`` (None: all ``-1``) and copy
        them to the device in place."""
        for g, (group, heads) in enumerate(zip(self.layout.groups, self._heads, strict=True)):
            block = self._host[g][slot * heads : (slot + 1) * heads]
            block.fill(-1)
            if rows is not None:
                lanes = rows[g]
                if len(lanes) == 1 and group.unit == heads:  # whole blocks: expand to pages per head
                    ids = np.asarray(lanes[0], dtype=np.int64)
                    if len(ids) > self.max_blocks:
                        raise ValueError(self._too_wide(slot, g, len(ids)))
                    expanded = ids[None, :] * heads + np.arange(heads)[:, None]
                    block[:, : len(ids)] = np.where(ids[None, :] >= 0, expanded, -1)
                else:
                    for h, ids in enumerate(lanes):
                        if len(ids) > self.max_blocks:
                            raise ValueError(self._too_wide(slot, g, len(ids)))
                        block[h, : len(ids)] = ids
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
        if not self.lanes.apply(delta):
            return False
        self._slot_request[slot] = delta.request_id
        self._write_slot(slot, self.lanes.rows[delta.request_id])
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

    def fill_dummy(self, slot: int, num_blocks: int, pool_blocks: list[int]) -> None:
        """Rows for a dummy (profile / capture) request in ``slot`` holding ``num_blocks`` blocks:
        valid page ids of each group's pool (wrapped around), never ``-1`` in the used range."""
        slot = self._check_slot(slot)
        n = min(int(num_blocks), self.max_blocks)
        rows = []
        for g, (group, heads) in enumerate(zip(self.layout.groups, self._heads, strict=True)):
            blocks = max(1, int(pool_blocks[g]))
            ids = [(slot * n + j) % blocks for j in range(n)]
            if group.unit == heads:
                rows.append([ids])
            else:
                rows.append([[b * heads + h for b in ids] for h in range(heads)])
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
