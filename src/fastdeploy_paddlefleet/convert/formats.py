"""The two quantized weight formats the converter reads, decoded with numpy (``docs/convert.md``).

* **MXFP4** (gpt-oss, ``quant_method: mxfp4``): ``X_blocks`` uint8 ``[E, R, G, 16]`` holds 32
  E2M1 (4-bit) codes per block, two per byte, the element at even index ``2k`` in the LOW nibble of
  byte ``k`` and ``2k+1`` in the HIGH nibble; ``X_scales`` uint8 ``[E, R, G]`` holds one E8M0 exponent
  per block: ``value = E2M1[code] * 2**(scale - 127)``, ``scale == 255`` is NaN (OCP MX v1.0: E8M0's
  only special value). :func:`mxfp4_rows` decodes ``[..., G, 16]`` bytes into ``[..., G * 32]``.
* **block FP8** (DeepSeek-V3, ``quant_method: fp8``, ``fmt: e4m3``): ``X`` float8_e4m3fn ``[M, N]``
  with ``X_scale_inv`` float32 ``[ceil(M / bm), ceil(N / bn)]``, one per ``bm x bn`` block (the
  last row / column of blocks may be partial): ``value = e4m3(X[i, j]) * X_scale_inv[i // bm, j // bn]``,
  the product taken in float32. E4M3FN has no infinities; ``S.1111.111`` is NaN.

Results are float32 (exact: an E2M1 value times a power of two, an E4M3 value and a float32 scale
multiplied once in float32); :func:`to_bf16_bits` rounds to bfloat16 (nearest, ties to even, as a
float32 -> bfloat16 cast does) and returns the raw ``uint16`` bits, since numpy has no bfloat16.
"""

from __future__ import annotations

from typing import Any

#: E2M1 value of each 4-bit code (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: elements per MXFP4 block, bytes per packed block
MXFP4_BLOCK, MXFP4_BLOCK_BYTES = 32, 16
#: E8M0 scale: ``2**(byte - bias)``; ``nan`` is its NaN encoding
E8M0_BIAS, E8M0_NAN = 127, 255
#: E4M3FN: exponent bias, the largest finite magnitude
E4M3_BIAS, E4M3_MAX = 7, 448.0


def e4m3fn_table() -> Any:
    """float32 ``[256]``: the value of every float8_e4m3fn byte (sign bit 7, exponent bits 6-3 with
    bias 7, mantissa bits 2-0; exponent 0 is subnormal ``m / 8 * 2**-6``; ``0x7F`` / ``0xFF`` NaN)."""
    import numpy as np

    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - E4M3_BIAS)
    subnormal = (mantissa / 8.0) * 2.0 ** (1 - E4M3_BIAS)
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


def mxfp4_rows(blocks: Any, scales: Any) -> Any:
    """Decode MXFP4: ``blocks`` uint8 ``[..., G, 16]`` and ``scales`` uint8 ``[..., G]`` -> float32
    ``[..., G * 32]`` (module docstring)."""
    import numpy as np

    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1:] != (MXFP4_BLOCK_BYTES,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: expected "
            f"blocks [..., G, {MXFP4_BLOCK_BYTES}] and scales [..., G]"
        )
    lut = np.asarray(E2M1_VALUES, dtype=np.float32)
    values = np.empty((*blocks.shape[:-1], MXFP4_BLOCK), dtype=np.float32)
    values[..., 0::2] = lut[blocks & 0x0F]
    values[..., 1::2] = lut[blocks >> 4]
    exponent = scales.astype(np.int32) - E8M0_BIAS
    with np.errstate(over="ignore"):  # 2**127 * 6 is past float32: inf, as in a bfloat16 cast
        out = np.ldexp(values, exponent[..., None])
    out[scales == E8M0_NAN] = np.nan
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


def fp8_block_rows(weight: Any, scale_inv: Any, block: tuple[int, int], table: Any | None = None) -> Any:
    """Decode block FP8: ``weight`` uint8 ``[m, N]`` (float8_e4m3fn bytes, rows of whole row blocks
    but the last), ``scale_inv`` float32 ``[ceil(m / bm), ceil(N / bn)]`` -> float32 ``[m, N]``,
    ``e4m3(weight) * scale_inv`` per ``bm x bn`` block (partial edge blocks use their block's scale).
    ``table``: :func:`e4m3fn_table`, made once by a caller that decodes many bands."""
    import numpy as np

    bm, bn = block
    m, n = weight.shape
    want = (-(-m // bm), -(-n // bn))
    if weight.dtype != np.uint8 or scale_inv.dtype != np.float32 or scale_inv.shape != want:
        raise ValueError(
            f"FP8 weight {weight.dtype} {list(weight.shape)} with scale_inv {scale_inv.dtype} "
            f"{list(scale_inv.shape)}: expected uint8 bytes and float32 scales {list(want)} "
            f"for blocks {bm}x{bn}"
        )
    table = e4m3fn_table() if table is None else table
    scale = np.repeat(np.repeat(scale_inv, bm, axis=0)[:m], bn, axis=1)[:, :n]
    return table[weight] * scale  # float32 * float32: one rounding, as the reference kernel


def to_bf16_bits(x: Any) -> Any:
    """float32 ``x`` -> uint16 bfloat16 bits of the same shape: round to nearest, ties to even;
    overflow becomes infinity; NaN stays NaN (quiet, sign kept)."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return rounded.astype(np.uint16)
