"""Invariants of the head-wise KV manager under random serving schedules (hypothesis).

The expected state is computed here in closed form from the schedule (tokens appended, tokens
whose step has run, each head's window): a head holds exactly the logical blocks that a query
not yet run can still see, i.e. blocks ``[floor(max(0, c - W) / bs), ceil(n / bs))`` for a
releasing head and ``[0, ceil(n / bs))`` otherwise.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager, groups_from_plan, size_pools
from fastdeploy_paddlefleet.spec.layer import AttentionPlan, LayerAttention

# layer -> (kv heads, first sliding kv head or None, window_left); layers 0/3 and 2/5 share groups
LAYERS = {
    0: (2, None, None),  # full
    1: (1, 0, 5),  # sliding
    2: (4, 2, 7),  # head-wise: heads 2, 3 slide
    3: (2, None, None),  # full, same group as 0
    4: (3, 1, 0),  # head-wise with window_left 0 (a token sees only itself)
    5: (4, 2, 7),  # same group as 2
}


def make_plan() -> AttentionPlan:
    layers = []
    for i, (hkv, first, w) in LAYERS.items():
        kind = "full" if first is None else ("sliding" if first == 0 else "headwise")
        layers.append(
            LayerAttention(
                index=i,
                kind=kind,
                num_q_heads=2 * hkv,
                num_kv_heads=hkv,
                qk_head_dim=8,
                v_head_dim=8,
                softmax_scale=1.0,
                window_left=w,
                sliding_kv_heads=None if first is None else (first, hkv),
            )
        )
    return AttentionPlan(tuple(layers))


def releasing_window(layer: int, head: int, mode: str) -> int | None:
    """The window a head releases by in ``mode`` (None: keeps every block)."""
    hkv, first, w = LAYERS[layer]
    if first is None or head < first or mode == "none":
        return None
    if mode == "layer" and first != 0:  # layer-level recycling only frees all-sliding layers
        return None
    return w


def held_blocks(n: int, c: int, bs: int, w: int | None) -> range:
    start = 0 if w is None else max(0, c - w) // bs
    return range(start, -(-n // bs))


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(["headwise", "layer", "none"]),
        bs=st.sampled_from([1, 2, 4]),
        blocks=st.integers(0, 24),
    )
    def setup(self, mode, bs, blocks):
        self.mode, self.bs, self.blocks = mode, bs, blocks
        self.mgr = HeadwiseKVManager(make_plan(), blocks, bs, mode=mode)
        self.n: dict[int, int] = {}  # tokens with slots
        self.c: dict[int, int] = {}  # tokens whose step has run
        self.next_id = 0

    # ---- expected state ------------------------------------------------------------------
    def expected_pages(self, n: int, c: int, layer: int) -> int:
        hkv = LAYERS[layer][0]
        return sum(len(held_blocks(n, c, self.bs, releasing_window(layer, h, self.mode))) for h in range(hkv))

    def fits(self, n_after: dict[int, int], c_after: dict[int, int]) -> bool:
        return all(
            sum(self.expected_pages(n_after[q], c_after[q], li) for q in n_after)
            <= self.blocks * LAYERS[li][0]
            for li in LAYERS
        )

    def snapshot(self):
        reqs = sorted(self.n)
        tabs = self.mgr.tables(reqs) if reqs else {}
        return (
            self.mgr.free_pages,
            [self.mgr.num_tokens(q) for q in reqs],
            {li: t.tolist() for li, t in tabs.items()},
        )

    def do_append(self, q: int, k: int) -> None:
        n_after = dict(self.n)
        c_after = dict(self.c)
        c_after[q] = self.n[q]  # appending means the previous step of q has run
        n_after[q] = self.n[q] + k
        expect_ok = self.fits(n_after, c_after)
        assert self.mgr.can_append(q, k).ok == expect_ok
        before = self.snapshot()
        res = self.mgr.append(q, k)
        assert res.ok == expect_ok, (res, self.n, self.c, q, k)
        event(f"append {res.status}")
        if res.ok:
            assert res.status == "ok" and res.missing_pages == 0
            self.n, self.c = n_after, c_after
        else:
            assert res.status == "insufficient" and res.missing_pages > 0
            assert self.snapshot() == before  # nothing half-allocated, nothing released

    # ---- rules -----------------------------------------------------------------------------
    @precondition(lambda self: len(self.n) < 6)
    @rule()
    def admit(self) -> None:
        q = self.next_id
        self.next_id += 1
        self.mgr.admit(q)
        self.n[q], self.c[q] = 0, 0

    def pick(self, data) -> int:
        if not self.n:
            self.admit()
        return data.draw(st.sampled_from(sorted(self.n)))

    @rule(data=st.data(), k=st.integers(1, 13))
    def prefill_chunk(self, data, k):
        self.do_append(self.pick(data), k)

    @rule(data=st.data())
    def decode(self, data):
        self.do_append(self.pick(data), 1)

    @rule(data=st.data())
    def decode_all(self, data):
        self.pick(data)
        for q in sorted(self.n):
            self.do_append(q, 1)

    @rule(data=st.data())
    def step_done(self, data):
        q = self.pick(data)
        released = self.mgr.recycle(q)
        if released:
            event("recycle released pages")
        self.c[q] = self.n[q]

    @rule(data=st.data())
    def finish(self, data):
        q = self.pick(data)
        self.mgr.finish(q)
        del self.n[q], self.c[q]
        assert q not in self.mgr

    @rule(data=st.data())
    def preempt(self, data):
        q = self.pick(data)
        self.mgr.preempt(q)
        self.n[q], self.c[q] = 0, 0
        assert self.mgr.num_tokens(q) == 0

    @rule()
    def finish_all(self):
        for q in sorted(self.n):
            self.mgr.finish(q)
        self.n.clear()
        self.c.clear()
        assert self.mgr.free_pages == self.mgr.total_pages  # no leak

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def pages_match_windows(self):
        reqs = sorted(self.n)
        tabs = self.mgr.tables(reqs) if reqs else {}
        used_by_key = {}
        for li, (hkv, first, w) in LAYERS.items():
            if not reqs:
                break
            t = tabs[li]
            assert t.dtype.name == "int32" and t.shape[0] == len(reqs) * hkv
            seen = set()
            held = 0
            gi = next(g.index for g in self.mgr.groups if li in g.layers)
            for b, q in enumerate(reqs):
                n, c = self.n[q], self.c[q]
                assert self.mgr.num_tokens(q) == n
                expected = self.expected_pages(n, c, li)
                assert self.mgr.request_pages(q)[gi] == expected
                assert self.mgr.held_pages(n, c)[gi] == expected
                for h in range(hkv):
                    row = t[b * hkv + h].tolist()
                    keep = held_blocks(n, c, self.bs, releasing_window(li, h, self.mode))
                    for k, p in enumerate(row):
                        if k in keep:  # still visible to a query that may run, or a full head
                            assert 0 <= p < self.blocks * hkv, (li, q, h, k, row)
                            assert p not in seen, f"page {p} of layer {li} owned twice"
                            seen.add(p)
                            held += 1
                        else:  # released or never needed
                            assert p == -1, (li, q, h, k, row, n, c)
            used_by_key[(hkv, first, w)] = held
        if reqs:
            assert self.mgr.used_pages == sum(used_by_key.values())
        total = sum(self.blocks * hkv for hkv, _, _ in {v for v in LAYERS.values()})
        assert self.mgr.total_pages == total
        assert self.mgr.free_pages + self.mgr.used_pages == total
        assert 0 <= self.mgr.free_pages <= total
        if not reqs:
            assert self.mgr.free_pages == total


ManagerMachine.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerSchedules = ManagerMachine.TestCase


def test_groups_and_units():
    plan = make_plan()
    kinds = [(g.layers, g.kind, g.unit) for g in groups_from_plan(plan, "headwise")]
    assert kinds == [
        ((0, 3), "full", 2),
        ((1,), "sliding", 1),
        ((2, 5), "headwise", 1),
        ((4,), "headwise", 1),
    ]
    # layer-level: head-wise layers allocate whole blocks and never release
    layer = groups_from_plan(plan, "layer")
    assert [(g.unit, g.lanes) for g in layer] == [(2, (None,)), (1, (5,)), (4, (None,)), (3, (None,))]
    assert all(g.lanes == (None,) for g in groups_from_plan(plan, "none"))


def test_released_pages_serve_other_requests():
    """A sliding head's released pages hold another request's full head's blocks."""
    plan = AttentionPlan(
        (LayerAttention(0, "headwise", 4, 2, 8, 8, 1.0, window_left=3, sliding_kv_heads=(1, 2)),)
    )
    mgr = HeadwiseKVManager(plan, num_blocks=4, block_size=4)  # 8 pages
    mgr.admit("a")
    assert mgr.append("a", 16)  # 4 blocks x 2 heads = all 8 pages
    assert mgr.free_pages == 0
    mgr.admit("b")
    assert mgr.append("b", 4).missing == {0: 2}
    a_head1 = mgr.head_pages("a", 0, 1)
    assert mgr.recycle("a") == 3  # head 1 of "a" keeps only block 3: the next query (16) sees 13..16
    assert mgr.head_pages("a", 0, 1) == [-1, -1, -1, a_head1[3]]
    assert mgr.append("b", 4)
    pages_b = set(mgr.head_pages("b", 0, 0) + mgr.head_pages("b", 0, 1))
    assert len(pages_b) == 2 and pages_b <= set(a_head1[:3])  # the pages head 1 of "a" gave back
    assert mgr.request_pages("b") == {0: 2} and mgr.request_pages("a") == {0: 5}


