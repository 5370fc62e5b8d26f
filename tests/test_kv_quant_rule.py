"""Quantized KV cache writes against a numpy transcription of FastDeploy's rule (docs/kv_quant.md).

The transcription is written from FastDeploy's CUDA source (develop c1b7c083d), not from our code:

* ``custom_ops/gpu_ops/append_attn/decoder_write_cache_with_rope_impl.cuh:1113-1141`` (decode) and
  ``encoder_write_cache_with_rope_impl.cuh:1629-1687`` (prefill): ``local_max`` = ``__hmax`` of
  ``__habs`` over the token-head's values, starting at ``-INFINITY`` (``__hmax`` drops a NaN
  operand: cuda_fp16.h, "If either of inputs is NaN, the other input is returned"); the quant
  multiplier ``scale = __hdiv(448, local_max)`` in ``T``; the cache's scale ``__hdiv(1, scale)``.
* ``utils.cuh:547-581`` ``QuantToC8``: ``float(scale * value)`` (the product in ``T``),
  ``roundWithTiesToEven`` (``utils.cuh:533-545``), clamp to +-448 then ``__nv_fp8_e4m3`` (round to
  nearest even), or for int8 clamp to +-127 and store ``q + 128``.
* static formats (``..._impl.cuh:1628-1723``): the same ``QuantToC8`` with the layer's
  ``cache_k_scale`` (``model_executor/layers/quantization/kv_cache.py:159``: ``max_bound / s``; the
  v1 loader's ``layers/attention/attention.py:247-251``: ``max_bound / s`` of ``s`` cast to ``T``),
  a ``T`` value of its own: not ``T(1 / cache_k_out_scale)``, which is one ulp off for about a
  quarter of the scales (the ``*_ulp_*`` cases below are such scales only).

Division is modelled correctly rounded (FastDeploy's ``__hdiv`` is an fp32 approximation rounded to
``T``; NVIDIA documents the bf16 one as correctly rounded, the fp16 one may differ by an ulp in rare
cases: checked on the GPU, not here). Bytes and scales must match exactly; the rows where
FastDeploy's result is not finite follow our documented deviation.
"""

from __future__ import annotations

import numpy as np
import pytest

try:  # fp8 / bf16 casts of the transcription: ml_dtypes, else torch's CPU casts (the GPU machine)
    import ml_dtypes
except ImportError:
    ml_dtypes = None
    pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fastdeploy_paddlefleet.kernels.kv_quant import dequant  # noqa: E402
from fastdeploy_paddlefleet.kvcache.quant import FORMATS  # noqa: E402


def _t(x, dtype):
    """numpy ``x`` rounded once to the model dtype (nearest even), as fp32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "bfloat16" and ml_dtypes is None:
        import torch

        return torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype) or ml_dtypes.bfloat16
    with np.errstate(all="ignore"):
        return x.astype(np_dtype).astype(np.float32)


def _to_e4m3(q: np.ndarray) -> np.ndarray:
    """Bytes of fp32 ``q`` (within +-448 or NaN) as e4m3fn, round to nearest even."""
    if ml_dtypes is None:
        import torch

        return (
            torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
            .to(torch.float8_e4m3fn)
            .view(torch.uint8)
            .numpy()
        )
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fd_codes(y: np.ndarray, fp8: bool) -> np.ndarray:
    """``QuantToC8`` after the product (utils.cuh:555-578): ``y`` fp32 -> uint8 codes."""
    with np.errstate(all="ignore"):
        q = np.rint(y)  # roundWithTiesToEven; inf and NaN pass through
        bound = 448.0 if fp8 else 127.0
        q = np.where(q > bound, bound, np.where(q < -bound, -bound, q))  # a NaN fails both: kept
        if fp8:
            return _to_e4m3(q)
        return np.where(np.isnan(q), 0, q + 128.0).astype(np.uint8)  # NaN: CUDA's cvt gives 0


def fd_block_wise(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """FastDeploy's block_wise_fp8 of rows ``x [N, D]`` (values of ``dtype``): codes, stored scales."""
    with np.errstate(all="ignore"):
        local_max = np.fmax.reduce(np.abs(x), axis=1, initial=-np.inf)  # __hmax drops NaN
        scale = _t(np.float32(448.0) / local_max, dtype)
        stored = _t(np.float32(1.0) / scale, dtype)
        return fd_codes(_t(scale[:, None] * x, dtype), True), stored


def fd_static(x: np.ndarray, c: np.ndarray, dtype: str, fp8: bool) -> np.ndarray:
    """FastDeploy's static fp8 / int8 of ``x [N, D]`` at quant multipliers ``c`` (broadcast)."""
    with np.errstate(all="ignore"):
        return fd_codes(_t(c * x, dtype), fp8)


