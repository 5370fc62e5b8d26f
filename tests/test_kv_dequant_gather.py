"""The dequantizing gather ahead of the Hopper prefill of a quantized cache (kernels/kv_dequant_gather.py).

Interpreter cases (any machine): the gather against a torch transcription of the dequant
(``T(float32(code) * float32(scale))``, bit for bit) for ``block_wise_fp8`` and static fp8 / int8
scales, 128 / 128 and 192 / 128 heads, per-request and head-wise tables, sliding windows with
released (-1, NaN-filled) pages, bad entries recorded in the error flag, and the masked-key rule:
unwritten slots (NaN codes and scales, or int8's NaN byte planted there) and slots below a window are
zeros in the scratch. End to end on the CPU: the gather, then the portable prefill on the scratch and
the remapped table, against the dense reference on the dequantized cache. On an sm_90 GPU with Gluon
(``gpu``): ``paged_attention`` / ``AttentionPlan`` run the gather and the Hopper prefill for a quantized
cache, decode rows of the same step read the codes directly.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import test_kv_quant_attention as qa  # noqa: E402
import test_triton_kernels as tk  # noqa: E402  (sets TRITON_INTERPRET before the kernels exist)

from fastdeploy_paddlefleet import envs  # noqa: E402
from fastdeploy_paddlefleet.kernels import hopper_prefill as hp  # noqa: E402
from fastdeploy_paddlefleet.kernels import kv_dequant_gather as kg  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.errors import describe_kernel_error, new_error_flag  # noqa: E402
from fastdeploy_paddlefleet.kernels.hopper_support import triton_tested  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import AttentionPlan, paged_attention  # noqa: E402

CUDA = tk.CUDA
HOPPER = CUDA and hp.is_hopper(torch.device("cuda")) and hp.gluon_available()
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton.experimental.gluon")
#: the first variant of each parametrized GPU test stays in ``-m gpu`` (conftest.py)
GPU_LONG_VARIANTS = True
MIXED = [(9, 4), (20, 1), (0, 5), (3, 1), (17, 2)]


def ref_dequant(codes: torch.Tensor, scale: torch.Tensor, fmt, heads: torch.Tensor, dtype) -> torch.Tensor:
    """``[NB, Hkv, BS, D]`` in ``dtype``: ``T(float32(code) * float32(scale))`` (static scales by each
    page's logical head, ``heads`` from ``qa.page_heads``); NaN codes read as NaN."""
    c = codes.cpu()
    if fmt.code == "fp8":
        x = c.view(torch.float8_e4m3fn).float()
    else:
        x = c.float() - 128.0
        x[c == 0] = float("nan")
    s = scale.cpu().float()
    nb, hkv, bs, d = c.shape
    if fmt.dynamic:
        y = x * s[..., None]
    else:
        per = s.view(hkv, d) if fmt.channel_wise else s.view(hkv, 1).expand(hkv, d)
        y = (x.reshape(nb * hkv, bs, d) * per[heads][:, None, :]).view(nb, hkv, bs, d)
    return y.to(dtype)


def quant_step(reqs, fmt_name, *, scale_dtype=None, plant=True, **kw):
    """A step of ``tk.make_step`` (fp32 values), written and quantized (``qa.QStep``); ``scale_dtype``:
    a dynamic format's scales in that dtype (FastDeploy's: the model dtype); ``plant``: int8's NaN
    byte (0) in every slot the float cache held NaN (unwritten or released)."""
    s = tk.make_step(reqs, **kw)
    qs = qa.QStep(s, qa.fmt_of(fmt_name))
    if scale_dtype is not None and qs.fmt.dynamic:
        qs.ks, qs.vs = qs.ks.to(scale_dtype), qs.vs.to(scale_dtype)
    if plant and qs.fmt.code == "int8":
        qs.kc[torch.isnan(s.key_cache)] = 0
        qs.vc[torch.isnan(s.value_cache)] = 0
    return s, qs


def gather(s, qs, dtype, **kw):
    return kg.dequant_gather(
        qs.kc, qs.vc, qs.ks, qs.vs, s.cu, s.dec, s.table, kv_quant=qs.fmt, dtype=dtype, headwise=s.headwise,
        **kw,
    )  # fmt: skip


def check_gather(s, qs, k, v, tbl, dtype, *, window_left=None, sliding_heads=None) -> int:
    """Every remapped entry and every slot of every gathered page against the transcription; returns
    the pages checked. Decode rows and columns outside the keys some query sees are -1; the slots of a
    gathered page outside ``[lo, ctx + q_len)`` are zero; no two entries share a scratch unit."""
    hkv, bs = qs.kc.shape[1], qs.kc.shape[2]
    ref_k = ref_dequant(qs.kc, qs.ks, qs.fmt, qs.heads, dtype)
    ref_v = ref_dequant(qs.vc, qs.vs, qs.fmt, qs.heads, dtype)
    kp, vp = k.cpu().reshape(-1, bs, k.shape[3]), v.cpu().reshape(-1, bs, v.shape[3])
    rk, rv = ref_k.reshape(-1, bs, ref_k.shape[3]), ref_v.reshape(-1, bs, ref_v.shape[3])
    table, remap = s.table.cpu().long(), tbl.cpu().long()
    assert remap.shape == table.shape
    h0, h1 = sliding_heads if (window_left is not None and sliding_heads is not None) else (0, hkv)
    all_slide = window_left is not None and h0 <= 0 and h1 >= hkv
    used, pages = set(), 0
    for b, (ctx, n) in enumerate(s.reqs):
        kv_len = ctx + n
        rows = [(b * hkv + h, [h]) for h in range(hkv)] if s.headwise else [(b, list(range(hkv)))]
        for row, heads in rows:
            if n < 2:
                assert (remap[row] == -1).all(), f"request {b} (decode) row {row}: {remap[row].tolist()}"
                continue
            if s.headwise:
                slides = window_left is not None and h0 <= heads[0] < h1
                lo_tbl = max(ctx - window_left, 0) if slides else 0
            else:
                lo_tbl = max(ctx - window_left, 0) if all_slide else 0
            j0, j1 = lo_tbl // bs, -(-kv_len // bs)
            for j in range(remap.shape[1]):
                e, raw = int(remap[row, j]), int(table[row, j])
                if not (j0 <= j < j1) or raw < 0:
                    assert e == -1, f"row {row} column {j}: {e} (outside [{j0}, {j1}) or absent)"
                    continue
                assert e >= 0, f"row {row} column {j}: -1 inside the gathered range"
                assert e not in used, f"scratch unit {e} given twice"
                used.add(e)
                for h in heads:
                    slides = window_left is not None and h0 <= h < h1
                    lo = max(ctx - window_left, 0) if slides else 0
                    src = raw if s.headwise else raw * hkv + h
                    dst = e if s.headwise else e * hkv + h
                    keys = j * bs + torch.arange(bs)
                    seen = (keys >= lo) & (keys < kv_len)
                    for got, want in ((kp[dst], rk[src]), (vp[dst], rv[src])):
                        assert torch.equal(got[~seen], torch.zeros_like(got[~seen])), f"row {row} col {j}"
                        torch.testing.assert_close(got[seen], want[seen], atol=0, rtol=0, equal_nan=True)
                        assert torch.isfinite(got).all(), f"row {row} column {j} head {h}: non-finite"
                    pages += 1
    return pages


FMTS = ["block_wise_fp8", "fp8_per_head", "fp8_per_channel", "int8"]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_matches_the_dequant_bit_for_bit(fmt, dtype):
    """Mixed prefill / decode rows, GQA, 128 / 128; scales of a dynamic format in the model dtype."""
    s, qs = quant_step(
        [(40, 7), (20, 1), (0, 19), (3, 1), (33, 2)], fmt, hkv=2, group=2, dqk=128, dv=128, block_size=16,
        scale_dtype=dtype if dtype != torch.float32 else None,
    )  # fmt: skip
    k, v, tbl = gather(s, qs, dtype)
    assert k.dtype == v.dtype == dtype and tbl.dtype == torch.int32
    assert check_gather(s, qs, k, v, tbl, dtype) > 0


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_channel", "int8"])
def test_gather_mla_dims(fmt):
    """MLA's 192 / 128: K and V pages of different widths."""
    s, qs = quant_step([(21, 5), (7, 1), (0, 3)], fmt, hkv=1, group=2, dqk=192, dv=128, block_size=16)
    k, v, tbl = gather(s, qs, torch.float16, max_q_len=5, max_context_len=26)
    assert k.shape[1:] == (1, 16, 192) and v.shape[1:] == (1, 16, 128)
    assert check_gather(s, qs, k, v, tbl, torch.float16) > 0


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_gather_sliding_window_with_released_pages(fmt):
    """Every kv head slides: only the window's pages are gathered (released ones are -1 and NaN)."""
    w = 5
    s, qs = quant_step(
        [(30, 6), (27, 1), (40, 3)], fmt, hkv=2, group=2, dqk=16, dv=16, block_size=8, window_left=w,
        release=True,
    )  # fmt: skip
    k, v, tbl = gather(s, qs, torch.float32, window_left=w, max_q_len=6, max_context_len=43)
    check_gather(s, qs, k, v, tbl, torch.float32, window_left=w)
    assert (tbl[0, : (30 - w) // 8] == -1).all()
    # the bound: 2 prefill requests at most ((5 + 6 + 6) // 8 + 1 = 3 blocks each)
    assert kg.scratch_units(3, 10, s.table.shape[1], 8, 2, headwise=False, window=w, win_h0=0, win_h1=2,
                            max_q_len=6, max_context_len=43)[2:] == (3, 9)  # fmt: skip


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_head", "int8"])
def test_gather_headwise_tables_some_heads_slide(fmt):
    """Head-wise page tables, kv heads 1..2 slide (their old pages released), head 0 full."""
    kw = dict(window_left=4, sliding_heads=(1, 3))
    s, qs = quant_step([(20, 5), (31, 1), (12, 9)], fmt, hkv=3, group=2, dqk=16, dv=16, block_size=8,
                       headwise=True, release=True, **kw)  # fmt: skip
    k, v, tbl = gather(s, qs, torch.float32, **kw)
    check_gather(s, qs, k, v, tbl, torch.float32, **kw)


def test_gather_plain_table_some_heads_slide():
    """A per-request table shared by full and sliding heads: the full range is gathered, and each
    sliding head's keys below its window are zero."""
    kw = dict(window_left=6, sliding_heads=(0, 1))
    s, qs = quant_step([(25, 4), (2, 1), (30, 2)], "block_wise_fp8", hkv=2, group=1, dqk=16, dv=16,
                       block_size=8, **kw)  # fmt: skip
    k, v, tbl = gather(s, qs, torch.float32, **kw)
    check_gather(s, qs, k, v, tbl, torch.float32, **kw)
    assert int(tbl[0, 0]) >= 0  # head 1 is full: block 0 is read


def test_gather_never_copies_unwritten_slots():
    """NaN codes and NaN scales in every unwritten slot, max codes too: the scratch is finite, the
    tails zero (``check_gather``), whatever ``torch.empty`` left in it before."""
    s, qs = quant_step([(13, 6), (0, 3)], "block_wise_fp8", hkv=2, group=1, dqk=16, dv=16, block_size=8)
    unwritten = torch.isnan(s.key_cache[..., 0])  # [NB, Hkv, BS]
    qs.kc[unwritten] = 0x7F
    qs.vc[unwritten] = 0xFF
    scratch = kg.DequantScratch(qs.kc.device, torch.float32, 2, 8, 16, 16)
    scratch.ensure(64, 64)
    scratch.key.fill_(float("nan"))
    scratch.value.fill_(float("nan"))
    k, v, tbl = gather(s, qs, torch.float32, scratch=scratch)
    assert scratch.generation == 1 and k is scratch.key  # large enough: not replaced
    assert check_gather(s, qs, k, v, tbl, torch.float32) == 3 * 2 + 1 * 2  # (blocks) x heads


def test_gather_records_a_bad_entry_and_leaves_it_absent():
    """A -1 inside the keys a query sees: recorded in the flag as the gather's (kernel 5), entry -1 in
    the remapped table; an entry past the cache likewise."""
    s, qs = quant_step([(20, 4), (9, 3)], "block_wise_fp8", hkv=2, group=1, dqk=16, dv=16, block_size=8)
    table = s.table.clone()
    table[0, 1] = -1
    table[1, 0] = 10_000
    flag = new_error_flag(s.q)
    k, v, tbl = kg.dequant_gather(
        qs.kc, qs.vc, qs.ks, qs.vs, s.cu, s.dec, table, kv_quant=qs.fmt, dtype=torch.float32, errors=flag
    )  # fmt: skip
    values = flag.cpu().tolist()
    assert values[:3] == [2, 0, 1] and values[5] == 5, values
    assert "dequantizing gather" in describe_kernel_error(values)
    assert int(tbl[0, 1]) == -1 and int(tbl[1, 0]) == -1 and int(tbl[0, 0]) >= 0


def test_scratch_grows_on_demand_and_is_shared():
    """The scratch grows by at least half when a step needs more, keeps its memory otherwise, and plans
    of one geometry share it (weakly held)."""
    sc = kg.DequantScratch("cpu", torch.float16, 2, 16, 64, 32)
    sc.ensure(10, 100)
    assert sc.blocks == 10 and sc.generation == 1
    assert sc.nbytes() == 10 * 2 * 16 * (64 + 32) * 2 + 100 * 4
    sc.ensure(4, 50)
    assert sc.blocks == 10 and sc.generation == 1
    sc.ensure(11, 50)
    assert sc.blocks == 15 and sc.generation == 2
    a = kg.shared_scratch("cpu", torch.float16, 2, 16, 64, 32)
    assert kg.shared_scratch("cpu", torch.float16, 2, 16, 64, 32) is a
    assert kg.shared_scratch("cpu", torch.bfloat16, 2, 16, 64, 32) is not a
    # the bound: R = min(requests, T // 2) prefill requests, each over ceil(max_context_len / bs) blocks
    assert kg.scratch_units(4, 11, 9, 16, 2, headwise=False, window=None) == (9, 9, 9, 36)
    assert kg.scratch_units(4, 11, 9, 16, 2, headwise=False, window=None, max_context_len=40)[3] == 12
    # head-wise, heads 1..2 of 3 slide: per request one full head and two windows
    w = kg.scratch_units(2, 40, 9, 16, 3, headwise=True, window=8, win_h0=1, win_h1=3, max_q_len=20,
                         max_context_len=140)  # fmt: skip
    assert w == (9, 3, 9 + 2 * 3, 2 * 15)


def test_scratch_budget_bounds_every_step_and_its_growth(monkeypatch):
    """``FDFLEET_DEQUANT_SCRATCH_MB``: a step whose bound (codes' pages in the model dtype plus the remapped
    table) exceeds it does not fit (the plan then runs the portable prefill); growth stops at the budget
    where the step still fits; the variable parses strictly."""
    monkeypatch.setenv("FDFLEET_DEQUANT_SCRATCH_MB", "1")
    g = kg.DequantGather(
        hkv=2, block_size=16, dqk=64, dv=32, dtype=torch.float16, device="cpu", kv_code=1, scale_mode=1,
        page_h=2, common=(0, 0, 0, 0), scale_strides=(0, 0, 0, 0), n_pages=100, headwise=False, window=None,
        scratch=kg.DequantScratch("cpu", torch.float16, 2, 16, 64, 32),
    )  # fmt: skip
    unit = 2 * 16 * (64 + 32) * 2  # one scratch block: 6144 bytes
    assert g.budget == 1 << 20
    # 2 prefill requests x 80 blocks = 160 blocks (983,040 bytes) + a 2 x 80 table: fits in 1 MiB
    assert g.fits(2, 400, 2, 80)
    # 3 requests: 240 blocks, 1,474,560 bytes: does not
    assert not g.fits(3, 400, 3, 80)
    assert g.fits(3, 400, 3, 80, max_context_len=800)  # 50 blocks each, as max_context_len bounds them
    g.scratch.ensure(100, 10, most=g.budget // unit)
    g.scratch.ensure(160, 10, most=g.budget // unit)  # 1.5 x 100 = 150 < 160: 160
    g.scratch.ensure(165, 10, most=g.budget // unit)  # 1.5 x 160 = 240 would pass the budget: 170
    assert g.scratch.blocks == (1 << 20) // unit == 170
    fresh = kg.DequantScratch("cpu", torch.float16, 2, 16, 64, 32)
    g.scratch = fresh
    g.reserve()  # the plan's first prefill: the whole budget at once, whatever the step needs
    assert fresh.blocks == 170 and fresh.generation == 1
    g.reserve()
    assert fresh.generation == 1
    for bad in ("-1", "1.5", "lots", "١٢"):
        monkeypatch.setenv("FDFLEET_DEQUANT_SCRATCH_MB", bad)
        with pytest.raises(ValueError, match="FDFLEET_DEQUANT_SCRATCH_MB"):
            envs.dequant_scratch_mb()
    monkeypatch.delenv("FDFLEET_DEQUANT_SCRATCH_MB")
    assert envs.dequant_scratch_mb() == envs.DEQUANT_SCRATCH_MB_DEFAULT == 512


@pytest.mark.parametrize("budget_mb", ["0", "1"])
def test_a_step_past_the_budget_runs_the_portable_prefill(monkeypatch, budget_mb):
    """A plan on the gather path (made to choose it here, on the interpreter) whose step's scratch bound
    passes ``FDFLEET_DEQUANT_SCRATCH_MB`` runs the portable prefill over the codes: its output is a portable
    plan's, bit for bit, with no Hopper plan built; the first prefill reserved the whole budget."""
    import fastdeploy_paddlefleet.kernels.paged_attention as pa

    monkeypatch.setenv("FDFLEET_DEQUANT_SCRATCH_MB", budget_mb)
    # 64 / 64 dims over 64-token blocks: one scratch block is 2 heads x 64 x 128 x 4 bytes = 64 KiB; three
    # prefill requests over 40 blocks each need 7.5 MiB, past 1 MiB
    s, qs = quant_step([(2000, 6), (20, 1), (500, 9), (1200, 3)], "block_wise_fp8", hkv=2, group=2, dqk=64,
                       dv=64, block_size=64)  # fmt: skip
    kw = dict(scale=0.125, kv_quant=qs.fmt, key_scale=qs.ks, value_scale=qs.vs)
    run = dict(max_q_len=9, max_context_len=2560)
    want = AttentionPlan(qs.kc, qs.vc, s.q, prefill_impl="portable", **kw).run(
        s.q, s.cu, s.dec, s.table, **run
    )
    monkeypatch.setattr(pa, "choose_prefill_impl", lambda *a, **k: "hopper")
    plan = AttentionPlan(qs.kc, qs.vc, s.q, **kw)
    assert plan.gather is not None
    plan.gather.scratch = kg.DequantScratch("cpu", torch.float32, 2, 64, 64, 64)  # this test's own
    got = plan.run(s.q, s.cu, s.dec, s.table, **run)
    assert plan.hopper is None
    assert torch.equal(got, want)
    assert plan.gather.scratch.blocks == (int(budget_mb) << 20) // (2 * 64 * 128 * 4)


def test_no_scratch_means_the_portable_prefill(monkeypatch):
    """``FDFLEET_DEQUANT_SCRATCH_MB=0``: ``auto`` keeps a quantized cache on the portable prefill wherever
    it runs, and ``hopper`` asked for names the variable; an unquantized cache is unaffected."""
    monkeypatch.setenv("FDFLEET_DEQUANT_SCRATCH_MB", "0")
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    fmt = qa.fmt_of("block_wise_fp8")
    dev = "cuda" if CUDA else "cpu"
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device=dev)
    codes = torch.zeros(2, 2, 64, 128, dtype=torch.uint8, device=dev)
    assert hp.choose_prefill_impl(None, None, q, codes, codes, fmt) == "portable"
    with pytest.raises(ValueError, match="FDFLEET_DEQUANT_SCRATCH_MB=0"):
        hp.choose_prefill_impl("hopper", None, q, codes, codes, fmt)
    bf16 = torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16, device=dev)
    want = "hopper" if HOPPER and triton_tested() else "portable"
    assert hp.choose_prefill_impl(None, None, q, bf16, bf16, None) == want


@pytest.mark.parametrize(
    "case",
    [
        dict(fmt="block_wise_fp8"),
        dict(fmt="int8", dqk=48),
        dict(fmt="fp8_per_channel", window_left=5, release=True),
        dict(fmt="fp8_per_head", headwise=True, window_left=4, sliding_heads=(1, 3), release=True, hkv=3),
    ],
    ids=["blockwise", "int8-48x16", "channel-window", "headwise-window"],
)
def test_gather_then_portable_prefill_matches_dense(case):
    """End to end on the CPU: the portable prefill over the scratch and the remapped table equals the
    dense attention on the dequantized cache within 1e-3 (fp32): the remap points at the right pages."""
    case = dict(case)
    fmt = case.pop("fmt")
    kw = {k: case.pop(k) for k in ("window_left", "sliding_heads") if k in case}
    shape = dict(hkv=2, group=2, dqk=16, dv=16, block_size=8)
    shape.update(case)
    s, qs = quant_step([(30, 6), (20, 1), (0, 9), (44, 3)], fmt, **kw, **shape)
    k, v, tbl = gather(s, qs, torch.float32, **kw)
    scale = 1.0 / math.sqrt(shape["dqk"])
    out = paged_attention(
        s.q, k, v, s.cu, s.dec, tbl, scale=scale, headwise=s.headwise, prefill_impl="portable", **kw
    )  # fmt: skip
    worst = 0.0
    for b, (_, n) in enumerate(s.reqs):
        if n < 2:
            continue
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            s.q[lo:hi].cpu(), qs.history(b, "k"), qs.history(b, "v"), scale=scale,
            compute_dtype=torch.float64, **kw,
        )  # fmt: skip
        worst = max(worst, float((out[lo:hi].cpu().double() - want).abs().max()))
    assert worst <= 1e-3, worst


def test_auto_picks_the_gather_and_hopper_only_where_hopper_runs(monkeypatch):
    """``auto`` on a quantized cache: hopper (through the gather) exactly where the bf16 path would pick
    it, else portable; ``hopper`` asked for on inputs it cannot run names the reason; ``portable`` stays."""
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    fmt = qa.fmt_of("block_wise_fp8")
    dev = "cuda" if CUDA else "cpu"
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device=dev)
    codes = torch.zeros(2, 2, 64, 128, dtype=torch.uint8, device=dev)
    want = "hopper" if HOPPER and triton_tested() else "portable"
    assert hp.choose_prefill_impl(None, None, q, codes, codes, fmt) == want
    assert hp.choose_prefill_impl("portable", None, q, codes, codes, fmt) == "portable"
    if not HOPPER:
        with pytest.raises(ValueError, match="cannot run these inputs"):
            hp.choose_prefill_impl("hopper", None, q, codes, codes, fmt)
    q96 = torch.zeros(4, 8, 96, dtype=torch.bfloat16, device=dev)
    c96 = torch.zeros(2, 2, 64, 96, dtype=torch.uint8, device=dev)
    assert hp.choose_prefill_impl(None, None, q96, c96, c96, fmt) == "portable"
    with pytest.raises(ValueError, match="cannot run these inputs"):
        hp.choose_prefill_impl("hopper", None, q96, c96, c96, fmt)


# ---------------------------------------------------------------------------------- sm_90 GPU

REL_TOL = {torch.float16: 1e-3, torch.bfloat16: 2e-2}


def _hopper_quant_case(fmt, dtype, reqs, *, window_left=None, sliding_heads=None, headwise=False, **shape):
    s, qs = quant_step(
        reqs, fmt, window_left=window_left, sliding_heads=sliding_heads,
        headwise=headwise, release=window_left is not None, seed=21, **shape,
    )  # fmt: skip
    q = s.q.to(dtype)
    if qs.fmt.dynamic:  # FastDeploy's scales: the model dtype
        qs.ks, qs.vs = qs.ks.to(dtype), qs.vs.to(dtype)
        qs.deq_k = qa.dequantize_cache(qs.kc, qs.ks, qs.fmt, qs.heads)
        qs.deq_v = qa.dequantize_cache(qs.vc, qs.vs, qs.fmt, qs.heads)
    kw = dict(window_left=window_left, sliding_heads=sliding_heads)
    plan = AttentionPlan(
        qs.kc, qs.vc, q, scale=1 / math.sqrt(q.shape[2]), headwise=headwise, prefill_impl="hopper",
        kv_quant=qs.fmt, key_scale=qs.ks, value_scale=qs.vs, **kw,
    )  # fmt: skip
    assert plan.prefill == "hopper" and plan.gather is not None
    mq = max(n for _, n in reqs)
    mc = max(c + n for c, n in reqs)
    outs = []
    for _ in range(2):
        outs.append(plan.run(q, s.cu, s.dec, s.table, max_q_len=mq, max_context_len=mc))
    gen = plan.gather.scratch.generation
    outs.append(plan.run(q, s.cu, s.dec, s.table, max_q_len=mq, max_context_len=mc))
    assert plan.gather.scratch.generation == gen  # warm: no allocation per step
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[2])
    out = outs[0]
    scale = 1 / math.sqrt(q.shape[2])
    for b, (_, n) in enumerate(reqs):
        if n == 0:
            continue
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            q[lo:hi].float().cpu().double(), qs.history(b, "k"), qs.history(b, "v"), scale=scale,
            compute_dtype=torch.float64, **kw,
        )  # fmt: skip
        got = out[lo:hi].cpu().double()
        assert torch.isfinite(got).all(), f"request {b}: non-finite output"
        err = float((got - want).norm() / want.norm().clamp_min(1e-6))
        assert err <= REL_TOL[dtype], f"request {b} ({'prefill' if n > 1 else 'decode'}): {err:.2e}"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_head", "int8"])
