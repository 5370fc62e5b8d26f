"""Hostile inputs to the head-wise KV manager (and ``size_pools``, ``HeadwiseKVState``): every bad
argument is refused by a ``ValueError`` / ``TypeError`` naming it, before anything is allocated or
changed; memory pressure never raises, and a refusal changes nothing.
"""

from __future__ import annotations

import math

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import (
    MAX_PAGES,
    MAX_TOKENS,
    HeadwiseKVManager,
    groups_from_plan,
    size_pools,
)
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention


def layer(i: int, hkv: int, first: int | None, w: int | None) -> LayerAttention:
    kind = "full" if first is None else ("sliding" if first == 0 else "headwise")
    return LayerAttention(
        i,
        kind,
        2 * hkv,
        hkv,
        8,
        8,
        1.0,
        window_left=w,
        sliding_kv_heads=None if first is None else (first, hkv),
    )


PLAN = AttentionPlan((layer(0, 2, None, None), layer(1, 2, 1, 3)))  # two groups: full, head-wise


def manager(**kw) -> HeadwiseKVManager:
    args = dict(plan=PLAN, num_blocks=4, block_size=2)
    args.update(kw)
    return HeadwiseKVManager(**args)


def state(mgr: HeadwiseKVManager) -> tuple:
    return (
        mgr.free_pages,
        {q: (mgr.num_tokens(q), mgr.request_pages(q)) for q in mgr.requests},
        {g: t.tolist() for g, t in mgr.group_tables(mgr.requests).items()} if mgr.requests else {},
    )


# ---- construction ------------------------------------------------------------------------------

CONSTRUCT = [
    (dict(num_blocks=4.0), TypeError, "num_blocks=4.0"),
    (dict(num_blocks="4"), TypeError, "num_blocks='4'"),
    (dict(num_blocks=True), TypeError, "num_blocks=True"),
    (dict(num_blocks=None), TypeError, "num_blocks=None"),
    (dict(num_blocks=-1), ValueError, r"num_blocks\[0\]=-1"),
    (dict(num_blocks=[4]), ValueError, "has 1 entries; the plan has 2 layer groups"),
    (dict(num_blocks=[4, 4, 4]), ValueError, "has 3 entries"),
    (dict(num_blocks=[4, 2.5]), TypeError, r"num_blocks\[1\]=2.5"),
    (dict(num_blocks={0: 4}), ValueError, r"no entry for layer group\(s\) \[1\]"),
    (dict(num_blocks={0: 4, 1: 4, 7: 1}), ValueError, r"names groups \[7\]"),
    (dict(num_blocks=2**30), ValueError, r"num_blocks\[0\]=1073741824"),  # 2**31 pages: int32 overflow
    (dict(num_blocks=10**18), ValueError, r"num_blocks\[0\]"),
    (dict(block_size=0), ValueError, "block_size=0"),
    (dict(block_size=-4), ValueError, "block_size=-4"),
    (dict(block_size=True), TypeError, "block_size=True"),
    (dict(block_size=2.0), TypeError, "block_size=2.0"),
    (dict(block_size=2**31), ValueError, "block_size=2147483648"),
    (dict(mode="fancy"), ValueError, "mode='fancy'"),
    (dict(mode=None), ValueError, "mode=None"),
    (dict(plan=None), TypeError, "plan must be an AttentionPlan"),
    (dict(plan=[PLAN[0]]), TypeError, "plan must be an AttentionPlan"),
    (dict(plan=AttentionPlan(())), ValueError, "plan has no layers"),
]


@pytest.mark.parametrize(("kw", "exc", "match"), CONSTRUCT)
def test_bad_construction_is_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        manager(**kw)


