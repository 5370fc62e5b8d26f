"""The portable kernels read quantized KV caches (issue 31): uint8 codes plus dequant scales.

Each case builds a packed step the way ``test_triton_kernels.py`` does (NaN-filled float caches,
shuffled blocks, released pages), writes this step's K/V, then quantizes the *whole* cache with a
plain torch quantizer (round-to-nearest e4m3 through ``torch.float8_e4m3fn``, or int8 ``code + 128``):
NaN slots become NaN codes (and NaN per-token scales), so a read of an unwritten slot or a released
page shows. The reference is the dense attention (``kernels/dense_reference.py``) over each request's
*dequantized* history (``code * scale``), in float64 on CPU; the kernels run under the interpreter on
CPU (fp32 / fp16 q) and compiled on a GPU (``gpu`` cases: bf16, realistic shapes, CUDA graphs).

Masked keys contribute exactly nothing, with scales too: a NaN / max code or a NaN / Inf / huge scale
planted where a query may not see leaves that row's output bit-identical to a run with zeros there;
a row that sees it is non-finite.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import test_masked_keys as mk  # noqa: E402
import test_triton_kernels as tk  # noqa: E402  (sets TRITON_INTERPRET before the kernels exist)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastdeploy_paddlefleet.kernels.attention_kernels import _e4m3_as_f16_in_place, _q_for_codes  # noqa: E402
from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention, gather_request_kv  # noqa: E402
from fastdeploy_paddlefleet.kernels.hopper_prefill import choose_prefill_impl  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention  # noqa: E402
from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant  # noqa: E402

#: the first variant of each parametrized GPU test stays in ``-m gpu`` (conftest.py)
GPU_LONG_VARIANTS = True
CUDA = tk.CUDA
DEVICE = tk.DEVICE
gpu = tk.gpu
#: (FastDeploy format name, static fp8 per channel) -> what the cases run
FORMATS = {
    "block_wise_fp8": ("block_wise_fp8", None),
    "fp8_per_head": ("float8_e4m3fn", False),
    "fp8_per_channel": ("float8_e4m3fn", True),
    "int8": ("int8", None),
}
#: max |out - dense on the dequantized cache| allowed per q dtype (the brief's 1e-3 for fp32; fp16's
#: own rounding of q, P and the output; bf16 on the GPU: plus 1 % of the reference)
ATOL = {torch.float32: 1e-3, torch.float16: 4e-3, torch.bfloat16: 4e-3}
RTOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 1e-2}


def fmt_of(name: str):
    base, channel = FORMATS[name]
    return kv_cache_quant(base, channel_wise=channel)


def _fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest e4m3fn codes (uint8 bits) of ``x`` (already divided by its scale); NaN stays NaN."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def page_heads(s: tk.Step) -> torch.Tensor:
    """``[NB * Hkv]`` the logical kv head whose values each page holds: its head slot, except for pages
    a head-wise table maps to another head (a static scale belongs to the logical head)."""
    nb, hkv = s.key_cache.shape[0], s.key_cache.shape[1]
    heads = torch.arange(nb * hkv) % hkv
    if s.headwise:
        table = s.table.cpu().long()
        rows = torch.arange(table.shape[0])[:, None].expand_as(table) % hkv
        used = table >= 0
        heads[table[used]] = rows[used]
    return heads


def quantize_cache(
    cache: torch.Tensor, fmt, scale_dtype: torch.dtype, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache [NB, Hkv, BS, D]`` (float, NaN in unwritten slots) -> (uint8 codes, dequant scales):
    per token and kv head ``[NB, Hkv, BS]`` in ``scale_dtype`` (dynamic), per kv head ``[Hkv]`` or per
    channel ``[Hkv * D]`` float32 (static, from the finite values of each logical head's pages:
    ``heads`` from :func:`page_heads`)."""
    x = cache.float().cpu()
    nb, hkv, bs, d = x.shape
    if fmt.dynamic:
        amax = x.abs().amax(dim=-1)  # NaN where the slot is NaN
        scale = (amax.clamp_min(1e-6) / fmt.max_bound).to(scale_dtype)
        codes = _fp8_codes(x / scale.float()[..., None])
        return codes.to(cache.device), scale.to(cache.device)
    pages = torch.nan_to_num(x, nan=0.0).reshape(nb * hkv, bs, d).abs().amax(dim=1)  # [P, D]
    amax = torch.zeros(hkv, d).index_reduce_(0, heads, pages, "amax")  # [Hkv, D]
    if not fmt.channel_wise:
        amax = amax.amax(dim=1, keepdim=True).expand(hkv, d)
    scale = (amax.clamp_min(1e-6) / fmt.max_bound).float()  # [Hkv, D]
    y = x.reshape(nb * hkv, bs, d) / scale[heads][:, None, :]
    if fmt.code == "fp8":
        codes = _fp8_codes(y)
    else:  # int8: code + 128 (NaN slots: an arbitrary code, never read)
        codes = (torch.nan_to_num(y, nan=77.0).round().clamp(-127, 127) + 128).to(torch.uint8)
    out_scale = scale.reshape(-1) if fmt.channel_wise else scale[:, 0].contiguous()
    return codes.view(nb, hkv, bs, d).to(cache.device), out_scale.to(cache.device)


def dequantize_cache(codes: torch.Tensor, scale: torch.Tensor, fmt, heads: torch.Tensor) -> torch.Tensor:
    """``code * scale`` as float64 ``[NB, Hkv, BS, D]`` (static scales by each page's logical head)."""
    c = codes.cpu()
    if fmt.code == "fp8":
        x = c.view(torch.float8_e4m3fn).double()
    else:
        x = c.double() - 128.0
    s = scale.cpu().double()
    nb, hkv, bs, d = c.shape
    if fmt.dynamic:
        return x * s[..., None]
    per = s.view(hkv, d) if fmt.channel_wise else s.view(hkv, 1).expand(hkv, d)
    return (x.reshape(nb * hkv, bs, d) * per[heads][:, None, :]).view(nb, hkv, bs, d)


