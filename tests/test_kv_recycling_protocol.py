"""The engine -> worker protocol of window recycling (``serving/kv_recycling/protocol.py``).

References are independent of the code under test: the TP merge is checked against each rank's
own plan (a head slides in the merged plan iff it slides on every rank), and ``LaneTables`` is
driven by a head-wise manager whose own ``lane_ids`` are the expected tables.
"""

from __future__ import annotations

import pickle
import random

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager
from fastdeploy_paddlefleet.plan import plan_from_config
from fastdeploy_paddlefleet.serving.kv_recycling.protocol import (
    KVDelta,
    LaneTables,
    layout_from_config,
    layout_from_plans,
    merge_tp_plans,
)


@pytest.mark.parametrize("preset", ["tiny", "ernie-4.5-21b-a3b-headwise", "gpt-oss-20b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tp_merge_slides_only_where_every_rank_slides(preset, tp):
    plans = [plan_from_config(preset, tp_size=tp, tp_rank=r) for r in range(tp)]
    merged = merge_tp_plans(plans)
    for i, layer in enumerate(merged):
        for h in range(layer.num_kv_heads):
            windows = [p[i].head_window(h) for p in plans]
            expect = None if any(w is None for w in windows) else max(windows)
            assert layer.head_window(h) == expect


def test_layout_is_the_same_on_every_side():
    a = layout_from_config("tiny", 1, 16)
    b = layout_from_plans(plan_from_config("tiny"), 16)
    assert a == b and a.layout_id == b.layout_id and a.slides
    assert layout_from_config("tiny", 1, 32).layout_id != a.layout_id
    assert pickle.loads(pickle.dumps(a)) == a


def _drive(seed: int):
    """A head-wise manager under random reserve/release; yields (manager, delta) per change set."""
    plan = plan_from_config("tiny")
    layout = layout_from_plans(plan, 4)
    mgr = HeadwiseKVManager.shared(layout.groups, 64 * layout.pool.pages_per_block, 4, layout.mode)
    rng = random.Random(seed)
    sent: dict[str, list] = {}
    seq: dict[str, int] = {}
    for _ in range(200):
        rid = f"r{rng.randint(0, 3)}"
        reset = rid not in mgr
        if reset:
            mgr.admit(rid)
            sent[rid] = [[[] for _ in g.lanes] for g in layout.groups]
        if rng.random() < 0.1 and not reset:
            mgr.finish(rid)
            continue
        n = mgr.num_tokens(rid)
        target = n + rng.randint(0, 9)
        if not mgr.reserve(rid, target, rng.randint(mgr.computed(rid), target)):
            continue
        now = mgr.lane_ids(rid)
        changes = []
        for g, (lanes, old) in enumerate(zip(now, sent[rid], strict=True)):
            for lane, (ids, prev) in enumerate(zip(lanes, old, strict=True)):
                changes += [(g, lane, k, u) for k, u in enumerate(ids) if k >= len(prev) or prev[k] != u]
        sent[rid] = now
        seq[rid] = seq.get(rid, 0) + 1
        yield (
            mgr,
            rid,
            KVDelta(rid, seq[rid], reset, len(now[0][0]), tuple(changes), layout.layout_id),
            layout,
        )


def test_lane_tables_follow_the_manager_through_pickle():
    tables = None
    for mgr, rid, delta, layout in _drive(1):
        tables = tables or LaneTables(layout)
        assert tables.apply(pickle.loads(pickle.dumps(delta)))
        assert tables.rows[rid] == mgr.lane_ids(rid)
        assert not tables.apply(delta)  # delivered twice: skipped


def test_lane_tables_refuse_gaps_and_foreign_layouts():
    layout = layout_from_plans(plan_from_config("tiny"), 4)
    t = LaneTables(layout)
    d1 = KVDelta("a", 1, True, 1, ((0, 0, 0, 5),), layout.layout_id)
    with pytest.raises(ValueError, match="seq=2, expected 1: a delta was lost"):
        t.apply(KVDelta("a", 2, False, 1, (), layout.layout_id))
    with pytest.raises(ValueError, match="layout_id='other'"):
        t.apply(KVDelta("a", 1, True, 1, (), "other"))
    assert t.apply(d1) and t.rows["a"][0][0] == [5]
    with pytest.raises(ValueError, match="past num_blocks=0"):
        t.apply(KVDelta("a", 2, False, 0, (), layout.layout_id))
    with pytest.raises(ValueError, match="seq=0"):
        KVDelta("a", 0, True, 0, (), layout.layout_id)