def test_hopper_prefill_of_a_quantized_cache(dtype, fmt):
    """Chunked prefills with context, a decode row in the same step (read from the codes), 128 / 128."""
    _hopper_quant_case(fmt, dtype, [(1000, 700), (0, 513), (37, 1), (130, 77)], **tk.REAL)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_prefill_of_a_quantized_cache_window_headwise_mla(dtype):
    """A sliding window with released pages; head-wise tables with half the heads sliding; MLA."""
    reqs = [(600, 300), (0, 200), (900, 1), (64, 3)]
    _hopper_quant_case("block_wise_fp8", dtype, reqs, window_left=255, **tk.REAL)
    _hopper_quant_case("fp8_per_channel", dtype, reqs, window_left=100, sliding_heads=(4, 8), headwise=True,
                       **tk.REAL)  # fmt: skip
    _hopper_quant_case("block_wise_fp8", dtype, reqs, hkv=2, group=4, dqk=192, dv=128, block_size=64)


@pytest.mark.gpu
@hopper
def test_paged_attention_runs_the_gather_under_auto(monkeypatch):
    """``paged_attention`` on a quantized cache under ``auto`` (a tested Triton) takes the Hopper path."""
    if not triton_tested():
        pytest.skip("auto picks the Hopper kernel on a tested Triton only")
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    s, qs = quant_step([(300, 200), (10, 1)], "block_wise_fp8", seed=5, **tk.REAL)
    q = s.q.to(torch.bfloat16)
    ks, vs = qs.ks.to(torch.bfloat16), qs.vs.to(torch.bfloat16)
    plan = AttentionPlan(qs.kc, qs.vc, q, scale=0.1, kv_quant=qs.fmt, key_scale=ks, value_scale=vs)
    assert plan.prefill == "hopper"
    kw = dict(scale=0.1, kv_quant=qs.fmt, key_scale=ks, value_scale=vs, max_q_len=200, max_context_len=500)
    auto = paged_attention(q, qs.kc, qs.vc, s.cu, s.dec, s.table, **kw)
    port = paged_attention(q, qs.kc, qs.vc, s.cu, s.dec, s.table, prefill_impl="portable", **kw)
    torch.testing.assert_close(auto.float(), port.float(), atol=2e-2, rtol=2e-2)
