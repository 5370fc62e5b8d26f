"""runner/batch.py: allocator, per-step BatchMeta in FastDeploy's semantics, cache allocation."""

from __future__ import annotations

import math

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import (  # noqa: E402
    BlockAllocator,
    PagedKVState,
    allocate_kv_caches,
    build_meta,
)


def _np(x):
    return x.numpy().tolist()


def test_allocator_all_or_nothing_and_double_free():
    a = BlockAllocator(5)
    got = a.allocate(3)
    assert sorted(got) == [0, 1, 2] and a.num_free == 2
    with pytest.raises(ValueError, match=r"cannot allocate n=3 blocks: only 2 of 5 free"):
        a.allocate(3)
    assert a.num_free == 2
    a.free(got[:1])
    with pytest.raises(ValueError, match=r"cannot free blocks=\[.*\]: not allocated"):
        a.free(got[:1])
    with pytest.raises(ValueError, match=r"n must be an int >= 0, got -1"):
        a.allocate(-1)
    assert a.num_free == 3


def test_allocator_shuffle_is_a_permutation():
    a = BlockAllocator(64, shuffle_seed=1)
    got = a.allocate(64)
    assert sorted(got) == list(range(64)) and got != list(range(64))


def test_schedule_follows_fastdeploy_semantics():
    s = PagedKVState(num_blocks=16, block_size=4, max_blocks_per_seq=5)
    m = s.schedule([("a", 6), ("b", 1)])  # two fresh requests: both prefill (b has 0 cached)
    assert _np(m.seq_lens_encoder) == [6, 1]
    assert _np(m.seq_lens_decoder) == [0, 0]
    assert _np(m.seq_lens_this_time) == [6, 1]
    assert _np(m.cu_seqlens_q) == [0, 6, 7]
    assert _np(m.batch_id_per_token) == [0, 0, 0, 0, 0, 0, 1]
    assert m.block_tables.shape == [2, 5] and m.block_tables.dtype == paddle.int32
    assert _np(m.block_tables) == [[0, 1, -1, -1, -1], [2, -1, -1, -1, -1]]
    assert (m.max_seq_len_this_time, m.max_context_len, m.block_size) == (6, 6, 4)
    assert _np(s.positions(m)) == [0, 1, 2, 3, 4, 5, 0]
    assert s.positions(m).dtype == paddle.int64

    m = s.schedule([("b", 1), ("a", 3), ("c", 2)])  # decode, chunk with context, new prefill
    assert _np(m.seq_lens_encoder) == [0, 3, 2]
    assert _np(m.seq_lens_decoder) == [1, 6, 0]
    assert _np(m.cu_seqlens_q) == [0, 1, 4, 6]
    assert _np(m.batch_id_per_token) == [0, 1, 1, 1, 2, 2]
    assert _np(m.block_tables)[:2] == [[2, -1, -1, -1, -1], [0, 1, 3, -1, -1]]
    assert _np(s.positions(m)) == [1, 6, 7, 8, 0, 1]
    assert m.max_context_len == 9
    assert (s.cached_tokens("a"), s.cached_tokens("b"), s.cached_tokens("zzz")) == (9, 2, 0)
    assert s.blocks_used == 5 and s.block_table("a") == [0, 1, 3]

    s.release("a")
    assert s.blocks_used == 2 and s.cached_tokens("a") == 0
    with pytest.raises(ValueError, match=r"unknown request id 'a'"):
        s.release("a")


def test_schedule_failure_changes_nothing():
    s = PagedKVState(num_blocks=3, block_size=2, max_blocks_per_seq=4, shuffle_seed=0)
    s.schedule([(0, 3)])
    before = (s.blocks_used, s.block_table(0), s.cached_tokens(0))
    with pytest.raises(ValueError, match=r"step needs 2 new blocks, only 1 free"):
        s.schedule([(0, 1), (1, 4)])
    with pytest.raises(ValueError, match=r"request 0 needs 5 blocks for 9 tokens, max_blocks_per_seq=4"):
        s.schedule([(0, 6)])
    with pytest.raises(ValueError, match=r"steps repeat a request id"):
        s.schedule([(0, 1), (0, 1)])
    with pytest.raises(ValueError, match=r"new tokens for request 0 must be an int >= 0, got -1"):
        s.schedule([(0, -1)])
    assert (s.blocks_used, s.block_table(0), s.cached_tokens(0)) == before


def test_build_meta_explicit_lists():
    m = build_meta([4, 0, 2], [1, 3, 0], [[5, 6], [1]], 4, is_prefill=[True, False, False])
    assert _np(m.seq_lens_encoder) == [1, 0, 0]
    assert _np(m.block_tables) == [[5, 6], [1, -1]]
    assert m.max_context_len == 5 and m.max_seq_len_this_time == 3
    tables = build_meta([0], [2], [[0]], 4, block_tables_headwise={7: [[3], [1, 2]]})
    assert _np(tables.headwise_table(7)) == [[3, -1], [1, 2]] and tables.headwise_table(1) is None
    with pytest.raises(ValueError, match=r"seq_lens_decoder=\[0\] and seq_lens_this_time=\[1, 1\] differ"):
        build_meta([0], [1, 1], [[0]], 4)
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got 0"):
        build_meta([0], [1], [[0]], 0)


def test_allocate_kv_caches_per_layer_shapes():
    def layer(i, hkv, dqk, dv):
        return LayerAttention(i, "full", hkv * 2, hkv, dqk, dv, 1.0)

    plan = AttentionPlan(layers=(layer(0, 2, 16, 8), layer(1, 1, 32, 32)))
    caches = allocate_kv_caches(plan, 5, 4, fill=float("nan"))
    assert [(k.shape, v.shape) for k, v in caches] == [
        ([5, 2, 4, 16], [5, 2, 4, 8]),
        ([5, 1, 4, 32], [5, 1, 4, 32]),
    ]
    assert math.isnan(float(caches[0][0][0, 0, 0, 0]))
    zeros = allocate_kv_caches(list(plan), 2, 4)
    assert np.all(zeros[1][1].numpy() == 0)
