"""KV cache shapes and budget, checked against brute-force counts written here."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy_paddlefleet.kvcache.layout import (
    GIB,
    blocks_for,
    cache_shapes,
    dtype_bytes,
    kv_budget,
    window_blocks,
)
from fastdeploy_paddlefleet.plan import AttentionPlan, LayerAttention, plan_from_config


def layer(index, kind="full", hkv=2, qk=16, v=16, window=None, slide=None):
    return LayerAttention(
        index=index,
        kind=kind,
        num_q_heads=hkv * 2,
        num_kv_heads=hkv,
        qk_head_dim=qk,
        v_head_dim=v,
        softmax_scale=qk**-0.5,
        window_left=window,
        sliding_kv_heads=slide,
    )


def test_shapes_per_layer_follow_the_plan():
    plan = plan_from_config("tiny")
    key, value = cache_shapes(plan[0], 10, 4)
    assert key == (10, 2, 4, 16) and value == (10, 2, 4, 16)
    key, value = cache_shapes(plan[1], 10, 4)  # sliding layer: qk 16 / v 8
    assert key == (10, 2, 4, 16) and value == (10, 2, 4, 8)
    mimo = plan_from_config("mimo-v2-flash-like")
    assert cache_shapes(mimo[0], 1, 64)[0] == (1, 4, 64, 192)  # full: 4 kv heads
    assert cache_shapes(mimo[1], 1, 64) == ((1, 8, 64, 192), (1, 8, 64, 128))  # sliding: own 8 kv heads


@pytest.mark.parametrize(
    "dtype,size",
    [
        ("bf16", 2),
        ("bfloat16", 2),
        ("fp16", 2),
        ("float16", 2),
        ("FP8", 1),
        ("int8", 1),
        ("float8_e4m3fn", 1),
        ("float8_e5m2", 1),
        ("fp32", 4),
        ("float32", 4),
        ("torch.bfloat16", 2),
    ],
)
def test_dtype_bytes(dtype, size):
    assert dtype_bytes(dtype) == size


@pytest.mark.parametrize("dtype", ["fp64", "int4", "", "bf15"])
def test_unknown_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes(dtype)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        cache_shapes(layer(0), 4, bad)


def brute_window_blocks(w, context, bs):
    """Worst case over alignment: max over where the window span starts inside a block."""
    if context <= w + 1:
        return len({p // bs for p in range(context)})
    worst = 0
    for start in range(bs):  # span [start, start + w] of w + 1 positions
        worst = max(worst, len({p // bs for p in range(start, start + w + 1)}))
    return min(worst, len({p // bs for p in range(context)}))


@settings(max_examples=150, deadline=None)
@given(w=st.integers(0, 70), context=st.integers(1, 200), bs=st.integers(1, 20))
def test_window_blocks_worst_case(w, context, bs):
    assert window_blocks(w, context, bs) == brute_window_blocks(w, context, bs)
    # and it is never less than the exact count at any context up to C with block-aligned requests
    c = context
    exact = len({p // bs for p in range(max(0, c - 1 - w), c)})
    assert window_blocks(w, c, bs) >= exact


def test_budget_against_hand_count():
    plan = AttentionPlan(
        layers=(
            layer(0, hkv=2, qk=16, v=16),
            layer(1, "sliding", hkv=4, qk=32, v=8, window=9, slide=(0, 4)),
            layer(2, "headwise", hkv=4, qk=16, v=16, window=9, slide=(1, 4)),
        )
    )
    bs, ctx, gib = 8, 100, 0.001
    b = kv_budget(plan, block_size=bs, dtype="fp16", memory_gib=gib, context=ctx)
    # bytes per token = element count of each layer's K+V with one block of one slot
    per_layer = [sum(math.prod(s) for s in cache_shapes(x, 1, 1)) * 2 for x in plan]
    assert list(b.bytes_per_token_per_layer) == per_layer == [2 * 32 * 2, 4 * 40 * 2, 4 * 32 * 2]
    assert b.bytes_per_token == sum(per_layer)
    assert b.bytes_per_block == bs * sum(per_layer)
    memory = int(gib * GIB)
    assert b.num_blocks * b.bytes_per_block <= memory < (b.num_blocks + 1) * b.bytes_per_block
    full_blocks = 13  # ceil(100 / 8)
    assert b.blocks_per_request == full_blocks and b.bytes_per_request == full_blocks * b.bytes_per_block
    # sliding heads keep ceil(9 / 8) + 1 = 3 pages; full heads keep 13
    pages = [2 * 13, 4 * 3, 1 * 13 + 3 * 3]
    slot_bytes = [32 * 2, 40 * 2, 32 * 2]
    assert b.bytes_per_request_recycled == sum(p * bs * s for p, s in zip(pages, slot_bytes, strict=True))
    assert b.max_requests == b.num_blocks // full_blocks
    assert b.max_requests_recycled == memory // b.bytes_per_request_recycled
    hkv = [2, 4, 4]
    assert b.max_requests_recycled_equal_pools == min(
        b.num_blocks * h // p for h, p in zip(hkv, pages, strict=True)
    )
    d = b.to_dict()
    assert d["bytes_per_token_per_layer"] == per_layer and d["dtype"] == "fp16"


def test_gpt_oss_numbers():
    b = kv_budget(plan_from_config("gpt-oss-20b"), block_size=64, dtype="bf16", memory_gib=40, context=8192)
    assert b.bytes_per_token == 24 * 8 * (64 + 64) * 2
    assert b.num_blocks == 40 * GIB // (64 * b.bytes_per_token)
    # 12 full layers keep 128 blocks, 12 sliding layers keep ceil(127 / 64) + 1 = 3
    assert b.bytes_per_request_recycled == (12 * 128 + 12 * 3) * 64 * 8 * 128 * 2
    assert b.max_requests_recycled > b.max_requests


def test_no_sliding_means_no_gain():
    b = kv_budget(plan_from_config("deepseek-v3"), 64, "fp8", 80, 4096)
    assert b.bytes_per_request == b.bytes_per_request_recycled
    assert b.max_requests == b.max_requests_recycled == b.max_requests_recycled_equal_pools


def test_blocks_for():
    assert [blocks_for(c, 4) for c in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("kw", [{"context": 0}, {"memory_gib": 0}, {"memory_gib": -1.0}, {"block_size": 0}])
def test_budget_bad_arguments(kw):
    args = {"block_size": 64, "dtype": "bf16", "memory_gib": 1.0, "context": 10} | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        kv_budget(plan_from_config("tiny"), **args)