def e4m3(codes: np.ndarray) -> np.ndarray:
    """fp32 values of e4m3fn bytes."""
    if ml_dtypes is None:
        import torch

        return torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).float().numpy()
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def expected_block_wise(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Our rule: FastDeploy's bytes and scales where its result is finite; codes 0 and scale 0 where
    its quant multiplier overflows (all zero, or too small a maximum for the dtype); codes 0 and scale
    NaN for a row holding a NaN or an infinity. Also checks the claims about FastDeploy's output."""
    codes, stored = fd_block_wise(x, dtype)
    finite_in = np.isfinite(x).all(axis=1)
    with np.errstate(all="ignore"):
        overflow = finite_in & ~np.isfinite(_t(np.float32(448.0) / np.abs(x).max(axis=1), dtype))
        fd_values = e4m3(codes) * stored[:, None]
    # FastDeploy on those rows: every value 0 or NaN (NaN for each zero element): nothing to keep
    assert np.all(np.isnan(fd_values[overflow]) | (fd_values[overflow] == 0))
    assert np.all(np.isnan(fd_values[overflow][x[overflow] == 0]))
    # and a non-finite input leaves NaN at least where it was
    assert np.all(np.isnan(fd_values[~finite_in][~np.isfinite(x[~finite_in])]))
    codes = np.where((overflow | ~finite_in)[:, None], 0, codes).astype(np.uint8)
    stored = np.where(overflow, 0.0, np.where(finite_in, stored, np.nan)).astype(np.float32)
    return codes, stored


def rows_for(dtype: str, d: int, seed: int) -> np.ndarray:
    """Rows that cover the rule's cases: random, constant, tiny, subnormal, huge, saturating, mixed,
    zero, negative zero, partly zero."""
    rng = np.random.default_rng(seed)
    tiny = {"float32": 1e-40, "float16": 1e-7, "bfloat16": 1e-40}[dtype]
    huge = {"float32": 3e37, "float16": 6e4, "bfloat16": 3e37}[dtype]
    rows = [
        rng.standard_normal(d),
        rng.standard_normal(d) * 1e-3,
        np.full(d, 0.7),
        np.full(d, -3.0),
        rng.standard_normal(d) * 1e-6,
        rng.standard_normal(d) * tiny,
        rng.standard_normal(d) * 1e4,
        rng.standard_normal(d) * huge / 4,
        np.linspace(-1.0, 1.0, d) * 448.0,  # integers and halves near the e4m3 ties
        np.concatenate([[huge / 8], rng.standard_normal(d - 1) * 1e-2]),  # mixed: most codes 0
        np.zeros(d),
        -np.zeros(d),
        np.where(np.arange(d) % 2, 0.0, rng.standard_normal(d)),
        np.round(rng.standard_normal(d) * 300) / 7,
    ]
    if dtype == "float16":
        rows.append(rng.standard_normal(d) * 1e-3)  # max|x| below 448 / 65504: FastDeploy's scale overflows
        rows.append(np.full(d, 6e4))
    return _t(np.stack(rows), dtype)


def nonfinite_rows(dtype: str, d: int) -> np.ndarray:
    base = np.linspace(-2.0, 2.0, d)
    rows = []
    for bad in (np.nan, np.inf, -np.inf):
        r = base.copy()
        r[d // 3] = bad
        rows.append(r)
    rows.append(np.full(d, np.nan))
    return _t(np.stack(rows), dtype)


def static_case(fmt: str, x: np.ndarray, hkv: int, d: int, dtype: str, seed: int):
    """Dequant multipliers (the cache's scales) and FastDeploy's quant multipliers per row ``[N, 1]``
    or ``[N, D]``: the scales are chosen where ``T(1 / T(1 / c)) == c`` (``docs/kv_quant.md``)."""
    rng = np.random.default_rng(seed)
    channel = FORMATS[fmt].channel_wise
    n = hkv * d if channel else hkv
    c = _t(np.exp(rng.uniform(-3, 5, 4 * n)), dtype)
    with np.errstate(all="ignore"):
        d_scale = _t(np.float32(1.0) / c, dtype)
        keep = _t(np.float32(1.0) / d_scale, dtype) == c
    c, d_scale = c[keep][:n], d_scale[keep][:n]
    heads = np.arange(x.shape[0]) % hkv
    per_row = c.reshape(hkv, d)[heads] if channel else c[heads][:, None]
    return d_scale, per_row


def fd_multipliers(s: np.ndarray, bound: float, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """FastDeploy's loader on checkpoint scales ``s`` (``kv_cache.py`` ``load_scale``,
    ``attention.py:247-251``): ``s`` cast to ``T``, the quant multiplier ``T(bound / s)`` and the dequant
    multiplier ``T(s / bound)``, each a correctly rounded quotient (``docs/kv_quant.md``)."""
    s = _t(s, dtype).astype(np.float64)
    with np.errstate(all="ignore"):
        return _t(bound / s, dtype), _t(s / bound, dtype)


def ulp_static_case(fmt, hkv: int, d: int, dtype: str, seed: int):
    """Checkpoint scales whose quant multiplier ``c = T(B / s)`` is NOT ``T(1 / T(s / B))`` (one ulp of
    ``T`` apart), every one of them: ``(s, dequant [S], quant multipliers [S], per row quant [N, *],
    per row T(1 / dequant))`` as in :func:`static_case` (``fmt``: a format or its name)."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    rng = np.random.default_rng(seed)
    n = hkv * d if fmt.channel_wise else hkv
    s = _t(np.exp(rng.uniform(-3, 6, 16 * n)), dtype)
    c, dq = fd_multipliers(s, fmt.max_bound, dtype)
    with np.errstate(all="ignore"):
        alt = _t(np.float32(1.0) / dq, dtype)
    off = alt != c
    assert off.sum() >= n, f"only {off.sum()} of {s.size} {dtype} scales differ"
    s, c, dq, alt = s[off][:n], c[off][:n], dq[off][:n], alt[off][:n]
    return s, dq, c, alt


def boundary_rows(c: np.ndarray, alt: np.ndarray, d: int, dtype: str, seed: int) -> np.ndarray:
    """Values ``x [N, d]`` (of ``dtype``) at which ``c * x`` and ``alt * x`` (``[N, 1]`` or ``[N, d]``)
    lie on either side of a rounding midpoint ``q + 1/2`` (``q`` in 1..14: integer e4m3 codes, int8
    alike), nudged by a few ulps so some land on each side: bytes tell the two multipliers apart."""
    rng = np.random.default_rng(seed)
    shape = (c.shape[0], d)
    q = rng.integers(1, 15, shape) + 0.5
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    mid = (c.astype(np.float64) + alt.astype(np.float64)) / 2
    x = _t(sign * q / mid, dtype)
    nudge = rng.integers(-2, 3, shape)
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:  # bf16: step by its ulp (8 significant bits)
        ulp = 2.0 ** (np.floor(np.log2(np.abs(x))) - 7)
        return _t(x + nudge * ulp, dtype)
    y = x.astype(np_dtype)
    for _ in range(2):
        y = np.where(
            nudge > 0,
            np.nextafter(y, np_dtype(np.inf)),
            np.where(nudge < 0, np.nextafter(y, -np_dtype(np.inf)), y),
        )
        nudge = nudge - np.sign(nudge)
    return y.astype(np.float32)


# ---------------------------------------------------------------- Triton write (interpreter / GPU)


def _torch():
    return pytest.importorskip("torch")


def _dev() -> str:
    """The kernels' device: CUDA where there is one, else the CPU (TRITON_INTERPRET, tests/conftest.py)."""
    return "cuda" if _torch().cuda.is_available() else "cpu"


def _run_triton_write(
    x_k, x_v, fmt_name, dtype, hkv, bs, key_scale=None, value_scale=None, key_mult=None, value_mult=None
):
    """Write rows ``[T * hkv, D]`` (token-major) through write_quantized_kv_cache; return the codes and
    scales at each row's slot (``[T * hkv, D]``, ``[T * hkv]``). ``key_mult`` / ``value_mult``: a static
    cache's quant multipliers (``QuantizedKVCache.key_quant_scale``)."""
    torch = _torch()
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache
    from fastdeploy_paddlefleet.kernels.cache_write import write_quantized_kv_cache

    tdt = getattr(torch, dtype)
    n, dk = x_k.shape
    dv = x_v.shape[1]
    t = n // hkv
    nb = (t + bs - 1) // bs + 1
    fmt = FORMATS[fmt_name] if isinstance(fmt_name, str) else fmt_name
    k = torch.from_numpy(x_k).to(tdt).reshape(t, hkv, dk)
    v = torch.from_numpy(x_v).to(tdt).reshape(t, hkv, dv)
    kc = torch.full((nb, hkv, bs, dk), 0xAB, dtype=torch.uint8)
    vc = torch.full((nb, hkv, bs, dv), 0xAB, dtype=torch.uint8)
    if fmt.dynamic:
        ks = torch.full((nb, hkv, bs), 7.0, dtype=tdt)
        vs = torch.full((nb, hkv, bs), 7.0, dtype=tdt)
    else:
        ks, vs = (torch.from_numpy(s).to(tdt) for s in (key_scale, value_scale))
    blocks = np.random.default_rng(t).permutation(nb)[: (t + bs - 1) // bs]
    tables = torch.tensor(blocks[None, :], dtype=torch.int32)
    bid = torch.zeros(t, dtype=torch.int32)
    cu = torch.tensor([0, t], dtype=torch.int32)
    dec = torch.tensor([0], dtype=torch.int32)
    dev = _dev()
    k, v, kc, vc, ks, vs, bid, cu, dec, tables = (
        x.to(dev) for x in (k, v, kc, vc, ks, vs, bid, cu, dec, tables)
    )
    mults = ()
    if key_mult is not None:
        mults = tuple(torch.from_numpy(m).to(tdt).to(dev) for m in (key_mult, value_mult))
    write_quantized_kv_cache(k, v, QuantizedKVCache(kc, vc, ks, vs, fmt, *mults), bid, cu, dec, tables)
    kc, vc, ks, vs = (x.cpu() for x in (kc, vc, ks, vs))
    pos = np.arange(t)
    blk, slot = blocks[pos // bs], pos % bs
    out = []
    for c, s in ((kc, ks), (vc, vs)):
        codes = c[blk, :, slot].reshape(n, -1).numpy()
        scales = s[blk, :, slot].reshape(n).float().numpy() if fmt.dynamic else None
        out.append((codes, scales))
    return out


def _same_scales(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal values (NaN where NaN) and equal signs."""
    both = ~np.isnan(want)
    return np.array_equal(got, want, equal_nan=True) and np.array_equal(
        np.signbit(got[both]), np.signbit(want[both])
    )


DIMS = [64, 128, 192, 256]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("d", DIMS)
def test_triton_block_wise_fp8_matches_fastdeploy(dtype, d):
    hkv, bs = 2, 16 if d % 128 else 64
    x = np.concatenate([rows_for(dtype, d, d), nonfinite_rows(dtype, d)])
    x = np.concatenate([x, x[: (-len(x)) % hkv]]) if len(x) % hkv else x
    xv = x[::-1].copy()
    (kc, ks), (vc, vs) = _run_triton_write(x, xv, "block_wise_fp8", dtype, hkv, bs)
    for got_c, got_s, rows in ((kc, ks, x), (vc, vs, xv)):
        want_c, want_s = expected_block_wise(rows, dtype)
        bad = np.nonzero((got_c != want_c).any(axis=1))[0]
        assert bad.size == 0, f"rows {bad[:5]}: codes {got_c[bad[0]][:8]} want {want_c[bad[0]][:8]}"
        assert _same_scales(got_s, want_s), (got_s, want_s)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("d", [64, 192])
def test_triton_static_formats_match_fastdeploy(dtype, fmt, d):
    hkv, bs = 2, 16
    x = np.concatenate([rows_for(dtype, d, d + 1), nonfinite_rows(dtype, d)])
    x = x[: len(x) // hkv * hkv]
    ks, per_row = static_case(fmt, x, hkv, d, dtype, 1)
    vs, per_row_v = static_case(fmt, x, hkv, d, dtype, 2)
    (kc, _), (vc, _) = _run_triton_write(x, x, fmt, dtype, hkv, bs, ks, vs)
    fp8 = fmt != "int8"
    assert np.array_equal(kc, fd_static(x, per_row, dtype, fp8))
    assert np.array_equal(vc, fd_static(x, per_row_v, dtype, fp8))


def test_static_fp8_per_channel_matches_fastdeploy():
    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    fmt = kv_cache_quant("float8_e4m3fn", channel_wise=True)
    d, hkv, dtype = 64, 2, "float16"
    x = rows_for(dtype, d, 5)
    x = x[: len(x) // hkv * hkv]
    ks, per_row = static_case("int8", x, hkv, d, dtype, 3)  # int8's per-channel layout
    torch = _torch()
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache
    from fastdeploy_paddlefleet.kernels.cache_write import write_quantized_kv_cache

    t = len(x) // hkv
    k = torch.from_numpy(x).half().reshape(t, hkv, d)
    kc = torch.zeros((1, hkv, 64, d), dtype=torch.uint8)
    vc = torch.zeros_like(kc)
    s = torch.from_numpy(ks).half()
    args = (torch.zeros(t, dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32))
    dev = _dev()
    k, kc, vc, s = (x.to(dev) for x in (k, kc, vc, s))
    args = tuple(a.to(dev) for a in args)
    cache = QuantizedKVCache(kc, vc, s, s.clone(), fmt)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    write_quantized_kv_cache(k, k, cache, *args, torch.tensor([0], dtype=torch.int32, device=dev), tables)
    got = kc.cpu()[0, :, :t].transpose(0, 1).reshape(-1, d).numpy()
    assert np.array_equal(got, fd_static(x, per_row, dtype, True))


STATIC_ULP = [("float8_e4m3fn", False), ("float8_e4m3fn", True), ("int8", True)]


def _ulp_rows(fmt, hkv: int, d: int, dtype: str, seed: int):
    """Per K and V: rows mixing :func:`rows_for` and :func:`boundary_rows` for the scales of
    :func:`ulp_static_case`: ``((xk, xv), [(dequant, quant multipliers, per row c, per row
    T(1 / dequant))] * 2)``."""
    cases = []
    for which in (0, 1):
        _, dq, c, alt = ulp_static_case(fmt, hkv, d, dtype, seed + which)
        cases.append((dq, c, c, alt))
    t_rows = 48
    heads = np.arange(t_rows * hkv) % hkv
    out = []
    for dq, c, _, alt in cases:
        per_c = c.reshape(hkv, d)[heads] if fmt.channel_wise else c[heads][:, None]
        per_a = alt.reshape(hkv, d)[heads] if fmt.channel_wise else alt[heads][:, None]
        out.append((dq, c, per_c, per_a))
    xs = []
    for i, (_, _, per_c, per_a) in enumerate(out):
        x = boundary_rows(per_c, per_a, d, dtype, seed + i)
        extra = rows_for(dtype, d, seed)[: 2 * hkv]
        x[: len(extra)] = extra
        xs.append(x)
    return tuple(xs), out


def _static_fmt(name: str, channel: bool):
    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    return kv_cache_quant(name, channel_wise=channel) if name == "float8_e4m3fn" else FORMATS[name]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt_name, channel", STATIC_ULP)
def test_triton_static_ulp_scales_write_fastdeploys_bytes(dtype, fmt_name, channel):
    """Scales where ``T(1 / dequant)`` is one ulp off FastDeploy's ``cache_k_scale``: with the quant
    multipliers carried, the bytes are FastDeploy's (``QuantToC8`` at ``c``); the inputs are chosen
    so that ``T(1 / dequant)`` would write other bytes (checked on the transcription)."""
    fmt = _static_fmt(fmt_name, channel)
    hkv, d, bs = 2, 64, 16
    (x, xv), ((kdq, kc_, k_row, k_alt), (vdq, vc_, v_row, v_alt)) = _ulp_rows(fmt, hkv, d, dtype, 11)
    fp8 = fmt.code == "fp8"
    for want_rows, alt_rows, rows in ((k_row, k_alt, x), (v_row, v_alt, xv)):
        assert not np.array_equal(
            fd_static(rows, want_rows, dtype, fp8), fd_static(rows, alt_rows, dtype, fp8)
        )
    (kc, _), (vc, _) = _run_triton_write(x, xv, fmt, dtype, hkv, bs, kdq, vdq, kc_, vc_)
    assert np.array_equal(kc, fd_static(x, k_row, dtype, fp8))
    assert np.array_equal(vc, fd_static(xv, v_row, dtype, fp8))
    # without the multipliers the write keeps its documented T(1 / dequant): other bytes
    (kc_old, _), _ = _run_triton_write(x, xv, fmt, dtype, hkv, bs, kdq, vdq)
    assert np.array_equal(kc_old, fd_static(x, k_alt, dtype, fp8))


def test_triton_dequant_reads_every_code():
    """The dequant helper against ml_dtypes' e4m3fn for all 256 bytes (NaN bytes read as NaN), and
    ``byte - 128`` for int8 (byte 0: NaN)."""
    torch = _torch()
    dev = _dev()
    c = torch.arange(256, dtype=torch.int32, device=dev).to(torch.uint8)
    o8, oi = torch.zeros(256, device=dev), torch.zeros(256, device=dev)
    _dequant_all_kernel[(1,)](c, o8, oi)
    o8, oi = o8.cpu(), oi.cpu()
    want8 = e4m3(np.arange(256, dtype=np.uint8)) * 0.5
    wanti = np.where(np.arange(256) == 0, np.nan, (np.arange(256) - 128.0) * 0.5)
    assert np.array_equal(o8.numpy(), want8, equal_nan=True)
    assert np.array_equal(oi.numpy(), wanti.astype(np.float32), equal_nan=True)


@triton.jit
def _dequant_all_kernel(C, O8, OI):
    o = tl.arange(0, 256)
    c = tl.load(C + o)
    tl.store(O8 + o, dequant(c, 0.5, True))
    tl.store(OI + o, dequant(c, 0.5, False))


# ---------------------------------------------------------------- reference backend (paddle)


def _layer(hkv: int, group: int, dqk: int, dv: int, kind: str = "full", window: int | None = None):
    import math

    from fastdeploy_paddlefleet.plan.layer import LayerAttention

    return LayerAttention(
        index=0,
        kind=kind,
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        qk_head_dim=dqk,
        v_head_dim=dv,
        softmax_scale=1.0 / math.sqrt(dqk),
        window_left=window,
        sliding_kv_heads=None if kind == "full" else (hkv - 1, hkv) if kind == "headwise" else (0, hkv),
    )


def _reference_step(layer, q, k, v, cache, bs, dec: int = 0):
    """One request, one step of ``T`` tokens after ``dec`` cached ones, through ReferenceBackend."""
    import paddle

    from fastdeploy_paddlefleet.backends.base import BatchMeta
    from fastdeploy_paddlefleet.backends.reference import ReferenceBackend

    t = k.shape[0]
    nb = int(cache.key.shape[0])
    i32 = lambda a: paddle.to_tensor(np.asarray(a, dtype=np.int32))  # noqa: E731
    meta = BatchMeta(
        seq_lens_encoder=i32([t if dec == 0 else 0]),
        seq_lens_decoder=i32([dec]),
        seq_lens_this_time=i32([t]),
        cu_seqlens_q=i32([0, t]),
        batch_id_per_token=i32(np.zeros(t)),
        block_tables=i32(np.arange(nb)[::-1][None, :].copy()),
        block_size=bs,
    )
    return ReferenceBackend().forward(q, k, v, layer, meta, cache)


def _paddle_cache(
    fmt_name, nb: int, hkv: int, bs: int, dqk: int, dv: int, dtype: str, ks=None, vs=None, km=None, vm=None
):
    import paddle

    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache

    fmt = FORMATS[fmt_name] if isinstance(fmt_name, str) else fmt_name
    kc = paddle.full([nb, hkv, bs, dqk], 0xAB, dtype="uint8")
    vc = paddle.full([nb, hkv, bs, dv], 0xAB, dtype="uint8")
    if fmt.dynamic:
        ks = paddle.full([nb, hkv, bs], 7.0, dtype=dtype)
        vs = paddle.full([nb, hkv, bs], 7.0, dtype=dtype)
    else:
        ks, vs = (paddle.to_tensor(s.astype(np.float32)).astype(dtype) for s in (ks, vs))
    mults = ()
    if km is not None:
        mults = tuple(paddle.to_tensor(m.astype(np.float32)).astype(dtype) for m in (km, vm))
    return QuantizedKVCache(kc, vc, ks, vs, fmt, *mults)


def _slots(cache, t: int, bs: int, hkv: int):
    """Codes ``[T * Hkv, D]`` and scales of positions ``0..T-1`` (block table ``nb-1, nb-2, ...``)."""
    nb = int(cache.key.shape[0])
    pos = np.arange(t)
    blk, slot = nb - 1 - pos // bs, pos % bs
    out = []
    for c, s in ((cache.key, cache.key_scale), (cache.value, cache.value_scale)):
        codes = c.numpy()[blk, :, slot].reshape(t * hkv, -1)
        scales = s.astype("float32").numpy()[blk, :, slot].reshape(-1) if cache.quant.dynamic else None
        out.append((codes, scales))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("d", DIMS)
def test_reference_block_wise_fp8_matches_fastdeploy(dtype, d):
    paddle = pytest.importorskip("paddle")
    hkv, bs = 2, 16 if d % 128 else 64
    x = np.concatenate([rows_for(dtype, d, d), nonfinite_rows(dtype, d)])
    x = x[: len(x) // hkv * hkv]
    xv = x[::-1].copy()
    t = len(x) // hkv
    cache = _paddle_cache("block_wise_fp8", t // bs + 2, hkv, bs, d, d, dtype)
    layer = _layer(hkv, 1, d, d)
    to = lambda a: paddle.to_tensor(a.reshape(t, hkv, d)).astype(dtype)  # noqa: E731
    _reference_step(layer, to(np.zeros_like(x)), to(x), to(xv), cache, bs)
    for (got_c, got_s), rows in zip(_slots(cache, t, bs, hkv), (x, xv), strict=True):
        want_c, want_s = expected_block_wise(rows, dtype)
        bad = np.nonzero((got_c != want_c).any(axis=1))[0]
        assert bad.size == 0, f"rows {bad[:5]}: codes {got_c[bad[0]][:8]} want {want_c[bad[0]][:8]}"
        assert _same_scales(got_s, want_s), (got_s, want_s)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
def test_reference_static_formats_match_fastdeploy(dtype, fmt):
    paddle = pytest.importorskip("paddle")
    hkv, bs, d = 2, 16, 64
    x = np.concatenate([rows_for(dtype, d, 3), nonfinite_rows(dtype, d)])
    x = x[: len(x) // hkv * hkv]
    t = len(x) // hkv
    ks, per_row = static_case(fmt, x, hkv, d, dtype, 1)
    vs, per_row_v = static_case(fmt, x, hkv, d, dtype, 2)
    cache = _paddle_cache(fmt, t // bs + 2, hkv, bs, d, d, dtype, ks, vs)
    to = lambda a: paddle.to_tensor(a.reshape(t, hkv, d)).astype(dtype)  # noqa: E731
    _reference_step(_layer(hkv, 1, d, d), to(np.zeros_like(x)), to(x), to(x), cache, bs)
    (kc, _), (vc, _) = _slots(cache, t, bs, hkv)
    assert np.array_equal(kc, fd_static(x, per_row, dtype, fmt != "int8"))
    assert np.array_equal(vc, fd_static(x, per_row_v, dtype, fmt != "int8"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt_name, channel", STATIC_ULP)
def test_reference_static_ulp_scales_write_fastdeploys_bytes(dtype, fmt_name, channel):
    """The reference backend on the scales and inputs of the Triton case above (bf16 too)."""
    paddle = pytest.importorskip("paddle")
    fmt = _static_fmt(fmt_name, channel)
    hkv, d, bs = 2, 64, 16
    (x, xv), ((kdq, kc_, k_row, k_alt), (vdq, vc_, v_row, v_alt)) = _ulp_rows(fmt, hkv, d, dtype, 12)
    fp8 = fmt.code == "fp8"
    t = len(x) // hkv
    assert not np.array_equal(fd_static(x, k_row, dtype, fp8), fd_static(x, k_alt, dtype, fp8))
    to = lambda a: paddle.to_tensor(a.reshape(t, hkv, d)).astype(dtype)  # noqa: E731
    for mults, want in (((kc_, vc_), (k_row, v_row)), ((None, None), (k_alt, v_alt))):
        cache = _paddle_cache(fmt, t // bs + 2, hkv, bs, d, d, dtype, kdq, vdq, *mults)
        _reference_step(_layer(hkv, 1, d, d), to(np.zeros_like(x)), to(x), to(xv), cache, bs)
        (kc, _), (vc, _) = _slots(cache, t, bs, hkv)
        assert np.array_equal(kc, fd_static(x, want[0], dtype, fp8))
        assert np.array_equal(vc, fd_static(xv, want[1], dtype, fp8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt_name", ["float8_e4m3fn", "int8"])
def test_static_scales_loader_keeps_fastdeploys_quant_multipliers(dtype, fmt_name):
    """``serving/kv_scales.py``: the checkpoint's ``activation_scale`` becomes FastDeploy's dequant
    multiplier ``T(s / B)`` and its quant multiplier ``T(B / s)`` (numpy transcription of its loader),
    on scales where ``T(1 / dequant)`` is not the latter; ``layer_caches`` hands both to the cache."""
    paddle = pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.serving.cache_views import quantized_layer_cache_views
    from fastdeploy_paddlefleet.serving.kv_scales import StaticKVScales

    fmt = FORMATS[fmt_name]
    hkv, d = 2, 64
    layer = _layer(hkv, 1, d, d)
    s_k, dq_k, c_k, alt_k = ulp_static_case(fmt, hkv, d, dtype, 21)
    s_v, dq_v, c_v, _ = ulp_static_case(fmt, hkv, d, dtype, 22)
    scales = StaticKVScales({0: "layers.0.self_attn"}, fmt)
    raw = {
        "model.layers.0.self_attn.cachek_matmul.activation_scale": paddle.to_tensor(s_k),
        "model.layers.0.self_attn.cachev_matmul.activation_scale": paddle.to_tensor(s_v),
    }
    assert scales.take(raw) == 2
    scales.finish([layer], dtype)
    got = [x.astype("float32").numpy() for x in (*scales[0], *scales.quant_multipliers(0))]
    assert all(str(x.dtype).endswith(dtype) for x in (*scales[0], *scales.quant_multipliers(0)))
    for g, want in zip(got, (dq_k, dq_v, c_k, c_v), strict=True):
        assert np.array_equal(g, want), (g[:4], want[:4])
    assert not np.array_equal(got[2], alt_k)
    caches = [paddle.zeros([2, hkv, 16, d], dtype="uint8"), paddle.zeros([2, hkv, 16, d], dtype="uint8")]
    (cache,) = quantized_layer_cache_views(caches, [layer], fmt, scales)
    assert cache.key_quant_scale is scales.quant_multipliers(0)[0]
    assert cache.value_quant_scale is scales.quant_multipliers(0)[1]
    assert cache.key_scale is scales[0][0]


@pytest.mark.parametrize("fmt_name, channel", STATIC_ULP)
def test_triton_backend_static_ulp_scales_write_fastdeploys_bytes(fmt_name, channel):
    """``TritonBackend.forward`` on a paddle ``QuantizedKVCache`` carrying the quant multipliers (the
    serving path: paddle tensors viewed as torch): FastDeploy's bytes, as the reference's above."""
    paddle = pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.backends.base import BatchMeta
    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    fmt = _static_fmt(fmt_name, channel)
    hkv, d, bs, dtype = 2, 64, 16, "float16"
    (x, xv), ((kdq, kc_, k_row, _), (vdq, vc_, v_row, _)) = _ulp_rows(fmt, hkv, d, dtype, 13)
    t = len(x) // hkv
    cache = _paddle_cache(fmt, t // bs + 2, hkv, bs, d, d, dtype, kdq, vdq, kc_, vc_)
    to = lambda a: paddle.to_tensor(a.reshape(t, hkv, d)).astype(dtype)  # noqa: E731
    i32 = lambda a: paddle.to_tensor(np.asarray(a, dtype=np.int32))  # noqa: E731
    nb = int(cache.key.shape[0])
    meta = BatchMeta(
        seq_lens_encoder=i32([t]),
        seq_lens_decoder=i32([0]),
        seq_lens_this_time=i32([t]),
        cu_seqlens_q=i32([0, t]),
        batch_id_per_token=i32(np.zeros(t)),
        block_tables=i32(np.arange(nb)[::-1][None, :].copy()),
        block_size=bs,
    )
    TritonBackend().forward(to(np.zeros_like(x)), to(x), to(xv), _layer(hkv, 1, d, d), meta, cache)
    (kc, _), (vc, _) = _slots(cache, t, bs, hkv)
    fp8 = fmt.code == "fp8"
    assert np.array_equal(kc, fd_static(x, k_row, dtype, fp8))
    assert np.array_equal(vc, fd_static(xv, v_row, dtype, fp8))


def _dequant_np(codes: np.ndarray, scales: np.ndarray, fp8: bool) -> np.ndarray:
    """fp64 values of codes at dequant multipliers (broadcast), by ml_dtypes / ``byte - 128``."""
    v = e4m3(codes).astype(np.float64) if fp8 else codes.astype(np.float64) - 128.0
    return v * scales


@pytest.mark.parametrize(
    "fmt, kind, window",
    [
        ("block_wise_fp8", "full", None),
        ("block_wise_fp8", "sliding", 5),
        ("block_wise_fp8", "headwise", 3),
        ("float8_e4m3fn", "full", None),
        ("int8", "sliding", 4),
    ],
)
def test_reference_attends_on_the_dequantized_cache(fmt, kind, window):
    """Two steps (a prefill chunk, then decode tokens): the output equals dense fp64 attention on the
    cache's codes dequantized by ml_dtypes (``tests/_dense_attention.py``), within 1e-5."""
    paddle = pytest.importorskip("paddle")
    from _dense_attention import dense_attention

    hkv, group, dqk, dv, bs = 2, 2, 64, 32, 16
    layer = _layer(hkv, group, dqk, dv, kind, window)
    rng = np.random.default_rng(0)
    static = None
    if not FORMATS[fmt].dynamic:
        n = hkv * dqk if FORMATS[fmt].channel_wise else hkv
        nv = hkv * dv if FORMATS[fmt].channel_wise else hkv
        static = (np.exp(rng.uniform(-5, -2, n)), np.exp(rng.uniform(-5, -2, nv)))
    cache = _paddle_cache(fmt, 4, hkv, bs, dqk, dv, "float32", *(static or (None, None)))
    ks_all, vs_all = [], []
    for dec, t in ((0, 21), (21, 3)):
        q = rng.standard_normal((t, hkv * group, dqk)).astype(np.float32)
        k = rng.standard_normal((t, hkv, dqk)).astype(np.float32)
        v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
        if dec == 0:
            k[3] = 0.0  # a zero token: codes 0, scale 0 (FastDeploy: NaN)
        out = _reference_step(
            layer, paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), cache, bs, dec
        )
        end = dec + t
        (kc, kscale), (vc, vscale) = _slots(cache, end, bs, hkv)
        fp8 = FORMATS[fmt].code == "fp8"
        if FORMATS[fmt].dynamic:
            kd, vd = _dequant_np(kc, kscale[:, None], fp8), _dequant_np(vc, vscale[:, None], fp8)
        elif FORMATS[fmt].channel_wise:
            heads = np.arange(end * hkv) % hkv
            kd = _dequant_np(kc, static[0].reshape(hkv, dqk)[heads], fp8)
            vd = _dequant_np(vc, static[1].reshape(hkv, dv)[heads], fp8)
        else:
            heads = np.arange(end * hkv) % hkv
            kd = _dequant_np(kc, static[0][heads][:, None], fp8)
            vd = _dequant_np(vc, static[1][heads][:, None], fp8)
        windows = [layer.head_window(h) for h in range(hkv)]
        want = dense_attention(
            q, kd.reshape(end, hkv, dqk), vd.reshape(end, hkv, dv), dec,
            scale=layer.softmax_scale, windows=windows, sinks=None,
        )  # fmt: skip
        assert np.abs(out.numpy() - want).max() <= 1e-5
        ks_all.append(k)
        vs_all.append(v)
    # and the quantization error is that of the format (a sanity bound, not the oracle)
    assert np.isfinite(out.numpy()).all()


# ---------------------------------------------------------------- checks


def _torch_cache(fmt_name: str = "block_wise_fp8", **over):
    torch = _torch()
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache

    fmt = FORMATS[fmt_name]
    f = dict(
        key=torch.zeros(3, 2, 16, 64, dtype=torch.uint8),
        value=torch.zeros(3, 2, 16, 32, dtype=torch.uint8),
        key_scale=torch.zeros(3, 2, 16, dtype=torch.float16) if fmt.dynamic else torch.ones(2 * 64),
        value_scale=torch.zeros(3, 2, 16, dtype=torch.float16) if fmt.dynamic else torch.ones(2 * 32),
        quant=fmt,
    )
    if fmt_name == "float8_e4m3fn":
        f["key_scale"], f["value_scale"] = torch.ones(2), torch.ones(2)
    f.update(over)
    return QuantizedKVCache(**f)


@pytest.mark.parametrize("fmt", ["block_wise_fp8", "float8_e4m3fn", "int8"])
def test_check_quantized_cache_accepts_each_format(fmt):
    from fastdeploy_paddlefleet.backends.checks import check_quantized_cache

    torch = _torch()
    assert check_quantized_cache(_torch_cache(fmt), 2, 16, 64, 32, torch.float16) == 3


@pytest.mark.parametrize(
    "over, error, words",
    [
        (lambda t: {"key": t.zeros(3, 2, 16, 64, dtype=t.float16)}, TypeError, "uint8"),
        (lambda t: {"value": t.zeros(3, 2, 16, 64, dtype=t.uint8)}, ValueError, "kv_cache.value"),
        (lambda t: {"key_scale": t.zeros(3, 2, 16, dtype=t.float32)}, TypeError, "model dtype"),
        (lambda t: {"key_scale": t.zeros(3, 2, 8, dtype=t.float16)}, ValueError, "kv_cache.key_scale"),
        (lambda t: {"key_scale": t.zeros(3, 2, 16, dtype=t.int32)}, TypeError, "float dtype"),
        (lambda t: {"quant": "block_wise_fp8"}, TypeError, "KVCacheQuant"),
        (lambda t: {"key_scale": np.zeros((3, 2, 16), np.float16)}, TypeError, "paddle or torch"),
    ],
)
def test_check_quantized_cache_refuses(over, error, words):
    from fastdeploy_paddlefleet.backends.checks import check_quantized_cache

    torch = _torch()
    with pytest.raises(error, match=words):
        check_quantized_cache(_torch_cache(**over(torch)), 2, 16, 64, 32, torch.float16)


def test_check_quantized_cache_refuses_shared_written_tensors():
    from fastdeploy_paddlefleet.backends.checks import check_quantized_cache

    torch = _torch()
    s = torch.zeros(3, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="same tensor"):
        check_quantized_cache(_torch_cache(key_scale=s, value_scale=s), 2, 16, 64, 32, torch.float16)
    k = torch.zeros(3, 2, 16, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same tensor"):
        check_quantized_cache(_torch_cache(key=k, value=k), 2, 16, 64, 64, torch.float16)


@pytest.mark.parametrize(
    "fmt, over, error, words",
    [
        ("int8", lambda t: {"key_quant_scale": t.ones(2 * 64, dtype=t.float16)}, ValueError, "alone"),
        ("int8", lambda t: {"value_quant_scale": t.ones(2 * 32, dtype=t.float16)}, ValueError, "alone"),
        (
            "block_wise_fp8",
            lambda t: {"key_quant_scale": t.ones(2), "value_quant_scale": t.ones(2)},
            ValueError,
            "only static formats",
        ),
        (
            "float8_e4m3fn",
            lambda t: {
                "key_quant_scale": t.ones(3, dtype=t.float16),
                "value_quant_scale": t.ones(2, dtype=t.float16),
            },
            ValueError,
            r"kv_cache.key_quant_scale must have the dequant multipliers' shape \[2\]",
        ),
        (
            "float8_e4m3fn",
            lambda t: {"key_quant_scale": t.ones(2), "value_quant_scale": t.ones(2)},
            TypeError,
            "model dtype",
        ),
    ],
)
def test_check_quantized_cache_quant_multipliers(fmt, over, error, words):
    from fastdeploy_paddlefleet.backends.checks import check_quantized_cache

    torch = _torch()
    with pytest.raises(error, match=words):
        check_quantized_cache(_torch_cache(fmt, **over(torch)), 2, 16, 64, 32, torch.float16)
    ok = {
        "key_quant_scale": torch.ones(2, dtype=torch.float16),
        "value_quant_scale": torch.ones(2, dtype=torch.float16),
    }
    assert check_quantized_cache(_torch_cache("float8_e4m3fn", **ok), 2, 16, 64, 32, torch.float16) == 3


def test_write_refuses_lone_or_misplaced_quant_multipliers():
    from fastdeploy_paddlefleet.kernels.cache_write import write_scales

    torch = _torch()
    s, m = torch.ones(2), torch.ones(2)
    assert write_scales(FORMATS["float8_e4m3fn"], s, s, None, None) == (s, s, False)
    k, v, mult = write_scales(FORMATS["float8_e4m3fn"], s, s, m, m)
    assert k is m and v is m and mult
    with pytest.raises(ValueError, match="key_quant_scale given alone"):
        write_scales(FORMATS["float8_e4m3fn"], s, s, m, None)
    with pytest.raises(ValueError, match="'block_wise_fp8' takes none"):
        write_scales(FORMATS["block_wise_fp8"], s, s, m, m)
    with pytest.raises(ValueError, match=r"value_quant_scale has shape \[3\]"):
        write_scales(FORMATS["int8"], s, s, m, torch.ones(3))


def test_static_scales_per_channel_shape():
    from fastdeploy_paddlefleet.backends.checks import check_quantized_cache

    torch = _torch()
    bad = _torch_cache("int8", value_scale=torch.ones(2 * 64))  # V's channels are 32
    with pytest.raises(ValueError, match=r"kv_cache.value_scale must have shape \[64\]"):
        check_quantized_cache(bad, 2, 16, 64, 32, torch.float16)
