"""``split_kv_pools``: the one full/sliding split, checked against independent references.

* FastDeploy's accounting: the budget over the plain per-layer sum of ``kv_heads * (qk + v) *
  dtype * block_size`` (computed here from the plan's fields, not through the module), and
  ``kv_budget``'s ``max_requests`` (layout.py's own arithmetic) at the same budget.
* Recycled capacity: a head-wise manager sized with the split is driven the way FastDeploy's
  scheduler drives it (chunked prefill, then decode with 2 blocks + 12 slots look-ahead); the
  split's ``max_requests`` requests of ``max_model_len`` tokens fit at every step.
* Refusal: a budget below one ``max_model_len`` request raises, naming the numbers.
"""

from __future__ import annotations

import pytest

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager
from fastdeploy_paddlefleet.kvcache.layout import kv_budget
from fastdeploy_paddlefleet.kvcache.pools import split_kv_pools
from fastdeploy_paddlefleet.plan import plan_from_config

GIB = 1 << 30
PRESETS = ["gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise", "tiny"]


@pytest.mark.parametrize("preset", PRESETS)
def test_fastdeploy_accounting_matches_layout(preset):
    plan = plan_from_config(preset)
    split = split_kv_pools(plan, 8 * GIB, 64, 8192)
    per_block = 64 * sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) * 2 for la in plan)
    assert split.fastdeploy_block_bytes == per_block
    assert split.fastdeploy_num_blocks == 8 * GIB // per_block
    # FastDeploy's decode look-ahead (2 blocks + 12 slots) is not capped at max_model_len
    assert split.fastdeploy_max_requests == kv_budget(plan, 64, "bf16", 8.0, 8192 + 140).max_requests
    assert split.used_bytes <= 8 * GIB


def _drive(plan, split, n_req, ctx, batched):
    """``n_req`` requests of ``ctx`` tokens run side by side the way FastDeploy allocates:
    chunked prefill within ``batched`` tokens per step (computed = tokens scheduled before the
    chunk), then decode with blocks allocated 2 at a time once 12 or fewer slots are left.
    False when an allocation fails."""
    bs = split.block_size
    mgr = HeadwiseKVManager(plan, split.num_blocks, bs)
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
    "preset", ["gpt-oss-20b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise", "tiny"]
)
def test_split_holds_max_requests(preset):
    plan = plan_from_config(preset)
    # context beyond every window (ERNIE's is 4096), budget for a handful of requests
    ctx, chunk, budget, bs = {
        "tiny": (256, 64, 4 << 20, 16),
        "ernie-4.5-21b-a3b-headwise": (16384, 1024, 4 << 30, 64),
    }.get(preset, (2048, 512, 512 << 20, 64))
    split = split_kv_pools(plan, budget, bs, ctx, max_num_batched_tokens=chunk)
    assert split.max_requests >= 1
    assert _drive(plan, split, split.max_requests, ctx, chunk)
    # the split beats FastDeploy's one pool wherever a lane slides
    assert split.max_requests > split.fastdeploy_max_requests


def test_concurrency_cap_moves_bytes_to_full_pools():
    plan = plan_from_config("gpt-oss-20b")
    free = split_kv_pools(plan, 40 * GIB, 64, 8192)
    capped = split_kv_pools(plan, 40 * GIB, 64, 8192, concurrency=64)
    kinds = {g.kind: g for g in capped.groups}
    assert capped.max_requests == 64 < free.max_requests
    assert kinds["full"].num_blocks > {g.kind: g for g in free.groups}["full"].num_blocks
    assert capped.used_bytes <= 40 * GIB


def test_refuses_a_budget_below_one_request():
    plan = plan_from_config("gpt-oss-20b")
    with pytest.raises(ValueError, match=r"max_model_len=131072.*bytes"):
        split_kv_pools(plan, 64 * 1024 * 1024, 64, 131072)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(budget_bytes=0), "budget_bytes=0"),
        (dict(block_size=0), "block_size=0"),
        (dict(max_model_len=True), "max_model_len=True"),
        (dict(concurrency=0), "concurrency=0"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
    ],
)
def test_bad_arguments_named(kw, match):
    args = dict(plan=plan_from_config("tiny"), budget_bytes=GIB, block_size=16, max_model_len=256)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        split_kv_pools(**args)