def test_bad_arguments():
    plan = make_plan()
    with pytest.raises(ValueError, match="block_size"):
        HeadwiseKVManager(plan, 4, 0)
    with pytest.raises(ValueError, match="mode"):
        HeadwiseKVManager(plan, 4, 4, mode="fancy")
    mgr = HeadwiseKVManager(plan, 4, 4)
    with pytest.raises(ValueError, match="req_id"):
        mgr.append("x", 1)
    mgr.admit("x")
    with pytest.raises(ValueError, match="req_id"):
        mgr.admit("x")
    with pytest.raises(ValueError, match="n_tokens"):
        mgr.append("x", -1)
    mgr.append("x", 9)
    with pytest.raises(ValueError, match="max_pages"):
        mgr.tables(["x"], max_pages=2)
    assert mgr.tables(["x"], max_pages=8)[2].shape == (4, 8)
    slots = mgr.tables([None, "x"])  # fixed batch slots: an empty slot reads -1
    assert (slots[2][:4] == -1).all() and (slots[2][4:] == mgr.tables(["x"])[2]).all()
    blocks = mgr.block_tables(["x", None])
    assert set(blocks) == {0, 1, 3} and (blocks[0][1] == -1).all()  # whole-block groups only


def test_size_pools_fills_budget_and_shrinks_sliding_groups():
    plan = make_plan()
    groups = groups_from_plan(plan, "headwise")
    block_bytes = {g.index: 100 * g.num_kv_heads * len(g.layers) for g in groups}
    blocks = size_pools(groups, 10**6, block_bytes, block_size=4, context_len=400, max_batched_tokens=64)
    used = sum(b * block_bytes[g.index] for g, b in zip(groups, blocks, strict=True))
    assert 0.99 * 10**6 <= used <= 10**6
    full, sliding = blocks[0], blocks[1]
    assert sliding < full / 5  # a window of 5 needs a few blocks per request, the full group 100
    uniform = size_pools(groups_from_plan(plan, "none"), 10**6, block_bytes, 4, 400)
    assert max(uniform) - min(uniform) <= 1