def test_huge_pool_is_lazy_not_allocated():
    """``HeadwiseKVManager(plan, 10**9, 4)`` used to build a 10**9-entry free list (until OOM)."""
    plan = AttentionPlan((layer(0, 2, None, None),))
    mgr = HeadwiseKVManager(plan, 10**9, 4)
    assert mgr.total_pages == mgr.free_pages == 2 * 10**9
    mgr.admit("a")
    assert mgr.append("a", 9, computed=mgr.num_tokens("a")) and mgr.free_pages == 2 * 10**9 - 6
    mgr.finish("a")
    assert mgr.free_pages == mgr.total_pages
    assert MAX_PAGES == 2**31 - 1
    HeadwiseKVManager(plan, MAX_PAGES // 2, 4)  # the largest pool that fits int32 page ids


def test_numpy_integers_are_counts():
    np = pytest.importorskip("numpy")
    mgr = manager(num_blocks=np.int64(4), block_size=np.int32(2))
    mgr.admit("a")
    assert mgr.append("a", np.int64(3), computed=np.int64(0)).ok and mgr.num_tokens("a") == 3


# ---- requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "exc", "match"),
    [
        (None, ValueError, "None marks an empty batch slot"),
        ([1], TypeError, r"req_id=\[1\]"),
        ({}, TypeError, "hashable"),
    ],
)
def test_bad_request_ids(req, exc, match):
    mgr = manager()
    with pytest.raises(exc, match=match):
        mgr.admit(req)
    assert mgr.requests == []


def test_unknown_and_repeated_ids():
    mgr = manager()
    for call in (mgr.append, mgr.can_append, mgr.reserve, mgr.can_reserve):
        with pytest.raises(ValueError, match="req_id='x' is not admitted"):
            call("x", 1, 0)
    with pytest.raises(ValueError, match="req_id='x' is not admitted"):
        mgr.release("x", 0)
    for call in (mgr.finish, mgr.preempt, mgr.num_tokens, mgr.request_pages):
        with pytest.raises(ValueError, match="req_id='x' is not admitted"):
            call("x")
    with pytest.raises(TypeError, match="hashable"):
        mgr.append([1], 1, 0)
    assert [1] not in mgr
    mgr.admit("x")
    with pytest.raises(ValueError, match="already admitted"):
        mgr.admit("x")
    mgr.finish("x")
    with pytest.raises(ValueError, match="not admitted"):
        mgr.finish("x")  # twice


@pytest.mark.parametrize(
    ("n", "exc", "match"),
    [
        (-1, ValueError, "n_tokens=-1"),
        (2.7, TypeError, "n_tokens=2.7"),
        (2.0, TypeError, "n_tokens=2.0"),
        (True, TypeError, "n_tokens=True"),  # a bool is not a count
        (None, TypeError, "n_tokens=None"),
        ("3", TypeError, "n_tokens='3'"),
        (MAX_TOKENS + 1, ValueError, "n_tokens=2147483648"),
        (10**30, ValueError, "n_tokens="),
    ],
)
def test_bad_token_counts_change_nothing(n, exc, match):
    mgr = manager()
    mgr.admit("a")
    assert mgr.append("a", 3, computed=mgr.num_tokens("a"))
    before = state(mgr)
    for call in (mgr.append, mgr.can_append):
        with pytest.raises(exc, match=match):
            call("a", n, 3)
    assert state(mgr) == before


@pytest.mark.parametrize(
    ("target", "computed", "exc", "match"),
    [
        (8, 9, ValueError, r"computed=9: expected an int in \[0, 8\]"),  # computed past the slots
        (2, 6, ValueError, r"computed=6: expected an int in \[0, 5\]"),  # slots never shrink: 5 held
        (8, -1, ValueError, "computed=-1"),
        (8, 2.0, TypeError, "computed=2.0"),
        (8, None, TypeError, "computed=None"),
        (-1, 0, ValueError, "target_tokens=-1"),
        (True, 0, TypeError, "target_tokens=True"),
    ],
)
def test_bad_computed_bounds_change_nothing(target, computed, exc, match):
    mgr = manager()
    mgr.admit("a")
    assert mgr.reserve("a", 5, 0)
    before = state(mgr)
    for call in (mgr.reserve, mgr.can_reserve):
        with pytest.raises(exc, match=match):
            call("a", target, computed)
    with pytest.raises(ValueError, match=r"computed=6: expected an int in \[0, 5\]"):
        mgr.release("a", 6)
    assert state(mgr) == before