class QStep:
    """A step of ``tk.make_step`` with its caches quantized: ``kc`` / ``vc`` codes, ``ks`` / ``vs``
    scales, ``deq_k`` / ``deq_v`` the dequantized caches (float64, CPU)."""

    def __init__(self, s: tk.Step, fmt, *, write: bool = True) -> None:
        if write:
            write_kv_cache(
                s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=s.headwise
            )
        sdt = s.q.dtype  # dynamic scales in the model dtype
        self.s, self.fmt, self.heads = s, fmt, page_heads(s)
        self.kc, self.ks = quantize_cache(s.key_cache, fmt, sdt, self.heads)
        self.vc, self.vs = quantize_cache(s.value_cache, fmt, sdt, self.heads)
        self.deq_k = dequantize_cache(self.kc, self.ks, fmt, self.heads)
        self.deq_v = dequantize_cache(self.vc, self.vs, fmt, self.heads)

    def history(self, b: int, which: str, cache: torch.Tensor | None = None) -> torch.Tensor:
        """Request ``b``'s dequantized K or V history ``[L, Hkv, D]`` (float64, CPU)."""
        s = self.s
        ctx, n = s.reqs[b]
        hkv = s.key_cache.shape[1]
        c = cache if cache is not None else (self.deq_k if which == "k" else self.deq_v)
        rows = s.table[b * hkv : (b + 1) * hkv] if s.headwise else s.table[b]
        return gather_request_kv(c, rows.cpu(), ctx + n, headwise=s.headwise)

    def attend(self, *, kc=None, vc=None, ks=None, vs=None, **kw) -> torch.Tensor:
        s = self.s
        return paged_attention(
            s.q, self.kc if kc is None else kc, self.vc if vc is None else vc, s.cu, s.dec, s.table,
            headwise=s.headwise, kv_quant=self.fmt, key_scale=self.ks if ks is None else ks,
            value_scale=self.vs if vs is None else vs, **kw,
        )  # fmt: skip

    def gathered_prefill(self) -> bool:
        """Whether this step's prefill rows run the Hopper kernel on a scratch copy of the pages
        dequantized and **rounded once to the model dtype** (``kernels/kv_dequant_gather.py``: a bf16 /
        fp16 model on sm_90 with Gluon; its documented arithmetic), rather than on the codes."""
        from fastdeploy_paddlefleet import envs

        s = self.s
        return (
            s.q.is_cuda and envs.dequant_scratch_mb() > 0
            and choose_prefill_impl(None, None, s.q, self.kc, self.vc, self.fmt) == "hopper"
        )  # fmt: skip

    def check(self, out: torch.Tensor, *, scale: float, sinks=None, **kw) -> float:
        """Max abs error of ``out [T, Hq, Dv]`` against the dense attention on the dequantized caches
        (prefill rows of a :meth:`gathered_prefill` step: on those values rounded once to the model
        dtype, as the gather writes them); asserts it is within :data:`ATOL` / :data:`RTOL` and that the
        output is finite."""
        s = self.s
        worst = 0.0
        rounded = None
        if self.gathered_prefill():
            rounded = tuple(c.float().to(s.q.dtype).double() for c in (self.deq_k, self.deq_v))
        for b, (_, n) in enumerate(s.reqs):
            if n == 0:
                continue
            lo, hi = int(s.cu[b]), int(s.cu[b + 1])
            kc, vc = rounded if rounded is not None and n > 1 else (None, None)
            want = dense_attention(
                s.q[lo:hi].cpu(), self.history(b, "k", kc), self.history(b, "v", vc), scale=scale,
                sinks=None if sinks is None else sinks.cpu(), compute_dtype=torch.float64, **kw,
            )  # fmt: skip
            got = out[lo:hi].cpu().double()
            assert torch.isfinite(got).all(), f"request {b}: non-finite output (read an unwritten slot?)"
            err = (got - want).abs()
            bound = ATOL[s.q.dtype] + RTOL[s.q.dtype] * want.abs()
            assert (err <= bound).all(), f"request {b}: max abs error {float(err.max()):.2e}"
            worst = max(worst, float(err.max()))
        return worst


