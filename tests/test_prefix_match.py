"""Window-aware prefix matching and the keep rule (``kvcache/prefix.py``) against brute force.

The references here are written at token level and independently of the module: a query at
position ``i >= L`` with ``window_left = w`` sees keys ``[i - w, i]``, so the cached keys any of
them reads are ``[max(0, L - w), L)`` (all of ``[0, L)`` for a full lane); ``L`` is servable when
every lane holds each block containing such a key. Every ``L`` is tried, every block checked.
"""

from __future__ import annotations

import random

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager, groups_from_plan, held_units
from fastdeploy_paddlefleet.kvcache.prefix import (
    first_needed,
    keep_plan,
    match_limit,
    servable,
    servable_blocks,
    servable_tokens,
)
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention

CASES = 3000


# ---- brute-force references (token level) ---------------------------------------------------
def ref_needed(w: int | None, bs: int, L: int) -> set[int]:
    lo = 0 if w is None else max(0, L - w)
    return {j // bs for j in range(lo, L)}


def ref_servable(windows, held_sets, bs: int, L: int) -> bool:
    return all(
        ref_needed(w, bs, L) <= held_sets[g][j]
        for g, lanes in enumerate(windows)
        for j, w in enumerate(lanes)
    )


def ref_largest(windows, held_sets, bs: int, limit: int) -> int:
    best = 0
    for L in range(0, limit + 1, bs):
        if ref_servable(windows, held_sets, bs, L):
            best = L
    return best


def ref_useful(windows, held_sets, bs: int, cached_tokens: int):
    """Per lane, the blocks any later match at any servable L <= cached_tokens reads."""
    top = cached_tokens // bs * bs
    Ls = [L for L in range(bs, top + 1, bs) if ref_servable(windows, held_sets, bs, L)]
    useful = [[set() for _ in lanes] for lanes in windows]
    for L in Ls:
        for g, lanes in enumerate(windows):
            for j, w in enumerate(lanes):
                useful[g][j] |= ref_needed(w, bs, L)
    return Ls, useful


# ---- random cases ---------------------------------------------------------------------------
def random_case(rng: random.Random):
    bs = rng.choice([1, 2, 3, 4, 8, 16, 64])
    base_w = rng.choice(
        [0, 1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + rng.randrange(bs), rng.randint(1, 6 * bs)]
    )
    base_w = max(0, base_w)
    # a prompt 0.5 to 20 windows long (at least one block)
    n = max(bs, int(max(base_w, 1) * rng.uniform(0.5, 20)))
    n = min(n, 300 * bs)
    nb = n // bs
    windows = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["full", "sliding", "headwise"])
        if kind == "full":
            windows.append([None])
        elif kind == "sliding":
            windows.append([rng.choice([base_w, rng.randint(0, 4 * bs + base_w)])])
        else:  # head-wise: one lane per kv head, some full, some with (possibly different) windows
            windows.append(
                [
                    rng.choice([None, base_w, rng.randint(0, 4 * bs + base_w)])
                    for _ in range(rng.randint(2, 4))
                ]
            )
    held = []
    pattern = rng.choice(["random", "recycled", "recycled_holes", "all", "dense"])
    cut = rng.randint(0, nb)
    for lanes in windows:
        gh = []
        for w in lanes:
            if pattern == "all":
                s = set(range(nb))
            elif pattern == "random":
                s = {k for k in range(nb) if rng.random() < 0.5}
            elif pattern == "dense":
                s = {k for k in range(nb) if rng.random() < 0.95}
            else:  # what a request that computed `cut * bs + r` tokens holds after releasing
                c = min(n, cut * bs + rng.randrange(bs))
                s = set(range(first_needed(w, bs, c), nb))
                if pattern == "recycled_holes":
                    s -= {k for k in range(nb) if rng.random() < 0.05}
            gh.append(s)
        held.append(gh)
    return bs, n, windows, held


def as_ids(rng: random.Random, s: set[int], nb: int) -> list[int]:
    """A lane's unit ids by logical block (-1 absent), the other accepted form of ``held``."""
    return [rng.randrange(1000) if k in s else -1 for k in range(nb + rng.randint(0, 2))]


