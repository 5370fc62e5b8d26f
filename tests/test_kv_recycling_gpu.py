"""Window recycling under a CUDA graph: the one KV pool, per-group page tables at fixed addresses.

What the model runner does on the GPU (``serving/model_runner``): the one pool of
``kvcache/pools.py`` (slot tensors whose pages any group takes, every layer a view of its slot) and
one int32 page table per group (``[bsz * Hkv_g, max_blocks]``, a lane's page per head), allocated
once; FastDeploy captures a decode step in a CUDA graph and, between replays, the runner writes the
scheduler's table changes into those same tensors. Here three layers (full; sliding with its own kv
head count and v 32, a view of the slot's leading channels; head-wise: one full and one sliding kv
head) share ONE slot of the pool and run one decode step of the Triton backend each, captured once
with torch's ``CUDAGraph``. Then for 12 steps the shared-pool manager (``kvcache/headwise.py``)
grows every request by one token and releases the pages that left the windows (poisoned with NaN
in the slot), new tables and metadata are copied into the captured buffers in place, and the replay
must equal an eager run of the same step on a copy of the same pool BITWISE (outputs and the pool
after the step). The tables never move (``data_ptr``).

Needs a CUDA GPU (``gpu`` marker); skipped without one and under ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU (CUDA graphs cannot be captured under the Triton interpreter)",
    ),
]

from fastdeploy_paddlefleet.backends.base import BatchMeta  # noqa: E402
from fastdeploy_paddlefleet.backends.triton import TritonBackend  # noqa: E402
from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager  # noqa: E402
from fastdeploy_paddlefleet.kvcache.pools import pool_layout  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention  # noqa: E402

BSZ, BS, MAX_BLOCKS, WINDOW, GROUP = 4, 16, 32, 40, 4
DTYPE = torch.float16
PLAN = AttentionPlan(
    layers=(
        LayerAttention(
            index=0, kind="full", num_q_heads=2 * GROUP, num_kv_heads=2, qk_head_dim=64, v_head_dim=64,
            softmax_scale=0.125,
        ),
        LayerAttention(
            index=1, kind="sliding", num_q_heads=4 * GROUP, num_kv_heads=4, qk_head_dim=64, v_head_dim=32,
            softmax_scale=0.125, window_left=WINDOW, sliding_kv_heads=(0, 4), sink="learnable",
        ),
        LayerAttention(
            index=2, kind="headwise", num_q_heads=2 * GROUP, num_kv_heads=2, qk_head_dim=64, v_head_dim=64,
            softmax_scale=0.125, window_left=WINDOW, sliding_kv_heads=(1, 2),
        ),
    )
)  # fmt: skip


def group_tables(mgr, rids):
    """``{group: int32 [BSZ * Hkv, MAX_BLOCKS]}`` in the kernels' page format (None: idle slot)."""
    return {g: torch.from_numpy(t) for g, t in mgr.group_tables(rids, MAX_BLOCKS).items()}


def run(backend, s, caches, tables):
    """One decode step of every layer; ``tables``: the per-group page tables the step reads."""
    meta = BatchMeta(
        seq_lens_encoder=s["enc"],
        seq_lens_decoder=s["dec"],
        seq_lens_this_time=s["cu"][1:] - s["cu"][:-1],
        cu_seqlens_q=s["cu"],
        batch_id_per_token=s["bid"],
        block_tables=s["unused_blocks"],
        block_size=BS,
        block_tables_headwise={li: tables[g] for li, g in s["layer_group"].items()},
        max_seq_len_this_time=1,
        max_context_len=None,
    )
    outs = []
    for layer in PLAN:
        i = layer.index
        sinks = s["sinks"][i] if layer.sink == "learnable" else None
        outs.append(backend.forward(s["q"][i], s["k"][i], s["v"][i], layer, meta, caches[i], sinks))
    return outs


def step_inputs(gen, context):
    this = [1 if c >= 0 else 0 for c in context]
    t = sum(this)
    q, k, v = [], [], []
    for layer in PLAN:
        q.append(torch.randn(t, layer.num_q_heads, layer.qk_head_dim, generator=gen).to(DTYPE))
        k.append(torch.randn(t, layer.num_kv_heads, layer.qk_head_dim, generator=gen).to(DTYPE))
        v.append(torch.randn(t, layer.num_kv_heads, layer.v_head_dim, generator=gen).to(DTYPE))
    cu = torch.tensor([0] + torch.tensor(this).cumsum(0).tolist(), dtype=torch.int32)
    bid = torch.repeat_interleave(torch.arange(BSZ, dtype=torch.int32), torch.tensor(this))
    dec = torch.tensor([max(c, 0) for c in context], dtype=torch.int32)
    cuda = lambda xs: [x.cuda() for x in xs]  # noqa: E731
    enc = torch.zeros(BSZ, dtype=torch.int32)  # decode only; made here: no host copy while capturing
    return dict(q=cuda(q), k=cuda(k), v=cuda(v), cu=cu.cuda(), bid=bid.cuda(), dec=dec.cuda(), enc=enc.cuda())