def run_quant(
    reqs, fmt_name: str, *, hkv=2, group=2, dqk=16, dv=16, block_size=8, dtype=torch.float32,
    headwise=False, window_left=None, sliding_heads=None, release=False, sink_kind="vanilla",
    logits_soft_cap=None, seed=0, **kw,
) -> float:  # fmt: skip
    """Build, quantize, attend, compare; returns the max abs error."""
    s = tk.make_step(
        reqs, hkv=hkv, group=group, dqk=dqk, dv=dv, block_size=block_size, dtype=dtype, headwise=headwise,
        window_left=window_left, sliding_heads=sliding_heads, release=release, seed=seed,
    )  # fmt: skip
    qs = QStep(s, fmt_of(fmt_name))
    scale = 1.0 / math.sqrt(dqk)
    sinks = None
    if sink_kind == "learnable":
        sinks = torch.linspace(-1.0, 2.0, s.q.shape[1]).to(s.q.device)
    out = qs.attend(
        scale=scale, window_left=window_left, sliding_heads=sliding_heads, sink_kind=sink_kind, sinks=sinks,
        logits_soft_cap=logits_soft_cap, **kw,
    )  # fmt: skip
    return qs.check(
        out, scale=scale, sinks=sinks, window_left=window_left, sliding_heads=sliding_heads,
        sink_kind=sink_kind, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip


# ---------------------------------------------------------------------------- interpreter / any GPU

MIXED = [(9, 4), (20, 1), (0, 5), (3, 1)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_mixed_batch_every_format(fmt):
    """Prefill chunks with and without context and decode tokens in one batch, GQA."""
    run_quant(MIXED, fmt)


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_split_kv_decode(fmt):
    run_quant([(70, 1), (41, 1)], fmt, num_splits=4)


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_channel"])
def test_sliding_window_with_released_pages(fmt):
    """Released pages are -1 and hold NaN codes (and NaN scales): never read."""
    run_quant([(30, 6), (27, 1), (40, 1)], fmt, window_left=5, release=True)
    run_quant([(45, 1), (38, 1)], fmt, window_left=9, release=True, num_splits=2)


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_headwise_lanes(fmt):
    """Head-wise page tables, kv heads 1..2 slide (their old pages released), the others full."""
    run_quant(
        [(20, 5), (31, 1)], fmt, hkv=3, group=2, headwise=True, window_left=4, sliding_heads=(1, 3),
        release=True,
    )  # fmt: skip


@pytest.mark.parametrize("sink_kind", ["learnable", "off-by-one"])
def test_sinks(sink_kind):
    run_quant(MIXED, "block_wise_fp8", sink_kind=sink_kind)
    run_quant([(50, 1), (7, 1)], "fp8_per_head", sink_kind=sink_kind, num_splits=2)


def test_soft_cap():
    run_quant(MIXED, "block_wise_fp8", logits_soft_cap=3.0)
    run_quant(MIXED, "int8", logits_soft_cap=2.0, window_left=6)


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_channel", "int8"])
def test_qk_dim_differs_from_v_dim(fmt):
    run_quant([(9, 6), (12, 1)], fmt, dqk=48, dv=16)


def test_mla_dims():
    """MLA's 192 / 128 (one kv head per query head)."""
    run_quant([(5, 3), (9, 1)], "block_wise_fp8", hkv=2, group=1, dqk=192, dv=128, block_size=16)


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims(d):
    run_quant([(6, 2), (10, 1)], "block_wise_fp8", hkv=1, group=2, dqk=d, dv=d, block_size=16)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_block_sizes_around_the_key_tile(block_size):
    """Key tiles inside one page and tiles gathering one page per key."""
    run_quant([(40, 3), (70, 1)], "block_wise_fp8", block_size=block_size)


def test_fp16_inputs():
    run_quant(MIXED, "block_wise_fp8", dtype=torch.float16)
    run_quant(MIXED, "int8", dtype=torch.float16, num_splits=2)


def _small_values_error(reqs, *, dqk: int, block_size: int, num_splits: int | None) -> float:
    """Max over requests of max |out - dense| / max |dense| for an fp16 model over a block_wise_fp8 cache
    of small V values (|v| ~ 1e-3: fp16 scales ~ 2e-6) and spread scores (many small P)."""
    s = tk.make_step(reqs, hkv=2, group=2, dqk=dqk, dv=dqk, block_size=block_size, dtype=torch.float16,
                     seed=1)  # fmt: skip
    s.value_cache.mul_(1e-3)
    s.v.mul_(1e-3)
    s.q.mul_(0.2)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    scale = 1.0 / math.sqrt(dqk)
    out = qs.attend(scale=scale, num_splits=num_splits)
    worst = 0.0
    for b in range(len(s.reqs)):
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(s.q[lo:hi].cpu(), qs.history(b, "k"), qs.history(b, "v"), scale=scale,
                               compute_dtype=torch.float64)  # fmt: skip
        worst = max(worst, float((out[lo:hi].cpu().double() - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("num_splits", [None, 2])
def test_fp16_small_values_keep_their_precision(num_splits):
    """P times V's per-token scales would fall below fp16's normal range for small V values, where it
    loses bits: the error relative to the output's size stays what it is for |v| ~ 1 (the dense
    reference on the dequantized cache; decode, split-KV and prefill rows)."""
    err = _small_values_error([(200, 1), (40, 37), (0, 50), (300, 1)], dqk=64, block_size=16,
                              num_splits=num_splits)  # fmt: skip
    assert err < 1.5e-3, f"max abs error {err:.1e} of the largest output"


@gpu
@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
def test_gpu_fp16_small_values_keep_their_precision():
    """The same on the GPU's compiled kernels at head dim 128, block size 64, longer contexts."""
    reqs = [(3000, 1), (700, 300), (0, 257), (1500, 1)]
    for splits in (None, 8):
        err = _small_values_error(reqs, dqk=128, block_size=64, num_splits=splits)
        assert err < 1.5e-3, f"num_splits={splits}: max abs error {err:.1e} of the largest output"


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_head", "fp8_per_channel"])
@pytest.mark.parametrize("f16_codes", [2, 3])
def test_bf16_model_reads_fp8_codes_as_fp16(fmt, f16_codes, monkeypatch):
    """A bf16 model over an e4m3 cache reads K's and V's codes as fp16 (``F16_CODES`` 2, or 3: V's
    converted where loaded, GPU only; the interpreter takes 2; set here for decode and prefill):
    decode, split-KV, a mixed batch, a window with sinks over released pages, against the dense reference
    on the dequantized cache. Every dot is then fp16, so the interpreter checks it too (its bf16
    ``tl.dot`` is not exact)."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "FP8_F16_CODES_DECODE", f16_codes)
    monkeypatch.setattr(pa, "FP8_F16_CODES_PREFILL", f16_codes)
    kw = dict(dtype=torch.bfloat16, dqk=32, dv=32)
    run_quant(MIXED, fmt, **kw)
    run_quant([(70, 1), (41, 1)], fmt, num_splits=4, **kw)
    run_quant([(30, 6), (27, 1)], fmt, window_left=5, release=True, sink_kind="learnable", **kw)


@pytest.mark.parametrize("cap", [None, 128])
def test_fp8_decode_register_cap_reaches_only_fp8_decode_tiles(cap, monkeypatch):
    """``FP8_DECODE_MAXNREG`` (benchmarks' ``--fp8-decode-maxnreg``) caps the registers of the default
    decode tiles of an fp8 cache, and of nothing else: not a bf16 cache's decode, not the prefill, not a
    decode config the caller gave; the capped plan still matches the dense reference."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "FP8_DECODE_MAXNREG", cap)
    q = torch.zeros(4, 8, 32, dtype=torch.bfloat16)
    codes = torch.zeros(6, 2, 64, 32, dtype=torch.uint8)
    scales = torch.zeros(6, 2, 64, dtype=torch.bfloat16)
    fp8 = pa.AttentionPlan(codes, codes.clone(), q, scale=0.1, kv_quant="block_wise_fp8", key_scale=scales,
                           value_scale=scales.clone())  # fmt: skip
    assert fp8.decode_cfg.maxnreg == cap and fp8.prefill_cfg.maxnreg is None
    plain = pa.AttentionPlan(torch.zeros(6, 2, 64, 32, dtype=torch.bfloat16),
                             torch.zeros(6, 2, 64, 32, dtype=torch.bfloat16), q, scale=0.1)  # fmt: skip
    assert plain.decode_cfg.maxnreg is None
    given = pa.TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    mine = pa.AttentionPlan(codes, codes.clone(), q, scale=0.1, kv_quant="block_wise_fp8", key_scale=scales,
                            value_scale=scales.clone(), decode_config=given)  # fmt: skip
    assert mine.decode_cfg is given
    run_quant([(70, 1), (41, 1)], "block_wise_fp8", dtype=torch.float16, dqk=32, dv=32)


def test_fp8_decode_setup_takes_mode_3_only_where_it_was_timed_faster():
    """Mode 3 under the 128-register cap on the plain 64-key tile of a full-attention 128 / 128 cache;
    mode 1 and no cap on windows' tiles, head-wise pages, other head dims and other tiles."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    plain = pa.TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    sliding = pa.TileConfig(block_m=16, block_n=32, num_warps=2, num_stages=3)
    wide = pa.TileConfig(block_m=16, block_n=64, num_warps=2, num_stages=3)
    assert pa.fp8_decode_setup(plain, 128, 128, False, False) == (3, pa.FP8_DECODE_AUTO_MAXNREG)
    for cfg, dqk, dv, headwise, window in [
        (plain, 128, 128, True, False),
        (plain, 128, 128, False, True),
        (sliding, 128, 128, False, True),
        (plain, 192, 128, False, False),
        (plain, 64, 64, False, False),
        (sliding, 128, 128, False, False),
        (wide, 128, 128, True, True),
        (wide, 192, 128, False, True),
        (wide, 128, 128, False, False),
        (wide, 128, 128, False, True),
    ]:
        assert pa.fp8_decode_setup(cfg, dqk, dv, headwise, window) == (1, None)


@pytest.mark.parametrize("forced", [None, 1])
def test_plan_takes_the_decode_setup_unless_told(forced, monkeypatch):
    """A bf16 plan over an e4m3 cache with the GPU's plain decode tile takes :func:`fp8_decode_setup`'s
    choice (mode 3, here read as 2 by the interpreter, under the cap) unless ``FP8_F16_CODES_DECODE``
    forces a mode; a bf16 cache, an fp16 model and a caller's decode config are left alone; and mode 3 as
    the interpreter runs it matches the dense reference."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    real = pa.default_decode_config
    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", False)  # the query-rows layout's setup
    monkeypatch.setattr(pa, "FP8_F16_CODES_DECODE", forced)
    monkeypatch.setattr(pa, "default_decode_config", lambda *a, **k: pa.TileConfig(16, 64, 4, 3))
    codes = torch.zeros(6, 2, 64, 128, dtype=torch.uint8)
    scales = torch.zeros(6, 2, 64, dtype=torch.bfloat16)
    quant = dict(kv_quant="block_wise_fp8", key_scale=scales, value_scale=scales.clone())

    def plan(dtype=torch.bfloat16, cache=codes, **kw):
        return pa.AttentionPlan(cache, cache.clone(), torch.zeros(4, 8, 128, dtype=dtype), scale=0.1, **kw)

    p = plan(**quant)
    if forced is None:
        assert p.f16_codes == (1, 2) and p.decode_cfg.maxnreg == pa.FP8_DECODE_AUTO_MAXNREG
    else:
        assert p.f16_codes == (1, 1) and p.decode_cfg.maxnreg is None
    assert plan(torch.float16, **quant).f16_codes == (0, 0)
    assert plan(cache=torch.zeros(6, 2, 64, 128, dtype=torch.bfloat16)).decode_cfg.maxnreg is None
    given = pa.TileConfig(16, 64, 4, 3)
    mine = plan(decode_config=given, **quant)
    assert mine.decode_cfg is given and mine.f16_codes == (1, 1)
    # every head sliding: the GPU's 32-key window tile as it is, mode 1, no cap
    monkeypatch.setattr(pa, "default_decode_config", lambda *a, **k: pa.TileConfig(16, 32, 2, 3))
    win = plan(window_left=1023, **quant)
    assert win.decode_cfg == pa.TileConfig(16, 32, 2, 3) and win.f16_codes == (1, 1)
    assert plan(window_left=1023, sliding_heads=(0, 1), **quant).decode_cfg == pa.TileConfig(16, 32, 2, 3)
    if forced is None:  # mode 3 as the interpreter runs it (2), on the interpreter's tile
        monkeypatch.setattr(pa, "default_decode_config", real)
        monkeypatch.setattr(pa, "FP8_F16_CODES_DECODE", 2)
        run_quant([(70, 1), (41, 1)], "block_wise_fp8", dtype=torch.bfloat16, dqk=32, dv=32)


@gpu
@pytest.mark.gpu
def test_gpu_e4m3_codes_convert_exactly_where_loaded():
    """``_e4m3_as_f16_in_place`` (inline PTX) gives every one of the 256 codes the fp16 value torch's
    ``float8_e4m3fn`` has (NaN for the two NaN codes), in a tile shaped as V's."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(16, 16).repeat(4, 8)  # [64, 128]
    out = torch.empty(codes.shape, dtype=torch.float16, device=DEVICE)
    _e4m3_probe[(1,)](codes, out, 64, 128)
    want = codes.view(torch.float8_e4m3fn).to(torch.float16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], want[~nan])


@triton.jit
def _e4m3_probe(X, Out, N: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(Out + offs, _e4m3_as_f16_in_place(tl.load(X + offs)))


@triton.jit
def _q_probe(Q, Out, Scale, M: tl.constexpr, D: tl.constexpr):
    """``_q_for_codes`` on a bf16 ``Q [M, D]``: the fp16 q into ``Out``, the score scale into ``Scale``."""
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    q, s = _q_for_codes(tl.load(Q + offs), 0.5, 1)
    tl.store(Out + offs, q)
    tl.store(Scale, s)


@pytest.mark.parametrize("amax", [3.0, 40000.0, 3.0e30])
def test_queries_go_to_fp16_exactly(amax):
    """``_q_for_codes`` (e4m3 keys under a bf16 model read as fp16): q times ``2^-e`` in fp16 equals
    the bf16 q exactly, ``max|q| * 2^-e < 2^15``, and ``qk_scale`` carries ``2^e`` (checked in float64)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, 32, generator=gen)
    q = (q / q.abs().max() * amax).to(torch.bfloat16).to(DEVICE)
    q[0, :3] = torch.tensor([1e-30, -(2.0**-20), 0.0])  # tiny values: fp16 denormals or zero after 2^-e
    out = torch.empty(16, 32, dtype=torch.float16, device=DEVICE)
    scale = torch.empty(1, dtype=torch.float32, device=DEVICE)
    _q_probe[(1,)](q, out, scale, 16, 32)
    e = math.log2(float(scale.cpu()) / 0.5)
    assert e == int(e) and e >= 0
    want = q.double().cpu() * 2.0**-e
    assert float(want.abs().max()) < 2.0**15
    big = want.abs() >= 2.0**-14  # fp16's normal range: exact there; below it, fp16's own rounding
    got = out.double().cpu()
    assert torch.equal(got[big], want[big])
    assert float((got - want).abs().max()) <= 2.0**-25


@gpu
@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
def test_gpu_fp8_reads_take_queries_and_value_scales_past_fp16s_range():
    """e4m3 keys are read as fp16 under a bf16 model (``_q_for_codes``); bf16 |q| ~ 1e5 (past fp16's
    65504) and V scales ~ 3e4 still match the dense attention on the dequantized cache, relative to
    the output's size (decode, split and not, and prefill)."""
    s = tk.make_step(MIXED + [(37, 1)], hkv=2, group=2, dqk=64, dv=64, block_size=16, dtype=torch.bfloat16)
    q_up, v_up = 2.0**17, 2.0**22
    s.q.mul_(q_up)
    for t in (s.v, s.value_cache):
        t.mul_(v_up)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    scale = 1.0 / math.sqrt(64) / q_up
    for splits in (None, 2):
        out = qs.attend(scale=scale, num_splits=splits).cpu().double()
        for b in range(len(s.reqs)):
            lo, hi = int(s.cu[b]), int(s.cu[b + 1])
            want = dense_attention(
                s.q[lo:hi].cpu(), qs.history(b, "k"), qs.history(b, "v"), scale=scale,
                compute_dtype=torch.float64,
            )  # fmt: skip
            assert torch.isfinite(out[lo:hi]).all(), f"request {b}: non-finite output"
            err = float((out[lo:hi] - want).abs().max()) / v_up
            assert err <= 2e-2, f"request {b}: max error {err:.2e} x {v_up:g}"


def test_dynamic_scales_may_be_a_view_of_wider_heads():
    """A layer reading the leading kv heads of a wider cache (strided views): codes and per-token
    scales share the heads per block."""
    s = tk.make_step([(9, 4), (20, 1)], hkv=4, group=1, dqk=16, dv=16, block_size=8)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    hkv = 2
    q = s.q[:, : hkv * 1].contiguous()
    out = paged_attention(
        q, qs.kc[:, :hkv], qs.vc[:, :hkv], s.cu, s.dec, s.table, scale=0.25, kv_quant="block_wise_fp8",
        key_scale=qs.ks[:, :hkv], value_scale=qs.vs[:, :hkv],
    )  # fmt: skip
    full = qs.attend(scale=0.25)
    torch.testing.assert_close(out, full[:, :hkv], atol=1e-6, rtol=1e-6)


def test_hopper_prefill_on_inputs_it_cannot_run_names_the_reason_and_auto_routes_to_portable(monkeypatch):
    """A quantized cache's Hopper prefill runs through the dequantizing gather (bf16 / fp16 models on
    sm_90: ``tests/test_kv_dequant_gather.py``); here (fp32, 16-wide heads) it cannot run: asking for it
    names the reason, ``auto`` takes the portable prefill."""
    s = tk.make_step([(3, 4)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    with pytest.raises(ValueError, match="hopper prefill kernel cannot run these inputs"):
        qs.attend(scale=0.25, prefill_impl="hopper")
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "hopper")
    with pytest.raises(ValueError, match="cannot run these inputs"):
        qs.attend(scale=0.25)
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "auto")
    from fastdeploy_paddlefleet.kernels.paged_attention import AttentionPlan

    plan = AttentionPlan(
        qs.kc, qs.vc, s.q, scale=0.25, kv_quant=qs.fmt, key_scale=qs.ks, value_scale=qs.vs
    )  # fmt: skip
    assert plan.prefill == "portable"


def test_bad_quantized_arguments_raise():
    s = tk.make_step([(3, 1)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    args = (s.q, qs.kc, qs.vc, s.cu, s.dec, s.table)
    with pytest.raises(ValueError, match="needs kv_quant"):
        paged_attention(*args, scale=0.25)
    with pytest.raises(TypeError, match="needs uint8"):
        paged_attention(
            s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, scale=0.25, kv_quant="block_wise_fp8",
            key_scale=qs.ks, value_scale=qs.vs,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs key_scale and value_scale"):
        paged_attention(*args, scale=0.25, kv_quant="block_wise_fp8")
    with pytest.raises(ValueError, match=r"key_scale of kv_quant='block_wise_fp8' must be"):
        paged_attention(
            *args, scale=0.25, kv_quant="block_wise_fp8", key_scale=qs.ks[:, :, :4], value_scale=qs.vs
        )
    with pytest.raises(ValueError, match=r"value_scale of kv_quant='int8' must hold 32"):
        paged_attention(
            *args, scale=0.25, kv_quant="int8", key_scale=torch.ones(32), value_scale=torch.ones(2)
        )
    with pytest.raises(TypeError, match="key_scale must be one of"):
        paged_attention(
            *args, scale=0.25, kv_quant="int8", key_scale=torch.ones(32, dtype=torch.int32),
            value_scale=torch.ones(32),
        )  # fmt: skip
    with pytest.raises(ValueError, match="zero-point"):
        paged_attention(*args, scale=0.25, kv_quant="int8_zp", key_scale=qs.ks, value_scale=qs.vs)
    with pytest.raises(ValueError, match="not available for a quantized cache"):
        paged_attention(
            *args, scale=0.25, kv_quant="block_wise_fp8", key_scale=qs.ks, value_scale=qs.vs,
            new_kv=(s.k, s.v), max_q_len=1,
        )  # fmt: skip


# ---------------------------------------------------------------------------- masked keys, with scales

NAN_CODE = 0x7F  # e4m3fn NaN (the interpreter reads it as 480: still not what a zero slot holds)
MAX_CODE = 0x7E  # 448


def check_masked_quant(
    reqs, plants, what: str, bad, fmt_name: str = "block_wise_fp8", *, hkv=2, group=2, dqk=16, dv=16,
    block_size=8, headwise=False, window_left=None, sliding_heads=None, sink_kind="vanilla", **kw,
) -> None:  # fmt: skip
    """Plant ``bad`` at ``plants`` in ``what`` (``k`` / ``v`` codes, ``ks`` / ``vs`` per-token scales),
    run with it and with zeros there (code 0 and scale 0), and check the contract: rows blind to every
    plant are bit-identical, the zero run matches the dense reference (the zeros in its history), a
    row that sees a NaN code or a non-finite scale is non-finite."""
    s = tk.make_step(
        reqs, hkv=hkv, group=group, dqk=dqk, dv=dv, block_size=block_size, headwise=headwise,
        window_left=window_left, sliding_heads=sliding_heads,
    )  # fmt: skip
    mk._extend_tables(s, plants, hkv, block_size)
    qs = QStep(s, fmt_of(fmt_name))
    slots = []
    for p in plants:
        for h in range(hkv) if p.h is None else (p.h,):
            slots.append((mk._page(s, p.b, h, p.pos, hkv, block_size), p.pos % block_size))
    scale = 1.0 / math.sqrt(dqk)
    sinks = torch.linspace(-1.0, 1.0, s.q.shape[1]).to(s.q.device) if sink_kind == "learnable" else None
    outs = {}
    for run in ("bad", "zero"):
        t = {"k": qs.kc.clone(), "v": qs.vc.clone(), "ks": qs.ks.clone(), "vs": qs.vs.clone()}
        pages = {n: t[n].view(-1, block_size, t[n].shape[-1]) for n in ("k", "v")}
        pages.update({n: t[n].view(-1, block_size) for n in ("ks", "vs")})
        for page, slot in slots:
            for n in ("k", "v", "ks", "vs"):
                if run == "zero":  # a zero slot: code 0 and scale 0
                    pages[n][page, slot] = 0
            if run == "bad":
                pages[what][page, slot] = bad
        outs[run] = qs.attend(
            kc=t["k"], vc=t["v"], ks=t["ks"], vs=t["vs"], scale=scale, window_left=window_left,
            sliding_heads=sliding_heads, sink_kind=sink_kind, sinks=sinks, **kw,
        ).cpu()  # fmt: skip
        if run == "zero":
            zeroed = t
    bad_out, zero_out = outs["bad"], outs["zero"]
    sees = mk._sees(s, plants, group, window_left, sliding_heads)
    blind = ~sees
    assert blind.any(), "the case plants nothing any row is blind to"
    assert torch.equal(bad_out[blind], zero_out[blind]), (
        "a masked planted key changed a row that cannot see it"
    )
    non_finite = what in ("ks", "vs") and not math.isfinite(bad)
    nan_code = what in ("k", "v") and bad == NAN_CODE and CUDA  # the interpreter reads it as 480
    if sees.any() and (non_finite or nan_code):
        assert (~torch.isfinite(bad_out[sees])).any(dim=-1).all(), "a seen non-finite value was hidden"
    deq_k = dequantize_cache(zeroed["k"], zeroed["ks"], qs.fmt, qs.heads)
    deq_v = dequantize_cache(zeroed["v"], zeroed["vs"], qs.fmt, qs.heads)
    for b in range(len(s.reqs)):
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            s.q[lo:hi].cpu(), qs.history(b, "k", deq_k), qs.history(b, "v", deq_v), scale=scale,
            window_left=window_left, sliding_heads=sliding_heads, sink_kind=sink_kind,
            sinks=None if sinks is None else sinks.cpu(), logits_soft_cap=kw.get("logits_soft_cap"),
        )  # fmt: skip
        err = float((zero_out[lo:hi].double() - want).abs().max())
        assert err <= ATOL[s.q.dtype] + RTOL[s.q.dtype] * float(want.abs().max()), f"request {b}: {err:.2e}"


BAD_SCALES = [float("nan"), float("inf"), float("-inf"), 1.0e30]
WHATS = [("k", NAN_CODE), ("v", NAN_CODE), ("k", MAX_CODE), ("v", MAX_CODE)] + [
    (w, x) for w in ("ks", "vs") for x in BAD_SCALES
]


@pytest.mark.parametrize("what,bad", WHATS)
def test_masked_causal_future_and_past_the_context(what, bad):
    """This chunk's later tokens (prefill's causal diagonal), slots past the keys in the last page and
    in a page not yet written (prefill and decode)."""
    reqs = [(0, 20), (6, 11), (13, 1)]
    plants = [mk.Plant(0, 9), mk.Plant(1, 6 + 4), mk.Plant(1, 19), mk.Plant(2, 14), mk.Plant(2, 21)]
    check_masked_quant(reqs, plants, what, bad)


@pytest.mark.parametrize("what,bad", [("v", NAN_CODE), ("vs", float("nan")), ("ks", float("inf"))])
def test_masked_outside_the_window_split_kv(what, bad):
    reqs = [(30, 12), (60, 1), (25, 1)]
    plants = [mk.Plant(0, 3), mk.Plant(0, 30 - 5), mk.Plant(1, 60 - 11), mk.Plant(1, 2), mk.Plant(2, 25 - 7)]
    check_masked_quant(reqs, plants, what, bad, window_left=6, sink_kind="learnable", num_splits=3)


@pytest.mark.parametrize("what,bad", [("vs", float("nan")), ("v", NAN_CODE)])
def test_masked_headwise_windows(what, bad):
    reqs = [(20, 9), (30, 1)]
    plants = [
        mk.Plant(0, 20 - 6, h=3),
        mk.Plant(0, 24, h=1),
        mk.Plant(1, 30 - 6, h=2),
        mk.Plant(1, 30 - 6, h=0),
    ]
    check_masked_quant(
        reqs, plants, what, bad, hkv=4, group=2, headwise=True, window_left=4, sliding_heads=(2, 4),
        sink_kind="off-by-one",
    )  # fmt: skip


def test_masked_static_formats_codes():
    """Static formats: only codes live in the cache (a max / NaN code planted)."""
    reqs = [(0, 20), (13, 1)]
    plants = [mk.Plant(0, 9), mk.Plant(1, 14), mk.Plant(1, 20)]
    for fmt in ("fp8_per_channel", "int8"):
        for what in ("k", "v"):
            check_masked_static(reqs, plants, what, fmt)


def check_masked_static(reqs, plants, what, fmt_name, block_size=8, hkv=2, group=2):
    """:func:`check_masked_quant` for a static format: a max code planted, zeros as the zero code."""
    s = tk.make_step(reqs, hkv=hkv, group=group, dqk=16, dv=16, block_size=block_size)
    mk._extend_tables(s, plants, hkv, block_size)
    qs = QStep(s, fmt_of(fmt_name))
    zero_code = 128 if qs.fmt.code == "int8" else 0
    outs = {}
    for fill in (0xFF if qs.fmt.code == "int8" else MAX_CODE, zero_code):
        t = {"k": qs.kc.clone(), "v": qs.vc.clone()}
        pages = {n: t[n].view(-1, block_size, 16) for n in ("k", "v")}
        for p in plants:
            for h in range(hkv):
                page = mk._page(s, p.b, h, p.pos, hkv, block_size)
                pages["k"][page, p.pos % block_size] = zero_code
                pages["v"][page, p.pos % block_size] = zero_code
                pages[what][page, p.pos % block_size] = fill
        outs[fill] = qs.attend(kc=t["k"], vc=t["v"], scale=0.25).cpu()
    sees = mk._sees(s, plants, group, None, None)
    a, b = outs.values()
    assert torch.equal(a[~sees], b[~sees])


# ---------------------------------------------------------------------------- GPU: bf16, real shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_channel", "int8"])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (256, 256), (192, 128)])
def test_gpu_decode_and_mixed_bf16(fmt, dims):
    """bf16 q, realistic contexts: decode (split and not), a mixed batch, a sliding window."""
    dqk, dv = dims
    group = 1 if dims == (192, 128) else 4
    kw = dict(hkv=2, group=group, dqk=dqk, dv=dv, block_size=64, dtype=torch.bfloat16)
    decode = [(1000, 1), (37, 1), (513, 1), (4000, 1)]
    run_quant(decode, fmt, **kw)
    run_quant(decode, fmt, num_splits=8, **kw)
    run_quant([(100, 300), (0, 257), (700, 1), (64, 130)], fmt, **kw)
    run_quant(
        [(100, 300), (700, 1), (900, 1)], fmt, window_left=90, release=True, sink_kind="learnable", **kw
    )


@gpu
@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
def test_gpu_headwise_and_soft_cap_bf16():
    kw = dict(hkv=4, group=2, dqk=128, dv=128, block_size=64, dtype=torch.bfloat16)
    reqs = [(300, 40), (1200, 1), (70, 1)]
    run_quant(
        reqs, "block_wise_fp8", headwise=True, window_left=127, sliding_heads=(2, 4), release=True, **kw
    )
    run_quant(reqs, "block_wise_fp8", logits_soft_cap=30.0, sink_kind="off-by-one", **kw)


@gpu
@pytest.mark.gpu
def test_gpu_masked_nan_codes_and_scales():
    """On the GPU the code 0x7F is a real NaN."""
    reqs = [(0, 100), (60, 40), (300, 1)]
    plants = [mk.Plant(0, 50), mk.Plant(1, 90), mk.Plant(1, 120), mk.Plant(2, 301), mk.Plant(2, 20)]
    for what, bad in (("k", NAN_CODE), ("v", NAN_CODE), ("ks", float("nan")), ("vs", float("inf"))):
        check_masked_quant(reqs, plants, what, bad, block_size=16, window_left=200, dqk=64, dv=64)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_captures_a_quantized_decode():
    """A quantized decode (split-KV and not) captured in a CUDA graph replays on new contents: new q,
    new codes and scales in place, longer contexts (same shapes), as an eager run computes."""
    from fastdeploy_paddlefleet.kernels.launch.direct import LaunchStep
    from fastdeploy_paddlefleet.kernels.paged_attention import AttentionPlan

    reqs = [(700, 1), (33, 1), (2000, 1), (129, 1)]
    s = tk.make_step(reqs, hkv=2, group=4, dqk=128, dv=128, block_size=64, dtype=torch.bfloat16)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    plan = AttentionPlan(
        qs.kc, qs.vc, s.q, scale=0.088, kv_quant=qs.fmt, key_scale=qs.ks, value_scale=qs.vs
    )  # fmt: skip
    for splits in (1, 4):
        q, dec = s.q.clone(), s.dec.clone()
        step = LaunchStep(s.cu, dec, s.table, max_q_len=1, max_context_len=2100)
        out = torch.empty(q.shape[0], q.shape[1], 128, dtype=q.dtype, device=q.device)
        plan.run_step(q, step, out=out, num_splits=splits)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.run_step(q, step, out=out, num_splits=splits)
        q.copy_(torch.randn_like(q))
        dec.copy_(s.dec - 5)
        qs.ks.mul_(1.5)
        graph.replay()
        torch.cuda.synchronize()
        want = plan.run_step(
            q, LaunchStep(s.cu, dec, s.table, max_q_len=1, max_context_len=2100), num_splits=splits
        )
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@gpu
@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_gpu_direct_launches_equal_tritons_path(fmt, monkeypatch):
    """Kept kernels launched by addresses (``kernels/launch/``, the own launcher) compute bitwise what
    Triton's own launch path computes on a quantized cache: decode (split and not), a mixed batch."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    kw = dict(hkv=2, group=4, dqk=128, dv=128, block_size=64, dtype=torch.bfloat16)
    for reqs, splits in (
        ([(700, 1), (33, 1), (2000, 1)], None),
        ([(700, 1), (33, 1)], 4),
        ([(90, 70), (500, 1)], None),
    ):
        s = tk.make_step(reqs, **kw)
        qs = QStep(s, fmt_of(fmt))
        mq, mc = max(n for _, n in reqs), max(c + n for c, n in reqs)
        outs = []
        for direct in (True, False):
            monkeypatch.setattr(_launch, "DIRECT_LAUNCH", direct)
            for _ in range(3):  # compiled, kept, launched by addresses
                out = qs.attend(scale=0.09, max_q_len=mq, max_context_len=mc, num_splits=splits)
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), (fmt, reqs)


# ---------------------------------------------------------------------------- the triton backend


class _RecordedWrite:
    """Stands in for the quantized cache write (``kernels/cache_write.py``'s, another change): the
    step's codes are in the cache already (:class:`QStep`); records that the backend wrote, with what."""

    static_aligned = False

    def __init__(self, cache, headwise):
        self.cache, self.headwise, self.calls = cache, headwise, []

    def run_step(self, k, v, launch, stream=None):
        self.calls.append((k, v, launch))

    def launch_kept(self, *args):  # pragma: no cover - never reached: static_aligned is False
        return False


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_backend_attends_a_quantized_cache(fmt, monkeypatch):
    """``TritonBackend.forward`` with a ``QuantizedKVCache``: checked (host checks on), written through
    the write plan built from the cache whole, attended by the quantized kernels; the fused decode
    write stays off for it."""
    from fastdeploy_paddlefleet.backends import triton as tb
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache

    writes = []

    def fake_write_plan(cache, headwise):
        assert isinstance(cache, QuantizedKVCache) and cache.quant.name == fmt_of(fmt).name
        writes.append(_RecordedWrite(cache, headwise))
        return writes[-1]

    monkeypatch.setattr(tb, "_write_plan", fake_write_plan)
    monkeypatch.setenv("FDFLEET_FUSED_DECODE_WRITE", "1")
    layer = tk._layer(2, 4, 32, 16, kind="headwise", window=3, sliding=(1, 2), sink="learnable")
    for reqs in ([(9, 4), (20, 1)], [(9, 1), (20, 1)]):
        s = tk.make_step(
            reqs, hkv=2, group=4, dqk=32, dv=16, block_size=8, headwise=True, window_left=3,
            sliding_heads=(1, 2), release=True,
        )  # fmt: skip
        qs = QStep(s, fmt_of(fmt))
        sinks = torch.randn(8, device=DEVICE)
        cache = QuantizedKVCache(qs.kc, qs.vc, qs.ks, qs.vs, qs.fmt)
        out = tb.TritonBackend().forward(s.q, s.k, s.v, layer, tk._meta(s, 8, as_mapping=True), cache, sinks)
        assert writes[-1].calls and writes[-1].calls[-1][0] is s.k
        qs.check(
            out.view(s.q.shape[0], 8, 16), scale=layer.softmax_scale, sinks=sinks, window_left=3,
            sliding_heads=(1, 2), sink_kind="learnable",
        )  # fmt: skip


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "int8"])
def test_backend_writes_by_fastdeploys_rule_then_attends(fmt):
    """The Triton backend end to end on a quantized cache: this step's K/V land in the cache as
    FastDeploy's rule writes them (bytes and scales against the numpy transcription in
    ``test_kv_quant_rule.py``), and the output is the dense attention over the dequantized cache."""
    import numpy as np
    import test_kv_quant_rule as rule

    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache
    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    layer = tk._layer(2, 2, 16, 16)
    s = tk.make_step([(5, 3), (12, 1), (0, 4)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    qs = QStep(s, fmt_of(fmt), write=False)  # the history quantized; this step's slots not yet
    cache = QuantizedKVCache(qs.kc, qs.vc, qs.ks, qs.vs, qs.fmt)
    out = TritonBackend().forward(s.q, s.k, s.v, layer, tk._meta(s, 8), cache)
    dtype = {torch.float32: "float32", torch.float16: "float16"}[s.q.dtype]
    for b, (ctx, n) in enumerate(s.reqs):
        lo = int(s.cu[b])
        for i in range(n):
            pos = ctx + i
            blk, slot = int(s.table[b, pos // 8]), pos % 8
            for x, codes, scales in ((s.k, qs.kc, qs.ks), (s.v, qs.vc, qs.vs)):
                rows = x[lo + i].detach().cpu().float().numpy()  # [Hkv, D]
                got = codes[blk, :, slot].cpu().numpy()
                if fmt == "block_wise_fp8":
                    want, want_s = rule.expected_block_wise(rows, dtype)
                    assert rule._same_scales(scales[blk, :, slot].cpu().float().numpy(), want_s)
                else:  # static int8: FastDeploy's codes at the quant multiplier 1 / scale
                    c = (1.0 / scales.cpu().double()).float().numpy().reshape(2, 16)
                    want = rule.fd_static(rows, c, dtype, fp8=False)
                np.testing.assert_array_equal(got, want)
    qs.deq_k = dequantize_cache(qs.kc, qs.ks, qs.fmt, qs.heads)
    qs.deq_v = dequantize_cache(qs.vc, qs.vs, qs.fmt, qs.heads)
    qs.check(out.view(s.q.shape[0], 4, 16), scale=layer.softmax_scale)


def test_backend_refuses_float_codes_in_a_quantized_cache():
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache
    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    layer = tk._layer(2, 2, 16, 16)
    s = tk.make_step([(3, 1)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    qs = QStep(s, fmt_of("block_wise_fp8"))
    cache = QuantizedKVCache(s.key_cache, s.value_cache, qs.ks, qs.vs, qs.fmt)
    with pytest.raises(TypeError, match="uint8 codes"):
        TritonBackend().forward(s.q, s.k, s.v, layer, tk._meta(s, 8), cache)
