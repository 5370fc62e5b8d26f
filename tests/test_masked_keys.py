"""Masked keys contribute exactly nothing (docs/semantics.md, "Masked keys").

A NaN or Inf planted in K or V at a position a query may not see (a later token of the same chunk
under the causal mask, a token outside its window in a page still held, a slot past the context, a
page of the table not yet written) must leave that query's output exactly as if the slot held
zeros: the same bits as a run with zeros planted there, and the dense reference's values. A query
that does see a planted non-finite value gets a non-finite output, as the dense computation gives.

The kernels run under the interpreter on CPU and compiled on a GPU (the ``gpu`` cases add the Hopper
prefill and bf16). The dense reference is ``kernels/dense_reference.py`` over each request's K/V
history with the planted slots zeroed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import test_triton_kernels as tk  # noqa: E402  (sets TRITON_INTERPRET before the kernels exist)

from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention  # noqa: E402

#: the first variant of each parametrized GPU test stays in ``-m gpu`` (conftest.py)
GPU_LONG_VARIANTS = True
CUDA = tk.CUDA
DEVICE = tk.DEVICE
BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


@dataclass(frozen=True)
class Plant:
    """A planted slot: request ``b``, kv head ``h`` (``None``: every head), position ``pos`` (may lie
    past the request's keys: a stale slot or a page not yet written)."""

    b: int
    pos: int
    h: int | None = None


def _page(s: tk.Step, b: int, h: int, pos: int, hkv: int, bs: int) -> int:
    if s.headwise:
        return int(s.table[b * hkv + h, pos // bs])
    return int(s.table[b, pos // bs]) * hkv + h


def _extend_tables(s: tk.Step, plants: list[Plant], hkv: int, bs: int) -> None:
    """Give every request a table entry for the blocks its plants reach past its keys: spare blocks
    (``make_step`` allocates three more than it uses), i.e. pages no key of this step was written to."""
    used = set(int(x) for x in s.table.flatten().tolist() if x >= 0)
    if s.headwise:
        used = {p // hkv for p in used}
    spare = iter(x for x in range(s.key_cache.shape[0]) if x not in used)
    for p in plants:
        blk = p.pos // bs
        row = p.b * hkv if s.headwise else p.b
        if int(s.table[row, blk]) >= 0:
            continue
        nb = next(spare)
        if s.headwise:
            for h in range(hkv):
                s.table[p.b * hkv + h, blk] = nb * hkv + h
        else:
            s.table[p.b, blk] = nb


def _sees(s: tk.Step, plants: list[Plant], group: int, window_left, sliding_heads) -> torch.Tensor:
    """``[T, Hq]`` bool: the query row sees at least one planted slot."""
    t, hq = s.q.shape[0], s.q.shape[1]
    hkv = hq // group
    sees = torch.zeros(t, hq, dtype=torch.bool)
    h0, h1 = sliding_heads if sliding_heads is not None else (0, hkv)
    for b, (ctx, n) in enumerate(s.reqs):
        lo = int(s.cu[b])
        for i in range(n):
            qpos = ctx + i
            for head in range(hq):
                h = head // group
                for p in plants:
                    if p.b != b or (p.h is not None and p.h != h) or p.pos > qpos:
                        continue
                    if window_left is not None and h0 <= h < h1 and qpos - p.pos > window_left:
                        continue
                    sees[lo + i, head] = True
    return sees


def check_masked(
    reqs: list[tuple[int, int]],
    plants: list[Plant],
    value: float,
    where: str,
    *,
    hkv: int = 2,
    group: int = 2,
    dqk: int = 16,
    dv: int = 16,
    block_size: int = 8,
    dtype: torch.dtype = torch.float32,
    headwise: bool = False,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    sink_kind: str = "vanilla",
    fused: bool = False,
    **kw,
) -> torch.Tensor:
    """Plant ``value`` into K, V or both (``where``) at ``plants`` after this step's cache write, run
    the kernels with the planted slots holding ``value`` and holding 0, and check the contract.
    Returns the ``sees`` mask (for the caller's own checks)."""
    s = tk.make_step(
        reqs, hkv=hkv, group=group, dqk=dqk, dv=dv, block_size=block_size, dtype=dtype,
        headwise=headwise, window_left=window_left, sliding_heads=sliding_heads,
    )  # fmt: skip
    _extend_tables(s, plants, hkv, block_size)
    if not fused:
        write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=headwise)
    kp = s.key_cache.view(-1, block_size, dqk)
    vp = s.value_cache.view(-1, block_size, dv)
    hist_k = [x.clone() for x in s.hist_k]
    hist_v = [x.clone() for x in s.hist_v]
    slots = []
    for p in plants:
        for h in range(hkv) if p.h is None else (p.h,):
            slots.append((_page(s, p.b, h, p.pos, hkv, block_size), p.pos % block_size))
            if p.pos < hist_k[p.b].shape[0]:  # the reference: the slot holds zeros
                if where in ("k", "kv"):
                    hist_k[p.b][p.pos, h] = 0
                if where in ("v", "kv"):
                    hist_v[p.b][p.pos, h] = 0
    scale = 1.0 / math.sqrt(dqk)
    sinks = None
    if sink_kind == "learnable":
        sinks = torch.linspace(-1.0, 1.0, s.q.shape[1]).to(s.q.device)
    outs = {}
    for fill in (value, 0.0):
        kc, vc = s.key_cache.clone(), s.value_cache.clone()
        kpf, vpf = kc.view_as(kp), vc.view_as(vp)
        for page, slot in slots:
            if where in ("k", "kv"):
                kpf[page, slot] = fill
            if where in ("v", "kv"):
                vpf[page, slot] = fill
        args = (s.q, kc, vc, s.cu, s.dec, s.table)
        extra = dict(new_kv=(s.k, s.v), max_q_len=1) if fused else {}
        outs[fill] = paged_attention(
            *args, scale=scale, headwise=headwise, window_left=window_left, sliding_heads=sliding_heads,
            sink_kind=sink_kind, sinks=sinks, **extra, **kw,
        )  # fmt: skip
    bad, zero = outs[value].cpu(), outs[0.0].cpu()
    sees = _sees(s, plants, group, window_left, sliding_heads)
    blind = ~sees
    assert sees.numel() == 0 or blind.any(), "the case plants nothing any row is blind to"
    # exactly as if the slots held zeros: the same bits where the row cannot see a planted slot
    assert torch.equal(bad[blind], zero[blind]), "a masked non-finite key changed a row that cannot see it"
    assert torch.isfinite(zero).all()
    # and a seen non-finite value is not hidden
    if sees.any():
        assert (~torch.isfinite(bad[sees])).any(dim=-1).all(), "a seen non-finite value was hidden"
    # the zero-planted run is the dense reference's
    tol = tk.REL_TOL[dtype]
    for b, (_, n) in enumerate(s.reqs):
        if n == 0:
            continue
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            s.q[lo:hi], hist_k[b], hist_v[b], scale=scale, window_left=window_left,
            sliding_heads=sliding_heads, sink_kind=sink_kind, sinks=sinks,
            logits_soft_cap=kw.get("logits_soft_cap"),
            compute_dtype=torch.float64 if not CUDA else torch.float32,
        ).cpu()  # fmt: skip
        got = zero[lo:hi].to(want.dtype)
        err = float((got - want).norm() / want.norm().clamp_min(1e-6))
        assert err <= tol, f"request {b}: relative error {err:.2e} > {tol:.0e}"
    return sees


# ---------------------------------------------------------------------------- interpreter / any GPU


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("where", ["k", "v", "kv"])
def test_causal_future_token_of_the_chunk(value, where):
    """A prefill chunk: token 9 of request 0 and token 4 of request 1 (this step's own keys) are
    non-finite; the rows before them must not notice."""
    reqs = [(0, 20), (6, 11)]
    sees = check_masked(reqs, [Plant(0, 9), Plant(1, 6 + 4)], value, where)
    assert sees.any() and (~sees).any()


@pytest.mark.parametrize("value", BAD_VALUES)
def test_outside_the_window_in_held_pages(value):
    """Keys outside every row's window (their pages still held) and keys at the window's leading
    edge (seen by later rows of the chunk, not by earlier ones), prefill and decode together."""
    reqs = [(30, 12), (40, 1), (25, 1)]
    plants = [Plant(0, 3), Plant(0, 30 - 5), Plant(1, 40 - 8), Plant(1, 2), Plant(2, 25 - 7)]
    check_masked(reqs, plants, value, "kv", window_left=6, sink_kind="learnable")


@pytest.mark.parametrize("value", BAD_VALUES)
def test_past_the_context_and_unwritten_pages(value):
    """Slots past every request's keys, in its last page and in a page of its table not yet
    written (decode, split-KV decode, prefill)."""
    reqs = [(13, 1), (5, 6), (40, 1)]
    plants = [Plant(0, 14), Plant(0, 15), Plant(0, 20), Plant(1, 11), Plant(1, 17)]
    plants += [Plant(2, 41), Plant(2, 47)]
    check_masked(reqs, plants, value, "kv")
    check_masked(reqs, plants, value, "kv", num_splits=3)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_split_kv_decode_window(value):
    reqs = [(60, 1), (33, 1)]
    plants = [Plant(0, 60 - 11), Plant(0, 10), Plant(1, 33 - 12)]
    check_masked(reqs, plants, value, "kv", window_left=10, num_splits=4)


def test_headwise_tables_and_per_head_windows():
    """Head-wise pages, a window on kv heads 2..3 only: a key outside the window of a sliding head
    is visible to the full heads (non-finite there), invisible to the sliding ones (unchanged)."""
    reqs = [(20, 9), (30, 1)]
    plants = [Plant(0, 20 - 6, h=3), Plant(0, 24, h=1), Plant(1, 30 - 6, h=2), Plant(1, 30 - 6, h=0)]
    check_masked(
        reqs, plants, float("nan"), "kv", hkv=4, group=2, headwise=True, window_left=4,
        sliding_heads=(2, 4), sink_kind="off-by-one",
    )  # fmt: skip


def test_qk_dim_differs_from_v_dim_and_soft_cap():
    reqs = [(9, 14), (17, 1)]
    plants = [Plant(0, 9 + 5), Plant(0, 1), Plant(1, 18)]
    check_masked(reqs, plants, float("nan"), "kv", dqk=48, dv=16, window_left=7, logits_soft_cap=5.0)


def test_fused_decode_write():
    """The decode launch that writes this step's K/V itself (``new_kv``)."""
    reqs = [(21, 1), (9, 1)]
    plants = [Plant(0, 21 - 9), Plant(0, 23), Plant(1, 12)]
    check_masked(reqs, plants, float("inf"), "kv", window_left=8, fused=True)


@pytest.mark.parametrize("where", ["v", "kv"])
def test_half_width_masked_tiles(where):
    """64-key tiles, as on a GPU: the masked loops (causal diagonal, window edge) run 32-key tiles
    (``masked_block_n``) beside the full-width unmasked ones; planted keys at both edges, pages of 64
    and of 16 keys (one page per tile, several)."""
    from fastdeploy_paddlefleet.kernels.paged_attention import masked_block_n

    cfg = tk.TileConfig(block_m=32, block_n=64, num_warps=4, num_stages=1)
    assert masked_block_n(cfg) == 32
    reqs = [(70, 90), (0, 75)]
    plants = [Plant(0, 70 + 40), Plant(0, 70 + 89), Plant(0, 12), Plant(1, 33), Plant(1, 64)]
    for bs in (64, 16):
        check_masked(reqs, plants, float("nan"), where, block_size=bs, prefill_config=cfg)
        check_masked(reqs, plants, float("inf"), where, block_size=bs, window_left=50, prefill_config=cfg)


@pytest.mark.parametrize("safe_grid", [1, 3])
def test_safe_launch_strides_over_the_fast_programs(monkeypatch, safe_grid):
    """The portable prefill's safe launch runs on at most ``SAFE_GRID`` programs that stride over the
    fast launch's flags: with one or three of them (and 28 fast programs, chunks of 32 flags), the
    flagged programs of the first and the last request are found and redone, the others keep their
    bits."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "SAFE_GRID", safe_grid)
    cfg = tk.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # 8 tokens per program
    reqs = [(0, 30), (12, 40), (50, 22)]
    plants = [Plant(0, 3), Plant(2, 50 + 20), Plant(2, 50 + 6)]
    check_masked(reqs, plants, float("nan"), "v", prefill_config=cfg)


def test_tma_code_path():
    """The portable kernels' TMA variant (interpreted on CPU)."""
    reqs = [(40, 24), (33, 1)]
    plants = [Plant(0, 40 + 10), Plant(0, 5), Plant(1, 34)]
    cfg = tk.TileConfig(block_m=16, block_n=16, use_tma=True)
    check_masked(
        reqs, plants, float("nan"), "v", block_size=16, window_left=20, prefill_config=cfg, decode_config=cfg
    )


# ---------------------------------------------------------------------------- GPU: bf16, Hopper prefill


@tk.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["hopper", "portable"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128), (64, 64)])
def test_gpu_prefill_bf16(impl, dims):
    """Realistic shapes in bf16: causal diagonal, window edge, past the context, both prefill
    kernels (the Hopper one on sm_90 only)."""
    from fastdeploy_paddlefleet.kernels.hopper_prefill import supported

    dqk, dv = dims
    reqs = [(100, 300), (0, 257), (700, 1), (64, 130)]
    plants = [Plant(0, 100 + 150), Plant(0, 100 + 20), Plant(1, 129), Plant(1, 3), Plant(2, 700 - 40)]
    plants += [Plant(3, 64 + 130 + 3), Plant(0, 100 + 300 + 7)]
    kw = dict(hkv=2, group=4, dqk=dqk, dv=dv, block_size=64, dtype=torch.bfloat16, window_left=90)
    if impl == "hopper":
        s = tk.make_step(reqs[:1], hkv=2, group=4, dqk=dqk, dv=dv, block_size=64, dtype=torch.bfloat16)
        why = supported(s.q, s.key_cache, s.value_cache)
        if why is not None:
            pytest.skip(f"the hopper prefill cannot run here: {why}")
    for where in ("k", "v"):
        check_masked(reqs, plants, float("nan"), where, prefill_impl=impl, **kw)
    check_masked(reqs, plants, float("inf"), "kv", prefill_impl=impl, sink_kind="learnable", **kw)


@tk.gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "window_left, req, key, rows",
    [(None, (16, 160), 120, (112, 128)), (200, (212, 128), 130, (96, 112))],
    ids=["causal", "window"],
)
def test_gpu_hopper_tile_cleaned_for_the_other_half(window_left, req, key, rows):
    """The Hopper prefill cleans a V tile when any row of a work item may not see one of its keys; one
    consumer's rows may still see that tile whole, and a NaN there must reach each of them. Group 4
    gives 16 tokens per consumer and 32 per item. Causal: at context 16 the item of positions 112-143
    meets key tile 0-127, which its second consumer (128-143) sees whole. Window 200: at context 212
    the item of positions 308-339 meets key tile 128-255 at the window's trailing edge, which its first
    consumer (308-323) sees whole. ``rows``: those consumer rows, which see the planted ``key``."""
    from fastdeploy_paddlefleet.kernels.hopper_prefill import supported

    kw = dict(hkv=2, group=4, dqk=128, dv=128, block_size=64, dtype=torch.bfloat16, window_left=window_left)
    s = tk.make_step([req], hkv=2, group=4, dqk=128, dv=128, block_size=64, dtype=torch.bfloat16)
    why = supported(s.q, s.key_cache, s.value_cache)
    if why is not None:
        pytest.skip(f"the hopper prefill cannot run here: {why}")
    sees = check_masked([req], [Plant(0, key)], float("nan"), "v", prefill_impl="hopper", **kw)
    assert sees[rows[0] : rows[1]].all(), "the construction: those rows see the planted key"


@tk.gpu
@pytest.mark.gpu
def test_gpu_hopper_flags_cleared_and_kept_per_plan():
    """The Hopper plan's flags (``HopperPlan.redo``): the fast launch sets a consumer's flag only where
    a row came out non-finite, the safe launch redoes those CTAs and clears every flag it read. After a
    step whose NaN (at a key the earlier rows may not see) was redone, the flags are all clear, the
    earlier rows equal the zero-planted run's bits, and the next step on the same plan, with the NaN
    gone, equals it whole."""
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

    t, hq, hkv, d, bs, key = 512, 8, 2, 128, 64, 300
    gen = torch.Generator(device="cuda").manual_seed(3)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(t // bs, hkv, bs, d, generator=gen, **kw)
    vc = torch.randn(t // bs, hkv, bs, d, generator=gen, **kw)
    q = torch.randn(t, hq, d, generator=gen, **kw)
    why = hp.supported(q, kc, vc)
    if why is not None:
        pytest.skip(f"the hopper prefill cannot run here: {why}")
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    dec = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = torch.arange(t // bs, dtype=torch.int32, device="cuda")[None].contiguous()
    plan = hp.HopperPlan(kc, vc, hq, None, qk_scale=1.4426950408889634 / d**0.5, sink_mode=0,
                         headwise=False, has_window=False, window=0, win_h0=0, win_h1=hkv)  # fmt: skip
    vc[key // bs, :, key % bs] = 0.0
    zero = torch.empty_like(q)
    plan.run(q, zero, cu, dec, table)
    assert torch.isfinite(zero).all()
    vc[key // bs, :, key % bs] = float("nan")
    out = torch.empty_like(q)
    plan.run(q, out, cu, dec, table)
    assert int(plan.redo.abs().sum()) == 0, "the safe launch clears the flags it read"
    assert torch.equal(out[:key], zero[:key]), "rows that may not see the NaN keep the zero run's bits"
    assert torch.isnan(out[key:]).all(), "rows that see it are NaN, as the dense computation's"
    vc[key // bs, :, key % bs] = 0.0
    again = torch.empty_like(q)
    plan.run(q, again, cu, dec, table)
    assert torch.equal(again, zero) and int(plan.redo.abs().sum()) == 0
