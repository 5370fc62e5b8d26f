"""A decode step of the Triton backend captured in a CUDA graph, replayed with new metadata.

FastDeploy captures decode steps (``use_cudagraph``, on by default) and replays them with the
same buffers holding another step's metadata: new context lengths, new block tables, new tokens.
So nothing the backend computes on the host may depend on the step's values: the launch bounds
come from shapes and from ``max_seq_len_this_time = 1`` (a decode-only step), never from the
metadata's contents (``max_context_len`` stays unknown), and nothing is copied to the host
during capture. Here the graph is captured once (torch's ``CUDAGraph``), then replayed twice with
other metadata copied into its buffers; each replay must equal an eager run of the same step and
dense attention. The caches are views of a wider uniform cache (FastDeploy's one shape).

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
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402

BSZ, HKV, GROUP, DQK, DV, BS, MAX_BLOCKS = 4, 2, 4, 64, 64, 16, 32  # up to 512 tokens per request
WIDE_H, WIDE_D = 4, 128  # the uniform cache the layer reads its leading heads / channels of
NUM_BLOCKS = BSZ * MAX_BLOCKS + 4
DTYPE = torch.float16

LAYERS = {
    "full": LayerAttention(
        index=0, kind="full", num_q_heads=HKV * GROUP, num_kv_heads=HKV, qk_head_dim=DQK, v_head_dim=DV,
        softmax_scale=DQK**-0.5,
    ),
    "sliding+sinks": LayerAttention(
        index=0, kind="sliding", num_q_heads=HKV * GROUP, num_kv_heads=HKV, qk_head_dim=DQK, v_head_dim=DV,
        softmax_scale=DQK**-0.5, window_left=100, sliding_kv_heads=(0, HKV), sink="learnable",
    ),
}  # fmt: skip


def make_step(seed: int, context: list[int]):
    """One decode step (one token per request; 0 = an idle slot): every tensor the graph reads, and
    each request's dense K/V history (context + this token) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    table = torch.full((BSZ, MAX_BLOCKS), -1, dtype=torch.int32)
    kc = torch.full((NUM_BLOCKS, WIDE_H, BS, WIDE_D), float("nan"), dtype=DTYPE)
    vc = torch.full((NUM_BLOCKS, WIDE_H, BS, WIDE_D), float("nan"), dtype=DTYPE)
    hist = []
    this = [1 if c >= 0 else 0 for c in context]
    for b, ctx in enumerate(context):
        ctx = max(ctx, 0)
        n = -(-(ctx + this[b]) // BS)
        for j in range(n):
            table[b, j] = perm.pop()
        hk = torch.randn(ctx + this[b], HKV, DQK, generator=gen).to(DTYPE)
        hv = torch.randn(ctx + this[b], HKV, DV, generator=gen).to(DTYPE)
        for pos in range(ctx):  # the context is in the cache already
            blk = int(table[b, pos // BS])
            kc[blk, :HKV, pos % BS, :DQK] = hk[pos]
            vc[blk, :HKV, pos % BS, :DV] = hv[pos]
        hist.append((hk, hv))
    t = sum(this)
    q = torch.randn(t, HKV * GROUP, DQK, generator=gen).to(DTYPE)
    k = torch.stack([hk[-1] for (hk, _), n in zip(hist, this, strict=True) if n])
    v = torch.stack([hv[-1] for (_, hv), n in zip(hist, this, strict=True) if n])
    cu = torch.tensor([0] + torch.tensor(this).cumsum(0).tolist(), dtype=torch.int32)
    bid = torch.repeat_interleave(torch.arange(BSZ, dtype=torch.int32), torch.tensor(this))
    dec = torch.tensor([max(c, 0) for c in context], dtype=torch.int32)
    sinks = torch.randn(HKV * GROUP, generator=gen) * 2
    tensors = dict(q=q, k=k, v=v, kc=kc, vc=vc, cu=cu, bid=bid, dec=dec, table=table, sinks=sinks)
    return {name: x.cuda() for name, x in tensors.items()}, hist, this


def run(backend, layer, s):
    """The step as the model runs it: a BatchMeta with step-independent launch bounds, views of the
    uniform cache."""
    meta = BatchMeta(
        seq_lens_encoder=torch.zeros(BSZ, dtype=torch.int32, device="cuda"),
        seq_lens_decoder=s["dec"],
        seq_lens_this_time=s["cu"][1:] - s["cu"][:-1],
        cu_seqlens_q=s["cu"],
        batch_id_per_token=s["bid"],
        block_tables=s["table"],
        block_size=BS,
        max_seq_len_this_time=1,  # decode-only: FastDeploy's host flag, not the metadata's values
        max_context_len=None,
    )
    caches = (s["kc"][:, :HKV, :, :DQK], s["vc"][:, :HKV, :, :DV])
    sinks = s["sinks"] if layer.sink == "learnable" else None
    return backend.forward(s["q"], s["k"], s["v"], layer, meta, caches, sinks)


def check_against_dense(out, layer, s, hist, this):
    row = 0
    for b, n in enumerate(this):
        if not n:
            continue
        hk, hv = hist[b]
        want = dense_attention(
            s["q"][row : row + 1], hk.cuda(), hv.cuda(), scale=layer.softmax_scale,
            window_left=layer.window_left, sliding_heads=layer.sliding_kv_heads, sink_kind=layer.sink,
            sinks=s["sinks"], compute_dtype=torch.float32,
        ).reshape(1, -1)  # fmt: skip
        got = out[row : row + 1].float()
        err = float((got - want).norm() / want.norm())
        assert err < 3e-3, f"request {b}: relative error {err:.2e}"
        row += 1


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_decode_step_captured_in_a_cuda_graph_replays_with_new_metadata(kind):
    layer = LAYERS[kind]
    backend = TritonBackend(validate=True)  # host checks are skipped while capturing
    # every step has the same shapes: BSZ slots, T = 3 tokens (one slot idle)
    first = make_step(0, [40, 7, -1, 130])
    static, _, _ = first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) off the capture
        run(backend, layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(backend, layer, static)

    for seed, context in ((1, [300, -1, 15, 64]), (2, [0, 511, 33, -1])):
        new, hist, this = make_step(seed, context)
        assert sum(this) == static["q"].shape[0]
        for name, x in new.items():  # FastDeploy refills its buffers in place
            static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager = run(TritonBackend(validate=True), layer, new)  # same step, eager, on its own copy
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)  # same kernels, same launch bounds
        check_against_dense(out, layer, new, hist, this)
        # the step's K/V landed in the graph's cache exactly where the eager step put them
        assert torch.equal(static["kc"].nan_to_num(7.0), new["kc"].nan_to_num(7.0))
        assert torch.equal(static["vc"].nan_to_num(7.0), new["vc"].nan_to_num(7.0))


def test_bad_table_in_a_replayed_graph_is_named_not_an_illegal_address():
    """Served mode under a CUDA graph: a replay whose block table holds an entry past the cache (or a
    -1 inside the context) reads nothing outside the cache; the backend's device flag, allocated by the
    warm-up before capture, names the entry when the serving loop checks it after the step."""
    layer = LAYERS["full"]
    backend = TritonBackend(validate=False, host_checks=False, check_every=1)
    static, _, _ = make_step(0, [40, 7, -1, 130])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(backend, layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    backend.step_done()  # the warm-up step was clean
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(backend, layer, static)
    for req, blk, value, pattern in ((3, 2, 2**30, "past the cache"), (0, 1, -1, "negative")):
        new, hist, this = make_step(1, [300, -1, 15, 64]) if req == 3 else make_step(2, [100, 5, 9, -1])
        new["table"][req, blk] = value
        for name, x in new.items():
            static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()  # the step's output is synchronised: the check costs no extra sync
        with pytest.raises(ValueError, match=rf"request {req}, logical block {blk}: .*{pattern}"):
            backend.step_done()
        good = [b for b, n in enumerate(this) if n and b != req]
        assert torch.isfinite(out[[sum(this[:b]) for b in good]]).all()
    new, hist, this = make_step(3, [20, 30, -1, 40])  # a clean step: the device is healthy
    for name, x in new.items():
        static[name].copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    backend.step_done()  # the report cleared the flag; nothing new
    check_against_dense(out, layer, new, hist, this)
