"""The one KV pool (``kvcache/pools.py``), checked against independent references.

* Layout: every layer in exactly one group, groups of equal size reading slots ``0..T-1``, a group's
  layers alike in kv heads and windows; the pool's bytes per FastDeploy block equal FastDeploy's
  per-layer price computed here from the plan's fields (no padding for the served presets), and
  the padding of a preset whose head dims differ is the hand-computed share.
* Capacity: FastDeploy's count by hand (blocks // ceil((ctx + 2 bs + 12) / bs)); recycling never
  below it at any length for the served presets; a manager over the pool, driven the way
  FastDeploy allocates (chunked prefill, then 2 blocks ahead once 12 or fewer slots are left),
  holds ``capacity().recycling_requests`` requests at every step.
* The start rule: ``min_gpu_blocks`` never above FastDeploy's own minimum, and a pool of that many
  blocks carries one ``max_model_len`` request through FastDeploy's allocation pattern.
* The promise: after ``pages_needed(n) <= free``, ANY request grows by ``n`` blocks.
"""

from __future__ import annotations

import math
import random

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager
from fastdeploy_paddlefleet.kvcache.pools import (
    allocation_cap,
    budget_blocks,
    capacity,
    min_gpu_blocks,
    pages_needed,
    pool_layout,
)
from fastdeploy_paddlefleet.plan import plan_from_config

GIB = 1 << 30
SERVED = ["gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise"]
PRESETS = [*SERVED, "tiny", "tiny-mimo", "tiny-headwise"]


def fd_price(plan, bs=64, nbytes=2):
    """FastDeploy's block at every layer's own shape (the runner's price basis), by hand."""
    return bs * sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) * nbytes for la in plan)


def fd_requests(blocks, ctx, bs=64):
    return blocks // math.ceil((ctx + 2 * bs + 12) / bs)


@pytest.mark.parametrize("preset", PRESETS)
def test_layout_places_every_layer_once_in_equal_groups(preset):
    plan = plan_from_config(preset)
    pool = pool_layout(plan, 64)
    by_index = {la.index: la for la in plan}
    placed = [li for g in pool.groups for li in g.layers]
    assert sorted(placed) == sorted(by_index)
    assert {len(g.layers) for g in pool.groups} == {pool.slots}
    for g in pool.groups:
        first = by_index[g.layers[0]]
        windows = tuple(first.head_window(h) for h in range(first.num_kv_heads))
        for li in g.layers:
            la = by_index[li]
            assert la.num_kv_heads == g.num_kv_heads
            assert tuple(la.head_window(h) for h in range(la.num_kv_heads)) == windows == g.windows
        # a lane is ``unit`` kv heads released together; the heads of a layer are all covered
        assert len(g.lanes) * g.unit == g.num_kv_heads and g.unit == pool.heads_per_page
        assert g.num_kv_heads % pool.heads_per_page == 0
    assert pool.pages_per_block == sum(len(g.lanes) for g in pool.groups)
    assert pool.layer_slots() == {li: (g.index, t) for g in pool.groups for t, li in enumerate(g.layers)}


@pytest.mark.parametrize("preset", SERVED)
def test_served_presets_pay_exactly_fastdeploys_per_layer_price(preset):
    plan = plan_from_config(preset)
    pool = pool_layout(plan, 64)
    assert pool.padding == 0.0
    assert pool.block_bytes("bf16") == fd_price(plan)
    assert budget_blocks(pool, 40 * GIB, "bf16") == 40 * GIB // fd_price(plan)


def test_padding_of_unlike_head_dims():
    # tiny: full layers q/k 16, v 16; sliding and head-wise layers q/k 16, v 8; slots are 16 / 16
    plan = plan_from_config("tiny")
    pool = pool_layout(plan, 16)
    slot_elements = sum(la.num_kv_heads * (16 + 16) for la in plan)
    used = sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) for la in plan)
    assert (pool.qk_head_dim, pool.v_head_dim) == (16, 16)
    assert pool.padding == pytest.approx(1 - used / slot_elements)
    assert pool.block_bytes("fp32") == 16 * slot_elements * 4


def test_gpt_oss_geometry_by_hand():
    pool = pool_layout(plan_from_config("gpt-oss-20b"), 64)
    # 12 sliding and 12 full layers: two groups of 12, one page = 8 kv heads x 64 tokens x 12 layers
    assert (pool.slots, pool.heads_per_page, pool.pages_per_block) == (12, 8, 2)
    assert pool.page_bytes("bf16") == 12 * 8 * 64 * (64 + 64) * 2
    assert [g.kind for g in pool.groups] == ["sliding", "full"]


def test_mimo_lanes_of_half_the_heads():
    # full layers 4 kv heads, sliding ones 8: pages of 4 heads, a sliding layer's block is two lanes
    pool = pool_layout(plan_from_config("mimo-v2-flash-like"), 64)
    assert pool.heads_per_page == 4
    kinds = {(g.kind, len(g.lanes)) for g in pool.groups}
    assert kinds == {("full", 1), ("sliding", 2)}
    assert pool.page_multiple == 2 and pool.alloc_pages(29 * 7) == 29 * 7 + 1


