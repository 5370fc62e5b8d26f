"""The head-wise KV manager under random serving schedules, checked with the test's own bookkeeping.

A seeded random driver (no hypothesis: it reaches 10,000 schedules in seconds) builds a random
plan (several layer groups: full, sliding and head-wise layers with random windows), a random
block size and tiny pools, then runs random operations: admit, chunked prefill, decode, zero
and oversized appends (refused), dry runs, step completion (``recycle``, often skipped), finish
and preempt at any point (aborts mid-way included). The test keeps its own record of which page
each (request, layer group, kv head, logical block) holds and checks after every operation:

* no page is held twice in a group, every page id lies in the group's pool;
* held + free = pool, per group;
* nothing is released while a current or future query can see it: a head holds, with the SAME
  page it got when the block was allocated, every block ``[floor(max(0, c - W) / bs), ceil(n / bs))``
  (``c``: tokens before the earliest query that may still run, ``n``: tokens with slots), and
  releases everything before (``W = None``: keeps every block);
* ``append`` succeeds exactly when the pages that closed form needs fit next to what the other
  requests hold (``can_append`` gives the same answer and the same ``missing``); a refused
  ``append`` changes nothing anywhere;
* finishing everything frees every page.
"""

from __future__ import annotations

import random

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import (
    MAX_PAGES,
    HeadwiseKVManager,
    groups_from_plan,
    size_pools,
)
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention

SCHEDULES = 10_000

# layer -> (kv heads, first sliding kv head or None, window_left); layers 0/3 and 2/5 share groups
LAYERS = {
    0: (2, None, None),  # full
    1: (1, 0, 5),  # sliding
    2: (4, 2, 7),  # head-wise: heads 2, 3 slide
    3: (2, None, None),  # full, same group as 0
    4: (3, 1, 0),  # head-wise with window_left 0 (a token sees only itself)
    5: (4, 2, 7),  # same group as 2
}