def test_token_total_bounded_by_int32():
    plan = AttentionPlan((layer(0, 1, 0, 0),))  # one sliding head, window 0: holds ~1 block
    mgr = HeadwiseKVManager(plan, 4096, 2**20)
    mgr.admit("a")
    assert mgr.append("a", MAX_TOKENS - 5, computed=mgr.num_tokens("a"))  # a long request in huge blocks
    with pytest.raises(ValueError, match="more than MAX_TOKENS"):
        mgr.append("a", 10, computed=mgr.num_tokens("a"))
    assert mgr.num_tokens("a") == MAX_TOKENS - 5


def test_oversized_append_is_refused_quickly_and_changes_nothing():
    mgr = manager()
    mgr.admit("a")
    assert mgr.append("a", 5, computed=mgr.num_tokens("a"))
    before = state(mgr)
    res = mgr.append(
        "a", 10**9, computed=mgr.num_tokens("a")
    )  # far more than the pool: arithmetic, no allocation
    assert not res.ok and res.status == "insufficient" and res.missing_pages > 0
    assert mgr.can_append("a", 10**9, computed=mgr.num_tokens("a")).missing == res.missing
    assert state(mgr) == before


def test_issue_repro_refused_or_done_never_raises():
    """The issue's repro: 2 kv heads, head 1 slides (window_left 2), 4 blocks of 1, recycle skipped."""
    plan = AttentionPlan((layer(0, 2, 1, 2),))
    mgr = HeadwiseKVManager(plan, num_blocks=4, block_size=1)
    mgr.admit("a")
    assert mgr.append("a", 4, computed=mgr.num_tokens("a"))
    assert mgr.can_append("a", 1, computed=mgr.num_tokens("a")).ok
    assert mgr.append("a", 1, computed=mgr.num_tokens("a")).ok  # raised IndexError: pop from empty list


def test_multi_group_refusal_is_atomic():
    """Group 0 could grow, group 1 cannot: nothing grows anywhere."""
    plan = AttentionPlan((layer(0, 1, None, None), layer(1, 2, 1, 1)))
    mgr = HeadwiseKVManager(plan, [100, 2], 1)
    mgr.admit("a")
    assert mgr.append("a", 2, computed=mgr.num_tokens("a"))
    before = state(mgr)
    assert not mgr.append("a", 5, computed=mgr.num_tokens("a"))
    assert state(mgr) == before


# ---- tables and counters -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(max_pages=1), ValueError, "max_pages=1: expected an int >= 3"),
        (dict(max_pages=-1), ValueError, "max_pages=-1"),
        (dict(max_pages=True), TypeError, "max_pages=True"),
        (dict(max_pages="8"), TypeError, "max_pages='8'"),
        (dict(max_pages=8.0), TypeError, "max_pages=8.0"),
    ],
)
def test_bad_table_widths(kw, exc, match):
    mgr = manager()
    mgr.admit("a")
    mgr.append("a", 5, computed=mgr.num_tokens("a"))
    with pytest.raises(exc, match=match):
        mgr.tables(["a"], **kw)


def test_bad_table_requests():
    mgr = manager()
    mgr.admit("a")
    with pytest.raises(TypeError, match="req_ids='a'"):
        mgr.tables("a")  # a string is not a list of ids
    with pytest.raises(TypeError, match="req_ids=3"):
        mgr.tables(3)
    with pytest.raises(ValueError, match="req_id='b' is not admitted"):
        mgr.tables(["a", "b"])
    with pytest.raises(ValueError, match="max_blocks=-2"):
        mgr.block_tables(["a"], max_blocks=-2)
    assert mgr.tables([None, "a"])[0].shape == (4, 0)  # None: an empty slot, still fine