@pytest.mark.parametrize("preset", SERVED)
@pytest.mark.parametrize("ctx", [128, 256, 1024, 2048, 4096, 8192, 32768])
def test_capacity_never_below_fastdeploy(preset, ctx):
    plan = plan_from_config(preset)
    pool = pool_layout(plan, 64)
    blocks = 40 * GIB // fd_price(plan)
    cap = capacity(pool, blocks, ctx, max_num_batched_tokens=8192)
    assert cap.fastdeploy_requests == fd_requests(blocks, ctx)
    assert cap.recycling_requests >= cap.fastdeploy_requests
    capped = capacity(pool, blocks, ctx, max_num_batched_tokens=8192, max_num_seqs=7)
    assert capped.recycling_requests == min(7, cap.recycling_requests)


def _drive(pool, num_pages, n_req, ctx, batched):
    """``n_req`` requests of ``ctx`` tokens side by side, allocated the way FastDeploy does: chunked
    prefill within ``batched`` tokens per step (computed = tokens scheduled before the chunk), then
    decode with 2 blocks allocated once 12 or fewer slots are left. False when a reserve fails."""
    bs = pool.block_size
    mgr = HeadwiseKVManager.shared(pool.groups, num_pages, bs, pool.mode)
    state = {}
    for r in range(n_req):
        mgr.admit(r)
        state[r] = [0, 0]  # computed, allocated tokens
    prompt = ctx - 2 * bs
    while any(c < ctx for c, _ in state.values()):
        budget = batched
        for r, st in state.items():
            c, alloc = st
            if c >= ctx:
                continue
            if c < prompt:
                n = min(budget, prompt - c)
                if n == 0:
                    continue
                budget -= n
                target = max(alloc, c + n)
            else:
                n = 1
                target = alloc + 2 * bs if alloc - c <= 12 else alloc
            target = -(-target // bs) * bs
            if not mgr.reserve(r, target, c):
                return False
            st[0], st[1] = c + n, target
    return True


@pytest.mark.parametrize(
    ("preset", "ctx", "chunk", "bs"),
    [
        ("gpt-oss-20b", 2048, 512, 64),
        ("mimo-v2-flash-like", 2048, 512, 64),
        ("gemma3-27b", 4096, 1024, 64),
        ("ernie-4.5-21b-a3b-headwise", 16384, 1024, 64),
        ("tiny", 256, 64, 16),
        ("tiny-headwise", 256, 64, 16),
    ],
)
def test_pool_holds_the_capacity_it_reports(preset, ctx, chunk, bs):
    plan = plan_from_config(preset)
    pool = pool_layout(plan, bs)
    blocks = 12 * math.ceil((ctx + 2 * bs + 12) / bs)  # FastDeploy holds 12 such requests
    cap = capacity(pool, blocks, ctx, max_num_batched_tokens=chunk)
    assert cap.fastdeploy_requests == 12 and cap.recycling_requests > 12
    assert _drive(pool, pool.num_pages(blocks), cap.recycling_requests, ctx, chunk)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mml", [512, 8192, 32768])
def test_start_minimum_never_above_fastdeploys(preset, mml):
    pool = pool_layout(plan_from_config(preset), 64)
    for batched in (512, 2048, None):
        need = min_gpu_blocks(pool, mml, batched)
        assert 1 <= need <= mml // 64 + 2  # FastDeploy's own minimum: max_block_num_per_seq + enc_dec
        assert _drive(pool, pool.num_pages(need), 1, mml, batched or mml)
    assert min_gpu_blocks(pool, mml) == min_gpu_blocks(pool, mml, mml)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "mimo-v2-flash-like", "tiny", "tiny-headwise"])