def layer_of(i: int, hkv: int, first: int | None, w: int | None) -> LayerAttention:
    kind = "full" if first is None else ("sliding" if first == 0 else "headwise")
    return LayerAttention(
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


def make_plan() -> AttentionPlan:
    return AttentionPlan(tuple(layer_of(i, *spec) for i, spec in LAYERS.items()))


def random_plan(rng: random.Random) -> AttentionPlan:
    """1-5 layers drawn from a small catalogue, so layers often share a group."""
    catalogue = []
    for _ in range(rng.randint(1, 3)):
        w = rng.choice([0, 1, 2, 3, 5, 8])
        kind = rng.choice(["full", "sliding", "headwise", "headwise"])
        if kind == "full":
            catalogue.append((rng.randint(1, 2), None, None))
        elif kind == "sliding":
            catalogue.append((rng.randint(1, 2), 0, w))
        else:
            hkv = rng.randint(2, 4)
            catalogue.append((hkv, rng.randint(1, hkv - 1), w))
    specs = [rng.choice(catalogue) for _ in range(rng.randint(1, 5))]
    return AttentionPlan(tuple(layer_of(i, *spec) for i, spec in enumerate(specs)))


class Bookkeeping:
    """The test's own model of the manager: groups, windows, and which page each block holds."""

    def __init__(self, plan: AttentionPlan, mode: str, bs: int, blocks: list[int]) -> None:
        self.bs = bs
        # groups in order of first appearance of (kv heads, per-head windows), computed here
        keys: dict[tuple, list[int]] = {}
        for layer in plan:
            windows = tuple(layer.head_window(h) for h in range(layer.num_kv_heads))
            keys.setdefault((layer.num_kv_heads, windows), []).append(layer.index)
        self.group_layers = [tuple(v) for v in keys.values()]
        self.hkv = [k[0] for k in keys]
        self.windows = []  # per group, per head: the window it releases by (None: keeps all)
        for hkv, windows in keys:
            all_slide = all(w is not None for w in windows)
            if mode == "none" or (mode == "layer" and not all_slide):
                self.windows.append([None] * hkv)
            else:
                self.windows.append(list(windows))
        self.total = [nb * hkv for nb, hkv in zip(blocks, self.hkv, strict=True)]
        self.n: dict[int, int] = {}  # tokens with slots
        self.c: dict[int, int] = {}  # tokens before the earliest query that may still run
        # rec[q][g][h] = {logical block: page}; owner[g] = {page: (q, h, block)}
        self.rec: dict[int, list[list[dict[int, int]]]] = {}
        self.owner: list[dict[int, tuple]] = [{} for _ in self.hkv]

    def keep_range(self, g: int, h: int, n: int, c: int) -> range:
        w = self.windows[g][h]
        lo = 0 if w is None else max(0, c - w) // self.bs
        return range(lo, -(-n // self.bs))

    def pages_needed(self, g: int, n: int, c: int) -> int:
        return sum(len(self.keep_range(g, h, n, c)) for h in range(self.hkv[g]))

    def held(self, g: int, q: int) -> int:
        return sum(len(blocks) for blocks in self.rec[q][g])

    def expected_missing(self, q: int, n_new: int, c_new: int) -> dict[int, int]:
        out = {}
        for g in range(len(self.hkv)):
            held_after = len(self.owner[g]) - self.held(g, q) + self.pages_needed(g, n_new, c_new)
            if held_after > self.total[g]:
                out[g] = held_after - self.total[g]
        return out

    def observe(self, mgr: HeadwiseKVManager, q: int) -> None:
        """Read ``q``'s pages from the manager and check them against the record, then update it.

        Releases are booked before allocations: a page one head gave back may serve another head
        of the same request in the same ``append``."""
        n, c = self.n[q], self.c[q]
        for g, hkv in enumerate(self.hkv):
            owner = self.owner[g]
            added = []
            for h in range(hkv):
                row = mgr.head_pages(q, g, h)
                keep = self.keep_range(g, h, n, c)
                assert len(row) == keep.stop, (g, h, row, n, c)
                old = self.rec[q][g][h]
                new = {}
                for k, p in enumerate(row):
                    if k not in keep:
                        assert p == -1, f"group {g} head {h} block {k} kept outside {keep}: {row}"
                        continue
                    assert p >= 0, f"group {g} head {h} block {k} released while visible ({keep}): {row}"
                    if k in old:
                        assert p == old[k], f"group {g} head {h} block {k} moved page {old[k]} -> {p}"
                    else:
                        assert 0 <= p < self.total[g], (g, p, self.total[g])
                        added.append((p, (q, h, k)))
                    new[k] = p
                for k, p in old.items():
                    if k not in new:
                        assert owner.pop(p) == (q, h, k)
                self.rec[q][g][h] = new
            for p, who in added:
                assert p not in owner, f"page {p} of group {g} held twice: {owner[p]} and {who}"
                owner[p] = who

    def forget(self, q: int) -> None:
        for g, heads in enumerate(self.rec.pop(q)):
            for blocks in heads:
                for p in blocks.values():
                    del self.owner[g][p]

    def check_pools(self, mgr: HeadwiseKVManager) -> None:
        for g, total in enumerate(self.total):
            assert mgr.group_total_pages(g) == total
            assert mgr.group_free_pages(g) + len(self.owner[g]) == total, (g, len(self.owner[g]))


def snapshot(mgr: HeadwiseKVManager) -> tuple:
    """Everything the manager shows: free pages per group, every request's tokens and pages."""
    groups = [(g.index, g.num_kv_heads) for g in mgr.groups]
    return (
        [mgr.group_free_pages(g) for g, _ in groups],
        {
            q: (mgr.num_tokens(q), [mgr.head_pages(q, g, h) for g, hkv in groups for h in range(hkv)])
            for q in mgr.requests
        },
    )


def run_schedule(seed: int) -> dict[str, int]:
    """One random schedule; returns counts of what happened (for the coverage assertions)."""
    rng = random.Random(seed)
    plan = random_plan(rng)
    mode = rng.choice(["headwise", "headwise", "layer", "none"])
    bs = rng.choice([1, 1, 2, 3, 4])
    ngroups = len(groups_from_plan(plan, mode))
    blocks = [rng.randint(0, 6) for _ in range(ngroups)]
    if rng.random() < 0.5:
        blocks = [blocks[0]] * ngroups
        mgr = HeadwiseKVManager(plan, blocks[0], bs, mode=mode)
    else:
        mgr = HeadwiseKVManager(plan, blocks, bs, mode=mode)
    book = Bookkeeping(plan, mode, bs, blocks)
    assert [g.layers for g in mgr.groups] == book.group_layers
    seen = dict.fromkeys(("ok", "refused", "recycled", "aborted", "released"), 0)
    next_id = 0

    def do_append(q: int, k: int) -> None:
        # computed bound: all held tokens (q's previous step ran) or less (a lagging worker)
        c_new = book.n[q] if rng.random() < 0.5 else rng.randint(book.c[q], book.n[q])
        n_new = book.n[q] + k
        expect = book.expected_missing(q, n_new, c_new)
        dry = mgr.can_append(q, k, computed=c_new)
        assert dry.ok == (not expect) and dry.missing == expect, (dry, expect)
        before = snapshot(mgr) if expect else None
        res = mgr.append(q, k, computed=c_new)
        assert res.ok == (not expect) and res.missing == expect, (res, expect, seed)
        if res.ok:
            seen["ok"] += 1
            freed = sum(len(b) for heads in book.rec[q] for b in heads)
            book.n[q], book.c[q] = n_new, c_new
            book.observe(mgr, q)
            after = sum(len(b) for heads in book.rec[q] for b in heads)
            seen["released"] += after < freed
        else:
            seen["refused"] += 1
            assert res.status == "insufficient" and res.missing_pages > 0
            assert snapshot(mgr) == before  # nothing half-allocated, nothing released
        book.check_pools(mgr)

    for _ in range(rng.randint(4, 30)):
        op = rng.random()
        if op < 0.12 or not book.n:
            if len(book.n) >= 5:
                continue
            q, next_id = next_id, next_id + 1
            mgr.admit(q)
            book.n[q], book.c[q] = 0, 0
            book.rec[q] = [[{} for _ in range(hkv)] for hkv in book.hkv]
            continue
        q = rng.choice(list(book.n))
        if op < 0.35:
            do_append(q, rng.randint(1, 3 * bs + 3))  # a prefill chunk
        elif op < 0.62:
            do_append(q, 1)  # decode
        elif op < 0.65:
            do_append(q, 0)
        elif op < 0.68:
            do_append(q, rng.randint(1, 4) * (max(book.total) + 1) * bs)  # more than any pool holds
        elif op < 0.71:
            before = snapshot(mgr)
            mgr.can_append(q, rng.randint(0, 20), computed=book.n[q])
            assert snapshot(mgr) == before
        elif op < 0.86:  # some of q's steps ran: release what left the windows (else skipped)
            c_new = rng.randint(book.c[q], book.n[q])
            due = mgr.next_release(q)  # what schedulers use to skip release(): below it nothing goes
            released = mgr.release(q, c_new)
            assert c_new >= due or released == 0, (c_new, due, released)
            old = sum(len(b) for heads in book.rec[q] for b in heads)
            book.c[q] = c_new
            book.observe(mgr, q)
            assert released == old - sum(len(b) for heads in book.rec[q] for b in heads)
            seen["recycled"] += 1
            book.check_pools(mgr)
        elif op < 0.94:  # finished or aborted, maybe in the middle of its prefill
            mgr.finish(q)
            book.forget(q)
            del book.n[q], book.c[q]
            assert q not in mgr
            seen["aborted"] += 1
            book.check_pools(mgr)
        else:  # preempted: stays admitted with nothing
            mgr.preempt(q)
            book.forget(q)
            book.n[q] = book.c[q] = 0
            book.rec[q] = [[{} for _ in range(hkv)] for hkv in book.hkv]
            book.observe(mgr, q)
            book.check_pools(mgr)

    # whole-state cross-checks: tables, per-request counts and the closed form agree with the record
    reqs = sorted(book.n)
    if reqs:
        tabs = mgr.group_tables(reqs)
        for g, hkv in enumerate(book.hkv):
            for b, q in enumerate(reqs):
                assert mgr.num_tokens(q) == book.n[q]
                assert mgr.request_pages(q)[g] == book.held(g, q)
                assert mgr.held_pages(book.n[q], book.c[q])[g] == book.held(g, q)
                for h in range(hkv):
                    row = tabs[g][b * hkv + h].tolist()
                    assert {k: p for k, p in enumerate(row) if p >= 0} == book.rec[q][g][h]
    for q in reqs:
        mgr.finish(q)
        book.forget(q)
    assert mgr.free_pages == mgr.total_pages == sum(book.total)  # everything free at the end
    book.check_pools(mgr)
    return seen


def test_random_schedules():
    """>= 10,000 random schedules per run, each checked against the test's own bookkeeping."""
    totals = dict.fromkeys(("ok", "refused", "recycled", "aborted", "released"), 0)
    for seed in range(SCHEDULES):
        for key, value in run_schedule(seed).items():
            totals[key] += value
    # the schedules reach every situation the checks are about
    assert all(v > SCHEDULES // 10 for v in totals.values()), totals


def test_issue_13_repro_full_head_grows_before_sliding_head_releases():
    """Head 0 full, head 1 slides (window_left 2), 4 pages; recycle() skipped after the prefill.
    ``append`` must release head 1's out-of-window pages before head 0 grows (it raised
    ``IndexError: pop from empty list``), and agree with ``can_append``."""
    plan = AttentionPlan((layer_of(0, 2, 1, 2),))
    mgr = HeadwiseKVManager(plan, num_blocks=4, block_size=1)
    mgr.admit("a")
    assert mgr.append("a", 4, computed=mgr.num_tokens("a"))
    assert mgr.free_pages == 0
    assert mgr.can_append("a", 1, computed=mgr.num_tokens("a")).ok
    assert mgr.append("a", 1, computed=mgr.num_tokens("a")).ok
    assert mgr.head_pages("a", 0, 1)[:2] == [-1, -1]  # the query at 4 sees keys 2..4
    assert len(set(mgr.head_pages("a", 0, 0)) | {p for p in mgr.head_pages("a", 0, 1) if p >= 0}) == 8
    assert mgr.free_pages == 0
    # next step: head 1 gives block 2 back but both heads need a page: one short; both calls
    # refuse alike and nothing changes (head 1 keeps block 2 although it could release it)
    res = mgr.can_append("a", 1, computed=mgr.num_tokens("a"))
    before = (mgr.free_pages, mgr.head_pages("a", 0, 0), mgr.head_pages("a", 0, 1))
    assert (
        not res.ok
        and res.missing == {0: 1}
        and mgr.append("a", 1, computed=mgr.num_tokens("a")).missing == {0: 1}
    )
    assert (mgr.free_pages, mgr.head_pages("a", 0, 0), mgr.head_pages("a", 0, 1)) == before
    assert (
        mgr.release("a", mgr.num_tokens("a")) == 1 and mgr.free_pages == 1
    )  # after the step: block 2 of head 1


def test_release_in_a_later_group_pays_for_growth_nowhere_else():
    """Two groups: a refusal in the second group leaves the first group untouched."""
    plan = AttentionPlan((layer_of(0, 1, None, None), layer_of(1, 2, 1, 1)))
    mgr = HeadwiseKVManager(plan, [8, 3], block_size=1)  # group 1: 6 pages
    mgr.admit("a")
    assert mgr.append("a", 2, computed=mgr.num_tokens("a"))  # group 1: 2 heads x 2 blocks, 2 pages free
    before = snapshot(mgr)
    # group 0 could grow; group 1: head 1 frees 1 block at c = 2, the heads need 4: one short
    res = mgr.append("a", 2, computed=mgr.num_tokens("a"))
    assert (
        not res.ok
        and res.missing == {1: 1}
        and mgr.can_append("a", 2, computed=mgr.num_tokens("a")).missing == {1: 1}
    )
    assert snapshot(mgr) == before
    assert mgr.append("a", 1, computed=mgr.num_tokens("a"))  # fits: head 1 gives block 0 back first


def test_huge_pool_constructs_without_allocating():
    plan = AttentionPlan((layer_of(0, 1, None, None),))
    mgr = HeadwiseKVManager(plan, 10**9, 4)  # lazy pool: nothing allocated up front
    assert mgr.total_pages == mgr.free_pages == 10**9
    mgr.admit("a")
    assert mgr.append("a", 10, computed=mgr.num_tokens("a")) and mgr.head_pages("a", 0, 0) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"num_blocks\[0\]=1073741824"):
        HeadwiseKVManager(make_plan(), 2**30, 4)  # 2**31 pages of a 2-head group overflow int32 ids
    assert MAX_PAGES == 2**31 - 1


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
    assert mgr.append("a", 16, computed=mgr.num_tokens("a"))  # 4 blocks x 2 heads = all 8 pages
    assert mgr.free_pages == 0
    mgr.admit("b")
    assert mgr.append("b", 4, computed=mgr.num_tokens("b")).missing == {0: 2}
    a_head1 = mgr.head_pages("a", 0, 1)
    assert (
        mgr.release("a", mgr.num_tokens("a")) == 3
    )  # head 1 of "a" keeps only block 3: the next query (16) sees 13..16
    assert mgr.head_pages("a", 0, 1) == [-1, -1, -1, a_head1[3]]
    assert mgr.append("b", 4, computed=mgr.num_tokens("b"))
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
        mgr.append("x", 1, computed=mgr.num_tokens("x"))
    mgr.admit("x")
    with pytest.raises(ValueError, match="req_id"):
        mgr.admit("x")
    with pytest.raises(ValueError, match="n_tokens"):
        mgr.append("x", -1, computed=mgr.num_tokens("x"))
    mgr.append("x", 9, computed=mgr.num_tokens("x"))
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


def test_tagged_units_stay_evictable_and_are_reused_last():
    """Prefix caching tags units a cached entry refers to: released, they keep their content as
    *evictable* (counted free), are claimed back by a new holder, reused LRU only once no untagged
    unit is left (cold before hot), and the entry is told; untagged units behave as before."""
    plan = AttentionPlan(
        (LayerAttention(0, "headwise", 4, 2, 8, 8, 1.0, window_left=3, sliding_kv_heads=(1, 2)),)
    )
    mgr = HeadwiseKVManager(plan, num_blocks=4, block_size=4)  # 8 pages
    evicted, hot = [], set()
    mgr.on_evict(lambda u, tag: evicted.append((u, tag)), lambda tag: tag in hot)
    mgr.admit("a")
    assert mgr.append("a", 16, computed=0)
    a1 = mgr.head_pages("a", 0, 1)
    for k in range(4):
        mgr.tag_unit(0, a1[k], ("a", k))
    hot.add(("a", 1))
    assert mgr.release("a", 16) == 3  # counted free: evictable
    assert mgr.free_pages == 3 and mgr.evictable_units == 3
    pool = mgr._pools[0]
    assert list(pool.lru) == [a1[0], a1[2]] and list(pool.hot) == [a1[1]] and not pool.free
    mgr.share_unit(0, a1[2])  # a request served block 2 claims it back: no longer evictable
    assert mgr.evictable_units == 2 and mgr.free_pages == 2
    mgr.give_unit(0, a1[2])  # let go again: evictable, the most recent cold one
    assert list(pool.lru) == [a1[0], a1[2]]
    mgr.untag_unit(0, a1[2], ("other", 2))  # not its tag: ignored
    mgr.untag_unit(0, a1[2], ("a", 2))  # the entry drops it: free at once
    assert pool.free == [a1[2]] and mgr.evictable_units == 2
    mgr.admit("b")
    assert mgr.append("b", 4, computed=0)  # 2 pages: the free one first, then the oldest cold one
    assert evicted == [(a1[0], ("a", 0))] and set(mgr.head_pages("b", 0, 0) + mgr.head_pages("b", 0, 1)) == {
        a1[2],
        a1[0],
    }
    mgr.finish("a")  # a's last tagged unit (block 3) becomes evictable, its untagged full head free
    assert list(pool.lru) == [a1[3]] and list(pool.hot) == [a1[1]] and mgr.free_pages == 6
    mgr.admit("c")
    assert mgr.append("c", 12, computed=0)  # 6 pages: the 4 free ones, then cold, then hot
    assert evicted[1:] == [(a1[3], ("a", 3)), (a1[1], ("a", 1))] and mgr.free_pages == 0
    assert not pool.tags and mgr.evictable_units == 0