def test_bad_group_head_and_counts():
    mgr = manager()
    mgr.admit("a")
    with pytest.raises(ValueError, match="group=2"):
        mgr.group_free_pages(2)
    with pytest.raises(ValueError, match="group=-1"):
        mgr.group_total_pages(-1)
    with pytest.raises(ValueError, match="head=2"):
        mgr.head_pages("a", 0, 2)
    with pytest.raises(TypeError, match="group=0.0"):
        mgr.head_pages("a", 0.0, 0)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        mgr.held_pages(-1)
    with pytest.raises(ValueError, match="computed=9"):
        mgr.held_pages(4, 9)  # computed beyond the tokens
    with pytest.raises(TypeError, match="num_tokens=1.5"):
        mgr.held_pages(1.5)


# ---- size_pools --------------------------------------------------------------------------------

GROUPS = groups_from_plan(PLAN)
BYTES = {0: 1000, 1: 1000}


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(block_size=0), ValueError, "block_size=0"),
        (dict(block_size=True), TypeError, "block_size=True"),
        (dict(context_len=0), ValueError, "context_len=0"),
        (dict(context_len=1.5), TypeError, "context_len=1.5"),
        (dict(max_batched_tokens=-1), ValueError, "max_batched_tokens=-1"),
        (dict(budget_bytes=math.inf), ValueError, "budget_bytes=inf"),
        (dict(budget_bytes=math.nan), ValueError, "budget_bytes=nan"),
        (dict(budget_bytes=0), ValueError, "budget_bytes=0"),
        (dict(budget_bytes="1e9"), TypeError, "budget_bytes='1e9'"),
        (dict(budget_bytes=10), ValueError, "budget_bytes=10: too small"),
        (dict(block_bytes={0: 1000}), ValueError, "block_bytes has no entry for group 1"),
        (dict(block_bytes={0: 1000, 1: 0}), ValueError, r"block_bytes\[1\]=0"),
        (dict(block_bytes=[1000, 1000]), TypeError, "block_bytes="),
        (dict(groups=[]), TypeError, "groups="),
        (dict(groups=[PLAN[0]]), TypeError, "groups="),
        (dict(budget_bytes=10**30), ValueError, "MAX_PAGES"),  # more pages than int32 ids
    ],
)
def test_size_pools_bad_arguments(kw, exc, match):
    args = dict(
        groups=GROUPS,
        budget_bytes=10**6,
        block_bytes=BYTES,
        block_size=4,
        context_len=64,
        max_batched_tokens=16,
    )
    args.update(kw)
    with pytest.raises(exc, match=match):
        size_pools(**args)


# ---- HeadwiseKVState (verify's driver) ---------------------------------------------------------


def test_headwise_state_bad_sizes():
    pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.runner.headwise_state import HeadwiseKVState

    for kw, match in (
        (dict(num_blocks=4.0), "num_blocks"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_blocks_per_seq=-1), "max_blocks_per_seq"),
        (dict(caches=[]), "caches has 0 layers"),
    ):
        args = dict(plan=PLAN, num_blocks=4, block_size=2, max_blocks_per_seq=8)
        args.update(kw)
        with pytest.raises((ValueError, TypeError), match=match):
            HeadwiseKVState(**args)
    st = HeadwiseKVState(PLAN, 2, 2, 8)
    with pytest.raises(ValueError, match="exhausted"):  # a pool that runs dry: named, not IndexError
        st.schedule([("a", 16)])
    with pytest.raises(ValueError, match="request id None"):
        st.schedule([(None, 1)])
    with pytest.raises(TypeError, match=r"request id \['b'\]"):
        st.schedule([(["b"], 1)])
    with pytest.raises(ValueError, match="unknown request id"):
        st.release("zzz")