def test_a_promised_allocation_always_succeeds(preset):
    """Random pool states: whenever ``pages_needed(n) <= free``, any live request can grow by ``n``
    FastDeploy blocks (``n`` up to a chunk's blocks plus a decode reserve)."""
    rng = random.Random(5)
    bs, batched = 16, 256
    pool = pool_layout(plan_from_config(preset), bs)
    caps = [[None if w is None else allocation_cap(w, bs, batched) for w in g.lanes] for g in pool.groups]
    mgr = HeadwiseKVManager.shared(pool.groups, pool.num_pages(60), bs, pool.mode)
    live = {}
    for step in range(3000):
        rid = rng.randrange(12)
        if rid not in live:
            mgr.admit(rid)
            live[rid] = 0
        c = live[rid]
        n = rng.randint(0, batched // bs + 4)
        promised = pages_needed(pool, n, caps) <= mgr.free_units
        blocks = -(-mgr.num_tokens(rid) // bs)
        ok = mgr.reserve(rid, (blocks + n) * bs, c)
        if promised:
            assert ok, (step, rid, n)
        if ok:
            # the computed bound moves by at most one step's tokens (FastDeploy's chunk or a decode)
            live[rid] = min(mgr.num_tokens(rid), c + rng.randint(0, batched))
        if rng.random() < 0.05 or mgr.num_tokens(rid) > 4000:
            mgr.finish(rid)
            del live[rid]
    held = sum(u >= 0 for r in live for lanes in mgr.lane_ids(r) for ids in lanes for u in ids)
    assert mgr.free_units + held == mgr.total_units


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p: capacity(p, -1, 10), "num_gpu_blocks=-1"),
        (lambda p: capacity(p, 10, 0), "context=0"),
        (lambda p: capacity(p, 10, 10, max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
        (lambda p: capacity(p, 10, 10, max_num_seqs=0), "max_num_seqs=0"),
        (lambda p: min_gpu_blocks(p, True), "max_model_len=True"),
        (lambda p: p.num_pages(2.5), "num_gpu_blocks=2.5"),
        (lambda p: budget_blocks(p, -5, "bf16"), "budget_bytes=-5"),
        (lambda p: pool_layout(plan_from_config("tiny"), 0), "block_size=0"),
        (lambda p: pool_layout(plan_from_config("tiny"), 16, "every"), "mode='every'"),
        (lambda p: pool_layout("tiny", 16), "AttentionPlan"),
    ],
)
def test_bad_arguments_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(pool_layout(plan_from_config("tiny"), 16))


def test_a_released_page_serves_another_group_at_once():
    """No budget per group: the page a sliding lane gives back is the next page a full lane takes."""
    pool = pool_layout(plan_from_config("gpt-oss-20b"), 64)
    sliding, full = (g.index for g in pool.groups)
    assert (pool.groups[sliding].kind, pool.groups[full].kind) == ("sliding", "full")
    mgr = HeadwiseKVManager.shared(pool.groups, 8, 64, pool.mode)
    mgr.admit("a")
    assert mgr.reserve("a", 4 * 64, 0)  # 4 blocks on both lanes: the whole pool
    assert mgr.free_units == 0 and not mgr.can_reserve("a", 5 * 64, 0)
    mgr.admit("b")
    assert not mgr.reserve("b", 64, 0)
    # a's queries from token 4 * 64 - 1 on see keys >= 128 only: its sliding lane gives blocks 0, 1 back
    assert mgr.release("a", 4 * 64 - 1) == 2 * pool.heads_per_page
    assert mgr.lane_ids("a")[sliding][0][:2] == [-1, -1]
    given = set(range(8)) - {u for lanes in mgr.lane_ids("a") for ids in lanes for u in ids}
    assert mgr.reserve("b", 64, 0)  # one block on both of b's lanes: the two pages a released
    taken = {ids[0] for ids in (mgr.lane_ids("b")[sliding][0], mgr.lane_ids("b")[full][0])}
    assert taken == given and mgr.free_units == 0


@pytest.mark.parametrize(
    ("groups", "pages", "exc", "match"),
    [
        ((), 4, TypeError, "non-empty sequence of LayerGroup"),
        (("g",), 4, TypeError, "LayerGroup"),
        ("mixed_units", 4, ValueError, "one unit"),
        ("unordered", 4, ValueError, "indexed 0..1"),
        ("ok", -1, ValueError, "num_pages=-1"),
        ("ok", 2.0, TypeError, "num_pages=2.0"),
    ],
)
def test_shared_manager_refuses_bad_groups(groups, pages, exc, match):
    from dataclasses import replace

    gs = pool_layout(plan_from_config("gpt-oss-20b"), 64).groups
    groups = {
        "ok": gs,
        "mixed_units": (gs[0], replace(gs[1], unit=1)),
        "unordered": (gs[1], gs[0]),
    }.get(groups, groups)
    with pytest.raises(exc, match=match):
        HeadwiseKVManager.shared(groups, pages, 64)


def test_admission_pages_by_hand():
    """gpt-oss-20b: one sliding lane (window 127) and one full lane per FastDeploy block. A prefill
    admission threshold of a 30-block chunk plus the reserves of three running requests (4, 2, 5
    blocks; the first two already release on their sliding lane): the full lane needs all of it, the
    sliding lane the chunk (below its cap) and the reserve of the request that does not release yet."""
    from fastdeploy_paddlefleet.kvcache.pools import admission_pages

    pool = pool_layout(plan_from_config("gpt-oss-20b"), 64)
    caps = [[None if w is None else allocation_cap(w, 64, 8192) for w in g.lanes] for g in pool.groups]
    releasing = frozenset({127})
    reserves = [(4, releasing), (2, releasing), (5, frozenset())]
    full = 30 + 4 + 2 + 5
    sliding = 30 + 5
    assert admission_pages(pool, 30, reserves, caps) == full + sliding
    # FastDeploy prices the same threshold at 41 blocks of every lane: never less than the pool's
    assert admission_pages(pool, 30, reserves, caps) <= 41 * pool.pages_per_block
    # nobody releases yet (requests shorter than the window): exactly FastDeploy's price
    young = [(r, frozenset()) for r, _ in reserves]
    assert admission_pages(pool, 30, young, caps) == 41 * pool.pages_per_block
    # a chunk larger than one allocation of the sliding lane is capped there
    cap = caps[0][0]
    assert admission_pages(pool, cap + 50, [], caps) == (cap + 50) + cap