def test_largest_servable_matches_brute_force():
    rng = random.Random(32)
    nonzero = 0
    for _ in range(CASES):
        bs, n, windows, held = random_case(rng)
        limit = rng.choice([n, match_limit(n, bs), rng.randint(0, n)])
        want = ref_largest(windows, held, bs, limit)
        got = servable_tokens(windows, held, bs, limit)
        assert got == want, (bs, n, windows, held, limit)
        ids = [[as_ids(rng, s, n // bs) for s in lanes] for lanes in held]
        assert servable_tokens(windows, ids, bs, limit) == want
        assert got % bs == 0 and got <= limit
        nonzero += got > 0
    assert nonzero > CASES // 4  # the cases are not trivially empty


def test_servable_set_matches_brute_force():
    rng = random.Random(33)
    for _ in range(CASES // 3):
        bs, n, windows, held = random_case(rng)
        want = [L // bs for L in range(bs, n // bs * bs + 1, bs) if ref_servable(windows, held, bs, L)]
        assert servable_blocks(windows, held, bs, n) == want
        for L in range(0, n // bs * bs + 1, bs):
            assert servable(windows, held, bs, L) == ref_servable(windows, held, bs, L)


def test_not_monotone_and_largest_is_found():
    """A sliding lane that released its early blocks serves a long prefix but not a short one."""
    bs, w = 4, 8
    windows = [[None], [w]]
    held = [[set(range(10))], [set(range(6, 10))]]
    assert not servable(windows, held, bs, 16)  # needs sliding blocks 2..3
    assert servable(windows, held, bs, 32)  # needs sliding blocks 6..7
    assert servable_tokens(windows, held, bs, 40) == 40
    assert servable_tokens(windows, held, bs, 36) == 36
    assert servable_tokens(windows, held, bs, 35) == 32  # L = 32 needs sliding blocks 6..7
    assert servable_tokens(windows, held, bs, 31) == 0
    # a full lane missing block 3 caps every L at 3 blocks
    held[0][0].discard(3)
    assert servable_tokens(windows, held, bs, 40) == 0
    assert servable_tokens(windows, [[set(range(10)) - {3}], [set(range(10))]], bs, 40) == 12


def test_match_limit_is_fastdeploys_revert():
    """FastDeploy serves whole blocks and, on a full match, recomputes the last block."""
    for bs in (1, 4, 64):
        for n in range(0, 5 * bs):
            want = max((L for L in range(0, n + 1, bs) if L < n), default=0)
            assert match_limit(n, bs) == want


def test_needed_blocks_agree_with_the_release_rule():
    """Serving L leaves each lane holding what held_units says a request at L tokens holds."""
    rng = random.Random(34)
    for _ in range(300):
        plan = _random_plan(rng)
        for mode in ("headwise", "layer", "none"):
            groups = groups_from_plan(plan, mode)
            bs = rng.choice([1, 2, 4, 16])
            L = rng.randint(0, 40) * bs
            units = held_units(groups, bs, L, L)
            for g, u in zip(groups, units, strict=True):
                assert u == sum(len(ref_needed(w, bs, L)) for w in g.lanes)
                assert u == sum(L // bs - first_needed(w, bs, L) for w in g.lanes)


def test_keep_rule_matches_brute_force():
    rng = random.Random(35)
    for _ in range(CASES // 2):
        bs, n, windows, held = random_case(rng)
        cached = rng.choice([n, n // bs * bs, rng.randint(0, n)])
        Ls, useful = ref_useful(windows, held, bs, cached)
        plan = keep_plan(windows, held, bs, cached)
        assert list(plan.servable) == Ls
        for g, lanes in enumerate(windows):
            for j in range(len(lanes)):
                assert set(plan.keep[g][j]) == useful[g][j]
                assert set(plan.free[g][j]) == held[g][j] - useful[g][j]
                assert not set(plan.keep[g][j]) - held[g][j]  # only held blocks are kept
        # freeing changes no servable L, and the rule is idempotent
        kept = [[set(b) for b in lanes] for lanes in plan.keep]
        again = keep_plan(windows, kept, bs, cached)
        assert again.servable == plan.servable and again.keep == plan.keep
        assert again.freed_units == 0
        ids = [[as_ids(rng, s, n // bs) for s in lanes] for lanes in held]
        assert keep_plan(windows, ids, bs, cached).keep == plan.keep


# ---- the keep rule on what the real manager holds -------------------------------------------
def _layer(i: int, hkv: int, first: int | None, w: int | None) -> LayerAttention:
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


def _random_plan(rng: random.Random) -> AttentionPlan:
    layers = []
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["full", "sliding", "headwise"])
        w = rng.choice([0, 1, 3, 5, 8, 13, 40])
        if kind == "full":
            layers.append(_layer(i, rng.randint(1, 2), None, None))
        elif kind == "sliding":
            layers.append(_layer(i, rng.randint(1, 2), 0, w))
        else:
            hkv = rng.randint(2, 4)
            layers.append(_layer(i, hkv, rng.randint(1, hkv - 1), w))
    return AttentionPlan(tuple(layers))


@pytest.mark.parametrize("mode", ["headwise", "layer"])
def test_keep_rule_on_manager_state(mode):
    """A request run chunk by chunk in HeadwiseKVManager: its lanes at finish, fed to the keep rule,
    agree with brute force; and serving the longest servable prefix of the kept path gives each
    lane exactly the blocks the manager holds for a request that computed that prefix itself."""
    rng = random.Random(36)
    checked = 0
    for _ in range(200):
        plan = _random_plan(rng)
        groups = groups_from_plan(plan, mode)
        windows = [list(g.lanes) for g in groups]
        bs = rng.choice([1, 2, 4, 8])
        n = rng.randint(1, 60) * bs + rng.randrange(bs)
        mgr = HeadwiseKVManager(plan, 10_000, bs, mode)
        mgr.admit("r")
        done = 0
        while done < n:
            step = min(n - done, rng.randint(1, 3 * bs))
            assert mgr.reserve("r", done + step, done)
            done += step
        mgr.release("r", n)
        held = [[{k for k, u in enumerate(ids) if u >= 0} for ids in lanes] for lanes in mgr.lane_ids("r")]
        cached = n // bs * bs  # FastDeploy caches whole blocks of computed tokens
        Ls, useful = ref_useful(windows, held, bs, cached)
        kp = keep_plan(windows, held, bs, cached)
        assert list(kp.servable) == Ls
        assert [[set(b) for b in lanes] for lanes in kp.keep] == useful
        if Ls:
            checked += 1
            L = servable_tokens(windows, kp.keep, bs, cached)
            assert L == Ls[-1]
            twin = HeadwiseKVManager(plan, 10_000, bs, mode)
            twin.admit("t")
            assert twin.reserve("t", L, L)
            twin_held = [
                [{k for k, u in enumerate(ids) if u >= 0} for ids in lanes] for lanes in twin.lane_ids("t")
            ]
            for g, lanes in enumerate(windows):
                for j, w in enumerate(lanes):
                    assert twin_held[g][j] == set(range(first_needed(w, bs, L), L // bs))
                    assert twin_held[g][j] <= set(kp.keep[g][j])
        mgr.finish("r")
    assert checked > 50


def test_recycled_path_serves_only_its_end():
    """After a request ran to c tokens its sliding lanes hold [c - w, ...): only prefixes near c
    stay servable, and the blocks below the window of the shortest of them are freed at once."""
    bs, w = 4, 10
    c = 40  # 10 blocks computed; the sliding lane released blocks below (40 - 10) // 4 = 7
    windows = [[None], [w]]
    held = [[set(range(10))], [set(range(first_needed(w, bs, c), 10))]]
    kp = keep_plan(windows, held, bs, c)
    assert kp.servable == (40,)  # L = 36 would need block 6 of the sliding lane (36 - 10 = 26)
    assert kp.keep == ((frozenset(range(10)),), (frozenset({7, 8, 9}),))
    assert kp.free == ((frozenset(),), (frozenset(),))
    # released at c = 42 (mid-block): L = 40 needs sliding block 7, gone, so nothing is servable
    # and everything is freed at once
    c2 = 42
    held2 = [[set(range(11))], [set(range(first_needed(w, bs, c2), 11))]]
    kp2 = keep_plan(windows, held2, bs, c2)
    assert kp2.servable == ()
    assert kp2.keep == ((frozenset(),), (frozenset(),))
    assert kp2.freed_units == 11 + 3
    # releasing up to the block boundary instead (c2 // bs * bs) keeps the end servable
    held3 = [[set(range(11))], [set(range(first_needed(w, bs, c2 // bs * bs), 11))]]
    kp3 = keep_plan(windows, held3, bs, c2)
    assert kp3.servable == (40,)
    assert kp3.free == ((frozenset({10}),), (frozenset({10}),))  # block 10 is partial: never cached
    assert servable_tokens(windows, kp3.keep, bs, match_limit(60, bs)) == 40


def test_block_aligned_release_keeps_the_end_servable():
    """Releasing up to ``computed // bs * bs`` (not ``computed``) always leaves the whole cached
    path servable: what step 2 does while prefix caching is on."""
    rng = random.Random(37)
    for _ in range(CASES // 3):
        bs, n, windows, _ = random_case(rng)
        c = rng.randint(0, n)
        C = c // bs
        held = [[set(range(first_needed(w, bs, C * bs), n // bs + 1)) for w in lanes] for lanes in windows]
        kp = keep_plan(windows, held, bs, c)
        assert (C == 0 and kp.servable == ()) or kp.servable[-1] == C * bs


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        servable_tokens([[None]], [[set()]], 0, 4)
    with pytest.raises(ValueError):
        servable_tokens([[None]], [[set()], [set()]], 4, 4)
    with pytest.raises(ValueError):
        servable_tokens([[None, 3]], [[set()]], 4, 4)
    with pytest.raises(ValueError):
        servable([[None]], [[set()]], 4, 5)
    with pytest.raises(ValueError):
        servable_tokens([[-1]], [[set()]], 4, 4)