def layer_views(pool, slot_k, slot_v):
    """Each layer's ``(key, value)``: its slot ``[rows, G, BS, D]`` reshaped to ``[rows * G / Hkv, Hkv, BS,
    D]``, the leading channels of its own head dims (as the runner's ``sizing.pool_caches`` views)."""
    where = pool.layer_slots()
    out = []
    for layer in PLAN:
        t = where[layer.index][1]
        k, v = slot_k[t], slot_v[t]
        n = k.shape[0] * k.shape[1] // layer.num_kv_heads
        kv = k.view(n, layer.num_kv_heads, BS, k.shape[-1])[..., : layer.qk_head_dim]
        vv = v.view(n, layer.num_kv_heads, BS, v.shape[-1])[..., : layer.v_head_dim]
        out.append((kv, vv))
    return out


def held_pages(mgr, rids):
    """Pool pages the requests hold, any group, any lane."""
    return {u for rid in rids if rid for lanes in mgr.lane_ids(rid) for ids in lanes for u in ids if u >= 0}


def test_decode_steps_with_recycled_page_tables_replay_bitwise_as_eager():
    gen = torch.Generator().manual_seed(0)
    pool = pool_layout(PLAN, BS)
    assert {g.kind for g in pool.groups} == {"full", "sliding", "headwise"} and pool.slots == 1
    num_pages = pool.num_pages(BSZ * MAX_BLOCKS)
    rows = pool.alloc_pages(num_pages)
    mgr = HeadwiseKVManager.shared(pool.groups, num_pages, BS, pool.mode)
    layer_group = pool.layer_group()
    g = pool.heads_per_page
    slot_k = [torch.randn(rows, g, BS, pool.qk_head_dim, generator=gen).to(DTYPE).cuda()]
    slot_v = [torch.randn(rows, g, BS, pool.v_head_dim, generator=gen).to(DTYPE).cuda()]
    caches = layer_views(pool, slot_k, slot_v)
    assert not caches[1][1].is_contiguous()  # the sliding layer's v 32 of the slot's 64 channels
    # requests start with long contexts (beyond the window): one slot stays idle
    context = [150, 37, -1, 260]
    rids = [f"r{b}" if c >= 0 else None for b, c in enumerate(context)]
    for rid, c in zip(rids, context, strict=True):
        if rid is not None:
            mgr.admit(rid)
            assert mgr.reserve(rid, c + 1, c)
    static = step_inputs(gen, context)
    static["sinks"] = {1: (torch.randn(PLAN[1].num_q_heads, generator=gen) * 2).cuda()}
    static["layer_group"] = layer_group
    static["unused_blocks"] = torch.full((BSZ, MAX_BLOCKS), -1, dtype=torch.int32).cuda()
    tables = {gi: t.cuda() for gi, t in group_tables(mgr, rids).items()}  # allocated once
    ptrs = {gi: t.data_ptr() for gi, t in tables.items()}
    backend = TritonBackend(validate=True)  # host checks are skipped while capturing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) on copies, off the capture
        warm = layer_views(pool, [t.clone() for t in slot_k], [t.clone() for t in slot_v])
        run(backend, static, warm, tables)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(backend, static, caches, tables)

    released = 0
    for step in range(12):
        context = [c + 1 if c >= 0 else c for c in context]
        held = held_pages(mgr, rids)
        for rid, c in zip(rids, context, strict=True):
            if rid is not None:
                assert mgr.reserve(rid, c + 1, c)  # releases what left every window of query c
        for page in held - held_pages(mgr, rids):  # released: NaN in the slot, every group's view
            slot_k[0][page] = float("nan")
            slot_v[0][page] = float("nan")
            released += 1
        new_tables = group_tables(mgr, rids)
        new = step_inputs(gen, context)
        for name in ("cu", "bid", "dec"):
            static[name].copy_(new[name])
        for i in range(len(PLAN)):
            for name in ("q", "k", "v"):
                static[name][i].copy_(new[name][i])
        for gi, t in new_tables.items():  # in place: the graph reads these addresses
            tables[gi].copy_(t.cuda())
        copy_k, copy_v = [t.clone() for t in slot_k], [t.clone() for t in slot_v]
        graph.replay()
        torch.cuda.synchronize()
        eager = run(
            TritonBackend(validate=True),
            static,
            layer_views(pool, copy_k, copy_v),
            {gi: t.cuda() for gi, t in new_tables.items()},
        )
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(outs, eager, strict=True)):
            assert torch.isfinite(got).all(), (step, i)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(slot_k + slot_v, copy_k + copy_v, strict=True):  # the step's K/V writes too
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert released > 0
    assert {gi: t.data_ptr() for gi, t in tables.items()} == ptrs
