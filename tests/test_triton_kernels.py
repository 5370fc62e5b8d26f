"""Triton paged-attention kernels and the triton backend against a dense reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (fp32 / fp16, small shapes); with a CUDA GPU
the same cases run compiled, plus ``gpu``-marked cases in bf16 at realistic shapes.

Every case builds a packed batch the way FastDeploy's worker does: a cache that starts as NaN,
shuffled physical blocks, context K/V already in the cache (scattered here by plain indexing, not
by the kernel), this step's K/V written by the cache-write kernel, then attention. Pages a sliding
head can no longer see are NaN-filled and marked -1, so a read through -1 (or of a stale slot)
shows up as NaN. The reference (``kernels/dense_reference.py``) sees each request's dense K/V
history with an explicit mask and the sink as a score column.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
#: the first variant of each parametrized GPU test stays in ``-m gpu``, the rest are ``gpu_long``
#: (conftest.py: each compiles its own kernels)
GPU_LONG_VARIANTS = True
CUDA = torch.cuda.is_available()
if not CUDA:  # before the kernels are defined: @triton.jit reads it at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import TileConfig, paged_attention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# relative error ||out - ref|| / ||ref|| allowed per input dtype (fp32 on GPU: tf32 dots)
REL_TOL = {torch.float32: 3e-3 if CUDA else 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@dataclass
class Step:
    """One packed step: inputs, caches, metadata, and each request's dense K/V history."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cu: torch.Tensor
    dec: torch.Tensor
    bid: torch.Tensor
    table: torch.Tensor
    headwise: bool
    hist_k: list
    hist_v: list
    reqs: list


