"""Window recycling under a CUDA graph: per-group page tables at fixed addresses, updated in place.

What the model runner does on the GPU (``serving/model_runner``): one int32 page table per layer
group (``[bsz * Hkv_g, max_blocks]``, whole-block groups expanded to pages per head, head-wise groups
one lane per head), allocated once; FastDeploy captures a decode step in a CUDA graph and, between
replays, the runner writes the scheduler's table changes into those same tensors. Here three layers
(full; sliding with its own kv head count and v 32; head-wise: one full and one sliding kv head)
run one decode step of the Triton backend each, captured once with torch's ``CUDAGraph``. Then
for 12 steps the head-wise manager (``kvcache/headwise.py``) grows every request by one token and
releases the pages that left the windows (poisoned with NaN in the cache), new tables and
metadata are copied into the captured buffers in place, and the replay must equal an eager run of
the same step on a copy of the same caches BITWISE (outputs and the caches after the step). The
tables never move (``data_ptr``).

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


def test_decode_steps_with_recycled_page_tables_replay_bitwise_as_eager():
    gen = torch.Generator().manual_seed(0)
    mgr = HeadwiseKVManager(PLAN, [BSZ * MAX_BLOCKS + 4, BSZ * 5 + 4, BSZ * MAX_BLOCKS + 4], BS)
    groups = {g.index: g for g in mgr.groups}
    layer_group = {li: g.index for g in mgr.groups for li in g.layers}
    assert {g.kind for g in mgr.groups} == {"full", "sliding", "headwise"}
    caches = []
    for layer in PLAN:
        nb = mgr.num_blocks[layer_group[layer.index]]
        shape = (nb, layer.num_kv_heads, BS)
        caches.append(
            (
                torch.randn(*shape, layer.qk_head_dim, generator=gen).to(DTYPE).cuda(),
                torch.randn(*shape, layer.v_head_dim, generator=gen).to(DTYPE).cuda(),
            )
        )
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
    tables = {g: t.cuda() for g, t in group_tables(mgr, rids).items()}  # allocated once
    ptrs = {g: t.data_ptr() for g, t in tables.items()}
    backend = TritonBackend(validate=True)  # host checks are skipped while capturing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) on copies, off the capture
        run(backend, static, [(k.clone(), v.clone()) for k, v in caches], tables)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(backend, static, caches, tables)

    released = 0
    for step in range(12):
        context = [c + 1 if c >= 0 else c for c in context]
        before = {g: t.clone() for g, t in group_tables(mgr, rids).items()}
        for rid, c in zip(rids, context, strict=True):
            if rid is not None:
                assert mgr.reserve(rid, c + 1, c)  # releases what left every window of query c
        new_tables = group_tables(mgr, rids)
        for g, old in before.items():  # pages that left the tables: poison them in every layer
            gone = set(old[old >= 0].tolist()) - set(new_tables[g][new_tables[g] >= 0].tolist())
            released += len(gone)
            h = groups[g].num_kv_heads
            for li in groups[g].layers:
                for cache in caches[li]:
                    for p in gone:
                        cache[p // h, p % h] = float("nan")
        new = step_inputs(gen, context)
        for name in ("cu", "bid", "dec"):
            static[name].copy_(new[name])
        for i in range(len(PLAN)):
            for name in ("q", "k", "v"):
                static[name][i].copy_(new[name][i])
        for g, t in new_tables.items():  # in place: the graph reads these addresses
            tables[g].copy_(t.cuda())
        copies = [(k.clone(), v.clone()) for k, v in caches]
        graph.replay()
        torch.cuda.synchronize()
        eager = run(
            TritonBackend(validate=True), static, copies, {g: t.cuda() for g, t in new_tables.items()}
        )
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(outs, eager, strict=True)):
            assert torch.isfinite(got).all(), (step, i)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            for a, b in zip(caches[i], copies[i], strict=True):  # the step's K/V writes too
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert released > 0
    assert {g: t.data_ptr() for g, t in tables.items()} == ptrs
