"""Quantized KV cache codes: FastDeploy's write rule and its inverse, as ``@triton.jit`` helpers.

The rule (``docs/kv_quant.md`` cites FastDeploy's source line by line), for values ``x`` in the model
dtype ``T`` and a quant multiplier ``c`` (a ``T`` value):

* ``y = T(c * x)``: the product rounded to ``T`` once;
* round ``y`` to an integer, ties to even, clamp to ``[-B, B]`` (``B`` = 448 fp8, 127 int8);
* fp8: the e4m3fn code of that integer (round to nearest even); int8: the byte ``q + 128``.

``block_wise_fp8`` takes ``c = T(448 / max|x|)`` per token and kv head and stores the dequant
multiplier ``T(1 / c)``; static formats take FastDeploy's own quant multiplier ``c`` when the cache
carries it (``cache_k_scale = T(max_bound / s)``, rounded on its own: ``serving/kv_scales.py``), else
``c = T(1 / scale)`` of the dequant multiplier (one ulp of ``T`` off FastDeploy's for some scales).
Deviations from FastDeploy, all where FastDeploy's own result is not finite: a vector
whose ``c`` overflows (all zero, or ``max|x|`` too small for ``T``) gets codes 0 and scale 0 (FastDeploy
writes NaN codes); a dynamic vector holding a NaN or an infinity gets codes 0 and scale NaN.

Codes never take the e4m3 NaN bytes ``0x7F`` / ``0xFF`` for a finite input (the interpreter reads them
as +-480); a static fp8 NaN input is written as ``0x7F`` and a static int8 NaN as byte 0 (``-128``,
which no finite input produces), and :func:`dequant` reads both back as NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    """Nearest integer, ties to even (FastDeploy's ``roundWithTiesToEven``) for ``|x| < 2**22``, keeping
    the sign of a zero result (-0.2 -> -0.0, e4m3 byte 0x80, as ``ceil`` gives FastDeploy)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def to_dtype(x, T: tl.constexpr):
    """``x`` (fp32) rounded to ``T`` (nearest even) and back to fp32: one rounding in the model dtype.
    bf16 rounds on the bits (the interpreter's cast truncates; the GPU's ``cvt.rn`` gives the same)."""
    if T == tl.float32:
        return x
    elif T == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return tl.where(x != x, x, r.to(tl.float32, bitcast=True))
    else:
        return x.to(T).to(tl.float32)


@triton.jit
def _fp8_grid(q):
    """Integer-valued ``q`` in ``[-448, 448]`` rounded to the e4m3 grid, ties to even (the cast the GPU
    does with ``cvt.rn``; the interpreter's cast rounds ties away, so the grid is rounded here and the
    cast below is exact)."""
    a = tl.abs(q)
    step = tl.where(a >= 256.0, 32.0, tl.where(a >= 128.0, 16.0, tl.where(a >= 64.0, 8.0, 1.0)))
    step = tl.where((a >= 16.0) & (a < 64.0), tl.where(a >= 32.0, 4.0, 2.0), step)
    return round_half_even(q * (1.0 / step)) * step


@triton.jit
def encode(y, IS_FP8: tl.constexpr):
    """Codes (uint8) of ``y = T(c * x)`` (fp32): round half even, clamp to the bound, code. NaN:
    ``0x7F`` (fp8) or byte 0 (int8); +-inf saturates like any large value."""
    nan = y != y
    y = tl.where(nan, 0.0, y)
    if IS_FP8:
        # clamp first: the bound is an integer, so clamping and rounding commute
        q = round_half_even(tl.minimum(tl.maximum(y, -448.0), 448.0))
        code = _fp8_grid(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(nan, 0x7F, code.to(tl.int32))
    else:
        q = round_half_even(tl.minimum(tl.maximum(y, -127.0), 127.0))
        code = tl.where(nan, 0, (q + 128.0).to(tl.int32))
    return code.to(tl.uint8)


@triton.jit
def quant_dynamic(x, T: tl.constexpr):
    """``block_wise_fp8`` of rows ``x [R, D]`` (fp32 holding ``T`` values; padding lanes 0): codes
    ``uint8 [R, D]`` and the dequant multiplier ``[R]`` (fp32 holding a ``T`` value; 0 for a row whose
    quant multiplier overflows, NaN for a row holding a NaN or an infinity)."""
    a = tl.abs(x)
    finite = a < float("inf")  # NaN compares false
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    amax = tl.max(tl.where(finite, a, 0.0), axis=1)
    # correctly rounded in fp32, then once to T: the same as one rounding to T (fp32 has > 2p+2 bits)
    c = to_dtype(tl.div_rn(448.0 + amax * 0.0, amax), T)
    ok = (c < float("inf")) & (~bad)
    c = tl.where(ok, c, 0.0)
    scale = to_dtype(tl.div_rn(1.0 + c * 0.0, tl.where(ok, c, 1.0)), T)
    scale = tl.where(ok, scale, tl.where(bad, float("nan"), 0.0))
    codes = encode(to_dtype(c[:, None] * x, T), True)
    return tl.where(ok[:, None], codes, 0).to(tl.uint8), scale


@triton.jit
def quant_static(x, scale, IS_FP8: tl.constexpr, T: tl.constexpr, MULT: tl.constexpr = False):
    """Static fp8 / int8 codes of ``x [R, D]`` (fp32 holding ``T`` values) at ``scale`` (fp32,
    broadcast to ``x``: ``[R, 1]`` per kv head, ``[R, D]`` per channel). ``MULT``: ``scale`` IS the
    quant multiplier ``c`` (FastDeploy's ``cache_k_scale``, a ``T`` value: used as it is); else it is
    the dequant multiplier and ``c = T(1 / scale)``."""
    if MULT:
        c = to_dtype(scale, T)  # a T value already: unchanged
    else:
        c = to_dtype(tl.div_rn(1.0 + scale * 0.0, scale), T)
    return encode(to_dtype(c * x, T), IS_FP8)


@triton.jit
def dequant(codes, scale, IS_FP8: tl.constexpr):
    """fp32 values of ``codes`` (uint8) times ``scale`` (fp32, broadcast): e4m3fn bits or ``byte - 128``;
    the NaN codes (``0x7F`` / ``0xFF`` fp8, byte 0 int8) read as NaN on GPU and interpreter alike."""
    if IS_FP8:
        v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = tl.where((codes & 0x7F) == 0x7F, float("nan"), v)
    else:
        v = codes.to(tl.float32) - 128.0
        v = tl.where(codes == 0, float("nan"), v)
    return v * scale


# a kernel over [rows, D] tiles: the unit the tests drive directly (no cache, no tables)
@triton.jit
def _quant_rows_kernel(
    X, C, S, Q, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    FMT: tl.constexpr, PER_CHANNEL: tl.constexpr, T: tl.constexpr, MULT: tl.constexpr = False,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rm = r < n_rows
    m = rm[:, None] & (d[None, :] < D)
    x = tl.load(X + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if FMT == 0:  # block_wise_fp8: scales written
        codes, scale = quant_dynamic(x, T)
        tl.store(S + r, scale.to(S.dtype.element_ty), mask=rm)
    else:  # static: scales read, per row (kv head) or per channel
        if PER_CHANNEL:
            s = tl.load(Q + d[None, :] + r[:, None] * 0, mask=m, other=1.0).to(tl.float32)
        else:
            s = tl.load(Q + r, mask=rm, other=1.0).to(tl.float32)[:, None]
        codes = quant_static(x, s, FMT == 1, T, MULT)
    tl.store(C + r[:, None] * D + d[None, :], codes, mask=m)


#: format names -> the FMT switch of the kernels
FMT_IDS = {"block_wise_fp8": 0, "float8_e4m3fn": 1, "int8": 2}