def make_step(
    reqs: list[tuple[int, int]],
    *,
    hkv: int,
    group: int,
    dqk: int,
    dv: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    headwise: bool = False,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    release: bool = False,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> Step:
    """``reqs``: per request ``(context tokens already cached, new tokens this step)``."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    totals = [c + n for c, n in reqs]
    nblk = [-(-t // bs) for t in totals]
    max_blocks = max(nblk) + 1
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    blocks = torch.full((len(reqs), max_blocks), -1, dtype=torch.int32)
    it = iter(perm)
    for b, n in enumerate(nblk):
        for j in range(n):
            blocks[b, j] = next(it)
    pages = None
    if headwise:  # any free page can serve any head: permute heads inside each block
        pages = torch.full((len(reqs) * hkv, max_blocks), -1, dtype=torch.int32)
        for b, n in enumerate(nblk):
            for j in range(n):
                hp = torch.randperm(hkv, generator=gen)
                for h in range(hkv):
                    pages[b * hkv + h, j] = blocks[b, j] * hkv + hp[h]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    kc = torch.full((num_blocks, hkv, bs, dqk), float("nan"), dtype=dtype)
    vc = torch.full((num_blocks, hkv, bs, dv), float("nan"), dtype=dtype)
    kc_pages, vc_pages = kc.view(-1, bs, dqk), vc.view(-1, bs, dv)
    hist_k = [randn(t, hkv, dqk) for t in totals]
    hist_v = [randn(t, hkv, dv) for t in totals]

    def page_of(b, h, pos):  # pos: int or a LongTensor of positions
        if pages is not None:
            return pages[b * hkv + h, pos // bs].long()
        return blocks[b, pos // bs].long() * hkv + h

    for b, (ctx, _) in enumerate(reqs):  # context: scattered by plain indexing
        pos = torch.arange(ctx)
        for h in range(hkv):
            kc_pages[page_of(b, h, pos), pos % bs] = hist_k[b][:ctx, h]
            vc_pages[page_of(b, h, pos), pos % bs] = hist_v[b][:ctx, h]
    if release and window_left is not None:  # pages no query of this step can see: NaN and -1
        h0, h1 = sliding_heads or (0, hkv)
        for b, (ctx, _) in enumerate(reqs):
            for j in range(max(0, ctx - window_left) // bs):
                if pages is not None:
                    for h in range(h0, h1):
                        kc_pages[page_of(b, h, j * bs)] = float("nan")
                        vc_pages[page_of(b, h, j * bs)] = float("nan")
                        pages[b * hkv + h, j] = -1
                elif (h0, h1) == (0, hkv):
                    kc[int(blocks[b, j])] = float("nan")
                    vc[int(blocks[b, j])] = float("nan")
                    blocks[b, j] = -1
    lens = [n for _, n in reqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    q = randn(t, hkv * group, dqk)
    k = torch.cat([hist_k[b][c:] for b, (c, _) in enumerate(reqs)])
    v = torch.cat([hist_v[b][c:] for b, (c, _) in enumerate(reqs)])
    bid = torch.repeat_interleave(torch.arange(len(reqs), dtype=torch.int32), torch.tensor(lens))
    dec = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
    table = pages if headwise else blocks
    d = device
    return Step(
        q.to(d),
        k.to(d),
        v.to(d),
        kc.to(d),
        vc.to(d),
        cu.to(d),
        dec.to(d),
        bid.to(d),
        table.to(d),
        headwise,
        [x.to(d) for x in hist_k],
        [x.to(d) for x in hist_v],
        reqs,
    )


def run_and_check(
    s: Step,
    *,
    scale: float | None = None,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    sink_kind: str = "vanilla",
    seed: int = 0,
    **kw,
) -> float:
    """Write this step's K/V, attend, compare every request with the dense reference; return the
    worst relative error (and assert it is within the dtype's tolerance)."""
    dqk = s.q.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(dqk)
    sinks = None
    if sink_kind == "learnable":
        sinks = (torch.randn(s.q.shape[1], generator=torch.Generator().manual_seed(seed)) * 2).to(s.q.device)
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=s.headwise)
    # the kernel's writes land where the context scatter would have put them
    kc_pages = s.key_cache.view(-1, s.key_cache.shape[2], dqk)
    bs = s.key_cache.shape[2]
    hkv = s.key_cache.shape[1]
    for b, (ctx, n) in enumerate(s.reqs):
        for pos in (ctx, ctx + n - 1) if n else ():
            for h in range(hkv):
                if s.headwise:
                    page = int(s.table[b * hkv + h, pos // bs])
                else:
                    page = int(s.table[b, pos // bs]) * hkv + h
                assert torch.equal(kc_pages[page, pos % bs], s.hist_k[b][pos, h])
    out = torch.full((s.q.shape[0], s.q.shape[1], s.value_cache.shape[3]), float("nan"), dtype=s.q.dtype)
    out = out.to(s.q.device)
    got = paged_attention(
        s.q,
        s.key_cache,
        s.value_cache,
        s.cu,
        s.dec,
        s.table,
        scale=scale,
        headwise=s.headwise,
        window_left=window_left,
        sliding_heads=sliding_heads,
        sink_kind=sink_kind,
        sinks=sinks,
        out=out,
        **kw,
    )
    assert got is out
    worst = 0.0
    for b, (_, n) in enumerate(s.reqs):
        if n == 0:
            continue
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            s.q[lo:hi],
            s.hist_k[b],
            s.hist_v[b],
            scale=scale,
            window_left=window_left,
            sliding_heads=sliding_heads,
            sink_kind=sink_kind,
            sinks=sinks,
            compute_dtype=torch.float64 if s.q.device.type == "cpu" else torch.float32,
        )
        o = out[lo:hi].to(want.dtype)
        assert torch.isfinite(o).all(), f"request {b}: non-finite output (read a -1 page or stale slot?)"
        err = float((o - want).norm() / want.norm().clamp_min(1e-6))
        worst = max(worst, err)
    assert worst <= REL_TOL[s.q.dtype], f"relative error {worst:.2e} > {REL_TOL[s.q.dtype]:.0e}"
    return worst


# ------------------------------------------------------------------------------ cache write


@pytest.mark.parametrize("headwise", [False, True])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cache_write_lands_in_the_right_slots(headwise, block_size):
    s = make_step(
        [(5, 3), (0, 7), (17, 1)], hkv=2, group=2, dqk=24, dv=16, block_size=block_size, headwise=headwise
    )
    kc0, vc0 = s.key_cache.clone(), s.value_cache.clone()
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=headwise)
    want_k, want_v = kc0.view(-1, block_size, 24), vc0.view(-1, block_size, 16)
    hkv = 2
    for b, (ctx, n) in enumerate(s.reqs):
        for pos in range(ctx, ctx + n):
            for h in range(hkv):
                if headwise:
                    page = int(s.table[b * hkv + h, pos // block_size])
                else:
                    page = int(s.table[b, pos // block_size]) * hkv + h
                want_k[page, pos % block_size] = s.hist_k[b][pos, h]
                want_v[page, pos % block_size] = s.hist_v[b][pos, h]
    assert torch.equal(s.key_cache.nan_to_num(7.0), kc0.nan_to_num(7.0))
    assert torch.equal(s.value_cache.nan_to_num(7.0), vc0.nan_to_num(7.0))


# ------------------------------------------------------------------------------ named cases

MIXED = [(0, 13), (20, 1), (37, 1), (5, 7), (0, 1), (64, 0), (31, 33)]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("sink_kind", ["vanilla", "off-by-one", "learnable"])
def test_mixed_batch_gqa_and_sinks(group, sink_kind):
    s = make_step(MIXED, hkv=2, group=group, dqk=32, dv=16, block_size=16, seed=group)
    run_and_check(s, sink_kind=sink_kind, seed=group)


@pytest.mark.parametrize("window", [0, 1, 3, 17, 1000])
def test_sliding_window(window):
    s = make_step(MIXED, hkv=2, group=4, dqk=32, dv=32, block_size=4, window_left=window, release=True)
    run_and_check(s, window_left=window, sink_kind="learnable")


@pytest.mark.parametrize("window", [0, 5])
def test_headwise_pages_with_released_nan_pages(window):
    reqs = [(40, 6), (50, 1), (9, 1), (3, 20)]
    kw = dict(hkv=4, group=2, dqk=16, dv=32, block_size=4, window_left=window, sliding_heads=(2, 4))
    s = make_step(reqs, headwise=True, release=True, **kw)
    assert (s.table == -1).any()
    run_and_check(s, window_left=window, sliding_heads=(2, 4), sink_kind="off-by-one")


@pytest.mark.parametrize("block_size", [1, 8, 32, 64])
def test_block_sizes_around_the_key_tile(block_size):
    # CPU key tile is 32 keys: pages smaller than, equal to and larger than a tile
    s = make_step(MIXED, hkv=2, group=2, dqk=16, dv=16, block_size=block_size, seed=block_size)
    run_and_check(s, window_left=9)


@pytest.mark.parametrize("dims", [(24, 40), (48, 16), (192, 128)])
def test_qk_dim_differs_from_v_dim(dims):
    dqk, dv = dims
    s = make_step([(6, 5), (30, 1)], hkv=2, group=1, dqk=dqk, dv=dv, block_size=16)
    run_and_check(s, sink_kind="learnable")


@pytest.mark.parametrize("splits", [2, 8, 32])
def test_split_kv_long_decode(splits):
    reqs = [(300, 1), (5, 1), (129, 1), (0, 1)]  # 32 splits of 4 requests leaves some splits empty
    s = make_step(reqs, hkv=2, group=4, dqk=32, dv=16, block_size=16, window_left=100, release=True)
    run_and_check(s, window_left=100, sink_kind="learnable", num_splits=splits)
    s = make_step(reqs, hkv=2, group=4, dqk=32, dv=16, block_size=16, seed=1)
    run_and_check(s, num_splits=splits, sink_kind="off-by-one")


def test_chunked_prefill_with_context_and_tile_shapes():
    reqs = [(70, 40), (3, 66)]
    for cfg in (TileConfig(block_m=16, block_n=16), TileConfig(block_m=64, block_n=64)):
        s = make_step(reqs, hkv=1, group=4, dqk=32, dv=32, block_size=16)
        run_and_check(s, window_left=20, sink_kind="learnable", prefill_config=cfg)


def test_register_cap_keeps_results():
    """``TileConfig.maxnreg`` (Triton's register cap) changes the compiled code, never the result; out
    of range the config is refused by name when it is made."""
    reqs = [(70, 9), (33, 1)]
    cfg = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, maxnreg=128)
    s = make_step(reqs, hkv=2, group=2, dqk=32, dv=16, block_size=16)
    run_and_check(s, sink_kind="learnable", prefill_config=cfg, decode_config=cfg)
    with pytest.raises(ValueError, match="maxnreg"):
        TileConfig(block_m=16, block_n=16, maxnreg=300)


def test_tma_code_path():
    """The TMA variant (one page per key tile); runs under the interpreter too."""
    reqs = [(70, 40), (33, 1), (100, 1)]
    cfg = TileConfig(block_m=32, block_n=16, use_tma=True)
    s = make_step(reqs, hkv=2, group=2, dqk=32, dv=16, block_size=32, window_left=30, release=True)
    run_and_check(
        s, window_left=30, sink_kind="learnable", prefill_config=cfg, decode_config=cfg, num_splits=2
    )


def test_host_hints_pick_kernels():
    dec = make_step([(40, 1), (3, 1)], hkv=2, group=4, dqk=16, dv=16, block_size=8)
    run_and_check(dec, max_q_len=1, max_context_len=41)
    pre = make_step([(10, 9), (0, 9)], hkv=2, group=4, dqk=16, dv=16, block_size=8)
    run_and_check(pre, max_q_len=9, max_context_len=19)
    mixed = make_step([(10, 9), (4, 1)], hkv=2, group=4, dqk=16, dv=16, block_size=8)
    run_and_check(mixed, max_q_len=9, max_context_len=19)


def test_fp16_inputs():
    s = make_step(MIXED, hkv=2, group=4, dqk=32, dv=16, block_size=16, dtype=torch.float16)
    run_and_check(s, window_left=6, sink_kind="learnable")


def test_empty_batch_returns_empty():
    q = torch.zeros(0, 4, 16, device=DEVICE)
    kc = torch.zeros(2, 2, 4, 16, device=DEVICE)
    cu = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = paged_attention(
        q, kc, kc, cu, cu[:1], torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), scale=1.0
    )
    assert out.shape == (0, 4, 16)


def test_bad_arguments_raise():
    q = torch.zeros(3, 4, 16)
    kc = torch.zeros(2, 2, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    tbl = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sink_kind"):
        paged_attention(q, kc, kc, cu, cu[:1], tbl, scale=1.0, sink_kind="bogus")
    with pytest.raises(ValueError, match="learnable"):
        paged_attention(q, kc, kc, cu, cu[:1], tbl, scale=1.0, sink_kind="learnable")
    with pytest.raises(ValueError, match="key_cache"):
        paged_attention(q, kc[:, :, :, :8], kc, cu, cu[:1], tbl, scale=1.0)
    with pytest.raises(ValueError, match="window_left"):
        paged_attention(q, kc, kc, cu, cu[:1], tbl, scale=1.0, window_left=-1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(q, kc, kc, cu, cu[:1], tbl, scale=1.0, num_splits=0)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(torch.zeros(3, 3, 16), kc, kc, cu, cu[:1], tbl, scale=1.0)


# ------------------------------------------------------------------------------ randomized


@st.composite
def cases(draw):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    kind = draw(st.sampled_from(["full", "sliding", "headwise"]))
    hkv = 4 if kind == "headwise" else draw(st.sampled_from([1, 2]))
    dqk = draw(st.sampled_from([16, 32, 40]))
    dv = draw(st.sampled_from([16, 32]))
    window = draw(st.sampled_from([0, 1, 2, 7, 30, 500])) if kind != "full" else None
    sliding = (draw(st.integers(1, 3)), 4) if kind == "headwise" else None
    bsz = draw(st.integers(1, 5))
    reqs = [
        (draw(st.integers(0, 90)), draw(st.one_of(st.just(1), st.just(0), st.integers(1, 40))))
        for _ in range(bsz)
    ]
    if all(n == 0 for _, n in reqs):
        reqs[0] = (reqs[0][0], 1)
    return dict(
        reqs=reqs,
        hkv=hkv,
        group=group,
        dqk=dqk,
        dv=dv,
        block_size=draw(st.sampled_from([1, 4, 16, 64])),
        headwise=kind == "headwise" or draw(st.booleans()),
        window_left=window,
        sliding_heads=sliding,
        release=window is not None and draw(st.booleans()),
        seed=draw(st.integers(0, 2**20)),
    ), dict(
        window_left=window,
        sliding_heads=sliding,
        sink_kind=draw(st.sampled_from(["vanilla", "off-by-one", "learnable"])),
        num_splits=draw(st.sampled_from([None, 1, 3])),
    )


# fewer examples compiled on a GPU (each new shape is a compile); more interpreted on CPU
@settings(max_examples=15 if CUDA else 40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_random_batches_match_dense_reference(case):
    build, attend = case
    s = make_step(**build)
    run_and_check(s, seed=build["seed"], **attend)


# ------------------------------------------------------------------------------ backend


def _layer(hkv, group, dqk, dv, kind="full", window=None, sliding=None, sink="vanilla"):
    from fastdeploy_paddlefleet.plan.layer import LayerAttention

    ranges = {"full": None, "sliding": (0, hkv), "headwise": sliding}
    return LayerAttention(
        index=3,
        kind=kind,
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        qk_head_dim=dqk,
        v_head_dim=dv,
        softmax_scale=1.0 / math.sqrt(dqk),
        window_left=window,
        sliding_kv_heads=ranges[kind],
        sink=sink,
    )


def _meta(s: Step, block_size: int, as_mapping: bool = False):
    from fastdeploy_paddlefleet.backends.base import BatchMeta

    lens = (s.cu[1:] - s.cu[:-1]).to(torch.int32)
    table = s.table
    return BatchMeta(
        seq_lens_encoder=torch.where(s.dec == 0, lens, torch.zeros_like(lens)),
        seq_lens_decoder=s.dec,
        seq_lens_this_time=lens,
        cu_seqlens_q=s.cu,
        batch_id_per_token=s.bid,
        block_tables=table if not s.headwise else torch.zeros(len(s.reqs), 1, dtype=torch.int32),
        block_size=block_size,
        block_tables_headwise=({3: table} if as_mapping else table) if s.headwise else None,
        max_seq_len_this_time=max(n for _, n in s.reqs),
        max_context_len=max(c + n for c, n in s.reqs),
    )


def test_backend_on_torch_tensors():
    from fastdeploy_paddlefleet.backends import get_backend

    layer = _layer(2, 4, 32, 16, kind="headwise", window=3, sliding=(1, 2), sink="learnable")
    s = make_step(
        [(9, 4), (20, 1)],
        hkv=2,
        group=4,
        dqk=32,
        dv=16,
        block_size=8,
        headwise=True,
        window_left=3,
        sliding_heads=(1, 2),
        release=True,
    )
    sinks = torch.randn(8, device=DEVICE)
    out = get_backend("triton").forward(
        s.q, s.k, s.v, layer, _meta(s, 8, as_mapping=True), (s.key_cache, s.value_cache), sinks
    )
    assert isinstance(out, torch.Tensor) and out.shape == (5, 8 * 16)
    for b, (lo, hi) in enumerate([(0, 4), (4, 5)]):
        want = dense_attention(
            s.q[lo:hi],
            s.hist_k[b],
            s.hist_v[b],
            scale=layer.softmax_scale,
            window_left=3,
            sliding_heads=(1, 2),
            sink_kind="learnable",
            sinks=sinks,
        )
        torch.testing.assert_close(out[lo:hi].view(hi - lo, 8, 16).double(), want, atol=2e-3, rtol=2e-3)


def test_backend_rejects_understated_max_q_len():
    from fastdeploy_paddlefleet.backends import get_backend

    layer = _layer(2, 2, 16, 16)
    s = make_step([(3, 4)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    meta = _meta(s, 8)
    meta.max_seq_len_this_time = 1
    with pytest.raises(ValueError, match="max_seq_len_this_time"):
        get_backend("triton").forward(s.q, s.k, s.v, layer, meta, (s.key_cache, s.value_cache))


@pytest.mark.skipif(CUDA, reason="CPU paddle comparison (the GPU image has no paddle)")
@pytest.mark.parametrize(
    "spec",
    [
        dict(kind="full", sink="vanilla", headwise=False),
        dict(kind="sliding", window=4, sink="learnable", headwise=False),
        dict(kind="headwise", window=2, sliding=(2, 4), sink="off-by-one", headwise=True),
    ],
)
def test_triton_backend_matches_reference_backend_on_paddle(spec):
    """Same paddle inputs through both backends, each on its own copy of the cache."""
    paddle = pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.backends import get_backend

    spec = dict(spec)
    headwise = spec.pop("headwise")
    hkv = 4 if spec["kind"] == "headwise" else 2
    layer = _layer(hkv, 2, 32, 16, **spec)
    window, sliding = spec.get("window"), spec.get("sliding")
    reqs = [(12, 5), (30, 1), (0, 9), (7, 1)]
    s = make_step(
        reqs,
        hkv=hkv,
        group=2,
        dqk=32,
        dv=16,
        block_size=8,
        headwise=headwise,
        window_left=window,
        sliding_heads=sliding,
        release=window is not None,
    )
    meta_t = _meta(s, 8)

    def to_pd(x):
        return paddle.to_tensor(x.numpy())

    from fastdeploy_paddlefleet.backends.base import BatchMeta

    meta = BatchMeta(
        **{
            f: to_pd(getattr(meta_t, f))
            if isinstance(getattr(meta_t, f), torch.Tensor)
            else getattr(meta_t, f)
            for f in meta_t.__dataclass_fields__
        }
    )
    sinks = None
    if spec["sink"] == "learnable":
        gen = torch.Generator().manual_seed(3)
        sinks = paddle.to_tensor(torch.randn(layer.num_q_heads, generator=gen).numpy())
    outs, caches = [], []
    for name in ("reference", "triton"):
        kv = (to_pd(s.key_cache), to_pd(s.value_cache))
        out = get_backend(name).forward(to_pd(s.q), to_pd(s.k), to_pd(s.v), layer, meta, kv, sinks)
        assert isinstance(out, paddle.Tensor)
        outs.append(out.numpy())
        caches.append([c.numpy() for c in kv])
    import numpy as np

    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    for a, b in zip(caches[0], caches[1], strict=True):  # both wrote the same slots
        np.testing.assert_array_equal(np.nan_to_num(a, nan=7.0), np.nan_to_num(b, nan=7.0))


# ------------------------------------------------------------------------------ GPU, realistic shapes

REAL = dict(hkv=8, group=4, dqk=128, dv=128, block_size=64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "attend",
    [
        dict(),
        dict(window_left=1023, sink_kind="learnable"),
        dict(window_left=255, sliding_heads=(4, 8), sink_kind="off-by-one"),
    ],
)
def test_gpu_decode_batch(dtype, attend):
    reqs = [(int(c), 1) for c in torch.randint(1, 3000, (24,), generator=torch.Generator().manual_seed(1))]
    headwise = "sliding_heads" in attend
    s = make_step(
        reqs,
        dtype=dtype,
        headwise=headwise,
        release=headwise,
        seed=2,
        window_left=attend.get("window_left"),
        sliding_heads=attend.get("sliding_heads"),
        **REAL,
    )
    for splits in (None, 1, 4):  # rewriting this step's K/V is idempotent: one Step serves all
        run_and_check(s, num_splits=splits, **attend)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window", [None, 200])
def test_gpu_chunked_prefill_and_mixed(dtype, window):
    reqs = [(1000, 700), (0, 513), (37, 1), (2000, 1), (64, 64)]
    s = make_step(reqs, dtype=dtype, window_left=window, release=window is not None, seed=3, **REAL)
    run_and_check(s, window_left=window, sink_kind="learnable", max_q_len=700, max_context_len=2001)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@gpu
@pytest.mark.parametrize("use_tma", [False, True])
def test_gpu_tile_variants(use_tma):
    reqs = [(500, 300), (3000, 1), (10, 1), (0, 200)]
    for cfg in (
        TileConfig(128, 64, 8, 3, use_tma, exp_bf16=True),
        TileConfig(128, 128, 8, 2, use_tma),
        TileConfig(64, 64, 4, 3, use_tma),
    ):
        s = make_step(reqs, dtype=torch.bfloat16, window_left=511, release=True, seed=4, **REAL)
        run_and_check(
            s,
            window_left=511,
            sink_kind="learnable",
            prefill_config=cfg,
            decode_config=TileConfig(16, cfg.block_n, 4, 3, use_tma),
        )


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@gpu
def test_gpu_mla_dims_and_block_size_16():
    reqs = [(700, 300), (1500, 1), (0, 129)]
    s = make_step(reqs, hkv=16, group=1, dqk=192, dv=128, block_size=64, dtype=torch.bfloat16, seed=5)
    run_and_check(s, scale=0.1)
    s = make_step(
        reqs,
        hkv=8,
        group=8,
        dqk=64,
        dv=64,
        block_size=16,
        dtype=torch.bfloat16,
        seed=6,
        headwise=True,
        window_left=99,
        sliding_heads=(0, 4),
        release=True,
    )
    run_and_check(s, window_left=99, sliding_heads=(0, 4), sink_kind="learnable")


@pytest.mark.gpu
@gpu
def test_gpu_backend_bf16():
    from fastdeploy_paddlefleet.backends import get_backend

    layer = _layer(8, 4, 128, 128, kind="sliding", window=127, sink="learnable")
    s = make_step([(300, 100), (900, 1)], dtype=torch.bfloat16, window_left=127, **REAL)
    sinks = torch.randn(32, device=DEVICE)
    out = get_backend("triton").forward(
        s.q, s.k, s.v, layer, _meta(s, 64), (s.key_cache, s.value_cache), sinks
    )
    for b, (lo, hi) in enumerate([(0, 100), (100, 101)]):
        want = dense_attention(
            s.q[lo:hi],
            s.hist_k[b],
            s.hist_v[b],
            scale=layer.softmax_scale,
            window_left=127,
            sink_kind="learnable",
            sinks=sinks,
            compute_dtype=torch.float32,
        )
        got = out[lo:hi].view(hi - lo, 32, 128).float()
        assert float((got - want).norm() / want.norm()) < 2e-2
