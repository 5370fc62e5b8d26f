"""Reference attention on FastDeploy's paged KV cache, in paddle ops.

Written for clarity, not speed: it states the canonical semantics
(``docs/semantics.md``) that every other backend is tested against.
Per step it

1. writes each token's K/V into its cache slot: token ``t`` of request ``b``
   sits at position ``seq_lens_decoder[b] + (t - cu_seqlens_q[b])``, logical
   block ``pos // block_size``, slot ``pos % block_size``; the physical page
   comes from ``block_tables`` (page ``block * Hkv + head``) or from the
   layer's head-wise page table;
2. per request, per run of kv heads sharing one window, gathers exactly the
   positions its queries may see (never a ``-1`` page), builds the causal /
   window mask, adds the sink, softmaxes in fp32 and takes the weighted sum.

Any device paddle runs on; torch inputs cross by DLPack (zero-copy, so cache
writes land in the caller's torch cache) and the output goes back to torch.
"""

from __future__ import annotations

import logging
from typing import Any

from ..plan.layer import LayerAttention
from .base import AttentionBackend, BatchMeta, QuantizedKVCache
from .checks import HostMeta, dtype_name, validate_inputs

logger = logging.getLogger(__name__)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _to_paddle(x: Any) -> Any:
    """Paddle view of a torch tensor (DLPack, zero-copy); paddle tensors pass through."""
    if x is None or not _is_torch(x):
        return x
    import paddle

    return paddle.utils.dlpack.from_dlpack(x.detach())


def _sink_tensor(sinks: Any) -> Any:
    """``sinks`` as a paddle fp32 tensor (paddle, torch, numpy or list in)."""
    import numpy as np
    import paddle

    if isinstance(sinks, paddle.Tensor):
        return sinks.astype("float32")
    if _is_torch(sinks):
        return _to_paddle(sinks).astype("float32")
    return paddle.to_tensor(np.asarray(sinks, dtype="float32"))


def _head_runs(layer: LayerAttention) -> list[tuple[int, int, int | None]]:
    """Contiguous runs ``(start, stop, window_left)`` of kv heads that share one window."""
    runs: list[tuple[int, int, int | None]] = []
    for h in range(layer.num_kv_heads):
        w = layer.head_window(h)
        if runs and runs[-1][2] == w:
            runs[-1] = (runs[-1][0], h + 1, w)
        else:
            runs.append((h, h + 1, w))
    return runs


def _pages(host: HostMeta, layer: LayerAttention, b: int) -> Any:
    """Request ``b``'s page table ``[Hkv, max_pages]`` (numpy int64; -1 = not there)."""
    import numpy as np

    hkv = layer.num_kv_heads
    if host.page_table is not None:
        return host.page_table[b * hkv : (b + 1) * hkv]
    blocks = host.block_tables[b][None, :]
    return np.where(blocks >= 0, blocks * hkv + np.arange(hkv)[:, None], -1)


def _flat(cache: Any) -> tuple[Any, Any]:
    """``cache [NB, H, BS, D]`` (possibly a strided view of a wider cache) as a contiguous 1-D alias
    of the memory it spans, and its element strides ``[4]`` (numpy int64).

    Gathers and scatters then address rows by element offset: paddle's gather / index kernels would
    otherwise make a non-contiguous view contiguous first, a copy of the whole cache per call.
    """
    import numpy as np
    import paddle

    strides = np.asarray(cache.strides, dtype="int64")
    if strides[3] != 1:
        raise ValueError(f"kv cache channels must be contiguous, got strides {list(cache.strides)}")
    span = int(sum((int(n) - 1) * int(st) for n, st in zip(cache.shape, strides, strict=True))) + 1
    flat = cache if cache.is_contiguous() and cache.ndim == 1 else paddle.as_strided(cache, [span], [1])
    return flat, strides


def _row_offsets(strides: Any, block: Any, head: Any, slot: Any, dim: int) -> Any:
    """Element offsets ``[N * dim]`` of rows ``(block, head, slot)`` (numpy ``[N]`` each), row-major."""
    import numpy as np

    base = block * strides[0] + head * strides[1] + slot * strides[2]
    return (base.reshape(-1, 1) + np.arange(dim)[None, :]).reshape(-1)


def _write_cache(
    k: Any, v: Any, kv_cache: tuple[Any, Any], layer: LayerAttention, host: HostMeta, block_size: int
) -> None:
    """Scatter this step's ``k [T, Hkv, Dqk]`` / ``v [T, Hkv, Dv]`` into their cache slots (in place;
    the caches may be strided views of wider tensors)."""
    import numpy as np
    import paddle

    hkv = layer.num_kv_heads
    block_idx, head_idx, slot_idx = [], [], []
    for b in range(host.batch_size):  # requests are packed in order (checked): tokens 0..T-1
        n = int(host.seq_lens_this_time[b])
        if n == 0:
            continue
        pos = int(host.seq_lens_decoder[b]) + np.arange(n)
        page = _pages(host, layer, b)[:, pos // block_size]  # [Hkv, n]
        block_idx.append((page // hkv).T.reshape(-1))  # token-major, like k.reshape([T * Hkv, D])
        head_idx.append((page % hkv).T.reshape(-1))
        slot_idx.append(np.repeat(pos % block_size, hkv))
    if not block_idx:
        return
    block, head, slot = (np.concatenate(a) for a in (block_idx, head_idx, slot_idx))
    if isinstance(kv_cache, QuantizedKVCache):
        _write_quantized(k, v, kv_cache, block, head, slot, hkv)
        return
    for cache, x, dim in ((kv_cache[0], k, layer.qk_head_dim), (kv_cache[1], v, layer.v_head_dim)):
        flat, strides = _flat(cache)
        index = paddle.to_tensor(_row_offsets(strides, block, head, slot, dim), place=cache.place)
        flat.index_put_((index,), x.reshape([-1]).astype(cache.dtype))


def _e4m3_values() -> Any:
    """The 256 e4m3fn values by byte (numpy fp32; NaN for ``0x7F`` / ``0xFF``), from the bit fields."""
    import numpy as np

    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    mag = np.where(exp > 0, 2.0 ** (exp - 7.0) * (1 + man / 8), 2.0**-6 * man / 8)
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag).astype("float32")


def _e4m3_codes() -> Any:
    """Byte of each integer ``-448..448`` (index ``n + 448``): the nearest e4m3fn value, ties to the even
    byte (an even mantissa), as the GPU's ``cvt.rn`` rounds."""
    import numpy as np

    vals = _e4m3_values()[:127].astype("float64")  # bytes 0..126: 0 .. 448, increasing
    n = np.arange(0, 449, dtype="float64")
    hi = np.searchsorted(vals, n)  # first value >= n
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = n - vals[lo], vals[hi] - n
    pos = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    pos = np.where(d_hi == 0, hi, pos)
    return np.concatenate([pos[:0:-1] | 0x80, pos]).astype("uint8")  # -448..-1, then 0..448


def _round_to(x: Any, dtype: str) -> Any:
    """fp32 ``x`` rounded once to the model dtype (nearest even) and back to fp32."""
    return x if dtype == "float32" else x.astype(dtype).astype("float32")


def _rint(x: Any) -> Any:
    import paddle

    """Nearest integer, ties to even, of fp32 ``x`` with ``|x| <= 2**22`` (adding 1.5 * 2**23 leaves no
    fraction bits: the fp32 addition itself rounds to even); a zero result keeps ``x``'s sign (-0.2 ->
    -0.0, as FastDeploy's ``ceil`` gives)."""
    magic = 12582912.0
    r = (x + magic) - magic
    # (paddle's `x * 0.0` is a scale op adding +0: it loses the sign, so test the sign by division)
    neg_zero = paddle.logical_and(r == 0.0, 1.0 / x < 0.0)
    return paddle.where(neg_zero, paddle.full_like(r, -0.0), r)


def _quantize(x: Any, fmt: Any, scale: Any, dtype: str, multipliers: bool = False) -> tuple[Any, Any]:
    """FastDeploy's write rule (``docs/kv_quant.md``) in paddle: rows ``x [N, D]`` (model dtype
    ``dtype``) -> codes ``uint8 [N, D]`` and, for ``block_wise_fp8``, the dequant multipliers ``[N]``
    (fp32 holding ``dtype`` values). ``scale``: a static format's dequant multipliers broadcast to
    ``[N, 1]`` or ``[N, D]`` (quant multiplier ``T(1 / scale)``), or with ``multipliers`` its quant
    multipliers themselves (FastDeploy's ``cache_k_scale``, ``dtype`` values: used as they are)."""
    import paddle

    xf = x.astype("float32")
    if fmt.dynamic:
        finite = paddle.isfinite(xf)
        bad = paddle.logical_not(finite.all(axis=-1))
        amax = paddle.where(finite, xf.abs(), paddle.zeros_like(xf)).max(axis=-1)
        c = _round_to(paddle.full_like(amax, 448.0) / amax, dtype)  # 448 / 0 = inf
        ok = paddle.logical_and(paddle.isfinite(c), paddle.logical_not(bad))
        c = paddle.where(ok, c, paddle.ones_like(c))
        out = _round_to(1.0 / c, dtype)
        out = paddle.where(
            ok, out, paddle.where(bad, paddle.full_like(out, float("nan")), paddle.zeros_like(out))
        )
        c = c.unsqueeze(-1)
    elif multipliers:
        c = _round_to(scale.astype("float32"), dtype)  # dtype values already: unchanged
        out = None
    else:
        c = _round_to(1.0 / scale.astype("float32"), dtype)
        out = None
    y = _round_to(c * xf, dtype)
    nan = paddle.isnan(y)
    bound = fmt.max_bound
    q = _rint(paddle.clip(paddle.where(nan, paddle.zeros_like(y), y), -bound, bound))
    if fmt.code == "fp8":
        table = paddle.to_tensor(_e4m3_codes().astype("int32"), place=x.place)  # CPU `where`: no uint8
        codes = paddle.gather(table, (q + 448.0).astype("int64").reshape([-1])).reshape(q.shape)
        codes = paddle.where(nan, paddle.full_like(codes, 0x7F), codes)
        neg_zero = paddle.logical_and(q == 0.0, 1.0 / q < 0.0)  # -0.0: byte 0x80, as FastDeploy writes
        codes = paddle.where(neg_zero, paddle.full_like(codes, 0x80), codes)
    else:
        codes = paddle.where(nan, paddle.zeros_like(q), q + 128.0).astype("int32")
    if fmt.dynamic:
        codes = paddle.where(ok.unsqueeze(-1), codes, paddle.zeros_like(codes))
    return codes.astype("uint8"), out


def _dequantize(codes: Any, fmt: Any) -> Any:
    """fp32 values of ``codes`` (uint8, any shape) before the scale: e4m3fn or ``byte - 128``; the NaN
    codes (``0x7F`` / ``0xFF``, int8 byte 0) read as NaN."""
    import paddle

    if fmt.code == "fp8":
        table = paddle.to_tensor(_e4m3_values(), place=codes.place)
        return paddle.gather(table, codes.astype("int64").reshape([-1])).reshape(codes.shape)
    v = codes.astype("float32") - 128.0
    return paddle.where(v == -128.0, paddle.full_like(v, float("nan")), v)


def _write_quantized(
    k: Any, v: Any, cache: QuantizedKVCache, block: Any, head: Any, slot: Any, hkv: int
) -> None:
    """Scatter the codes (and a dynamic format's scales) of ``k [T, Hkv, Dqk]`` / ``v [T, Hkv, Dv]``
    into rows ``(block, head, slot)`` (numpy ``[T * Hkv]``, token-major) of ``cache``."""
    import numpy as np
    import paddle

    fmt = cache.quant
    dtype = dtype_name(k.dtype)
    mults = (cache.key_quant_scale, cache.value_quant_scale)
    multipliers = not fmt.dynamic and mults[0] is not None  # FastDeploy's own quant multipliers
    for codes_t, scale_t, x, mult_t in (
        (cache.key, cache.key_scale, k, mults[0]),
        (cache.value, cache.value_scale, v, mults[1]),
    ):
        dim = int(codes_t.shape[3])
        rows = x.reshape([-1, dim])
        static = None
        if not fmt.dynamic:
            sc = (mult_t if multipliers else scale_t).astype("float32")
            heads = paddle.to_tensor(np.tile(np.arange(hkv), rows.shape[0] // hkv), place=rows.place)
            static = sc.reshape([hkv, dim])[heads] if fmt.channel_wise else sc[heads].unsqueeze(-1)
        codes, out = _quantize(rows, fmt, static, dtype, multipliers)
        flat, strides = _flat(codes_t)
        index = paddle.to_tensor(_row_offsets(strides, block, head, slot, dim), place=codes_t.place)
        flat.index_put_((index,), codes.reshape([-1]))
        if out is not None:
            sflat, sst = _flat_scales(scale_t)
            index = paddle.to_tensor(block * sst[0] + head * sst[1] + slot * sst[2], place=scale_t.place)
            sflat.index_put_((index,), out.astype(scale_t.dtype))


def _flat_scales(scale: Any) -> tuple[Any, Any]:
    """``scale [NB, H, BS]`` as a 1-D alias of the memory it spans and its element strides (numpy)."""
    import numpy as np
    import paddle

    strides = np.asarray(scale.strides, dtype="int64")
    span = int(sum((int(n) - 1) * int(st) for n, st in zip(scale.shape, strides, strict=True))) + 1
    flat = scale if scale.is_contiguous() and scale.ndim == 1 else paddle.as_strided(scale, [span], [1])
    return flat, strides


def _gather_quantized(
    cache: QuantizedKVCache, value: bool, pages: Any, heads: Any, lo: int, end: int, block_size: int, hkv: int
) -> Any:
    """Positions ``[lo, end)`` of ``pages [H, max_pages]`` (kv heads ``heads [H]``) of the K (or V)
    codes, dequantized: ``[H, end - lo, D]`` fp32."""
    import numpy as np
    import paddle

    codes_t, scale_t = (cache.value, cache.value_scale) if value else (cache.key, cache.key_scale)
    fmt = cache.quant
    pos = np.arange(lo, end)
    page = pages[:, pos // block_size]  # [H, L]
    dim = int(codes_t.shape[3])
    flat, strides = _flat(codes_t)
    offsets = _row_offsets(
        strides, page // hkv, page % hkv, np.broadcast_to(pos % block_size, page.shape), dim
    )
    codes = paddle.gather(flat, paddle.to_tensor(offsets, dtype="int64", place=codes_t.place))
    x = _dequantize(codes, fmt).reshape([page.shape[0], page.shape[1], dim])
    sc = scale_t.astype("float32")
    if fmt.dynamic:
        sflat, sst = _flat_scales(sc)
        slot = np.broadcast_to(pos % block_size, page.shape)
        index = paddle.to_tensor(
            (page // hkv) * sst[0] + (page % hkv) * sst[1] + slot * sst[2], place=sc.place
        )
        return x * paddle.gather(sflat, index.reshape([-1])).reshape([page.shape[0], page.shape[1], 1])
    heads = paddle.to_tensor(np.asarray(heads), place=sc.place)
    if fmt.channel_wise:
        return x * sc.reshape([hkv, dim])[heads].unsqueeze(1)
    return x * sc[heads].reshape([-1, 1, 1])


def _gather(cache: Any, pages: Any, lo: int, end: int, block_size: int, hkv: int) -> Any:
    """Positions ``[lo, end)`` of each row of ``pages [H, max_pages]`` -> ``[H, end - lo, D]`` fp32."""
    import numpy as np
    import paddle

    pos = np.arange(lo, end)
    page = pages[:, pos // block_size]  # [H, L]; validated: no -1 in this range
    dim = int(cache.shape[3])
    flat, strides = _flat(cache)
    offsets = _row_offsets(
        strides, page // hkv, page % hkv, np.broadcast_to(pos % block_size, page.shape), dim
    )
    index = paddle.to_tensor(offsets, dtype="int64", place=cache.place)
    shape = [page.shape[0], page.shape[1], dim]
    name = dtype_name(cache.dtype)
    if name in ("float16", "bfloat16"):
        # gather 16-bit floats as their bits: paddle's CPU gather has no fp16/bf16 kernel
        return paddle.gather(flat.view("int16"), index).view(name).astype("float32").reshape(shape)
    return paddle.gather(flat, index).astype("float32").reshape(shape)


def _attend_run(
    q: Any,
    key: Any,
    value: Any,
    sink: Any,
    q_pos0: int,
    k_pos0: int,
    window: int | None,
    scale: float,
    soft_cap: float | None = None,
) -> Any:
    """Dense attention of one request for a run of kv heads.

    ``q [H, G, n, Dqk]`` at positions ``q_pos0 + i``; ``key [H, L, Dqk]``,
    ``value [H, L, Dv]`` at positions ``k_pos0 + j``; ``sink [H, G]`` logits or
    ``None``; ``soft_cap``: scores become ``cap * tanh(scores / cap)`` (the sink is not capped).
    Returns ``[H, G, n, Dv]`` fp32.
    """
    import numpy as np
    import paddle

    h, g, n, dqk = q.shape
    length = key.shape[1]
    scores = (
        paddle.matmul(q.reshape([h, g * n, dqk]), key, transpose_y=True).reshape([h, g, n, length]) * scale
    )
    if soft_cap is not None:
        scores = paddle.tanh(scores / soft_cap) * soft_cap
    i = np.arange(q_pos0, q_pos0 + n)[:, None]
    j = np.arange(k_pos0, k_pos0 + length)[None, :]
    visible = (j <= i) & (True if window is None else i - j <= window)  # [n, L]
    visible = paddle.broadcast_to(paddle.to_tensor(visible, place=scores.place), scores.shape)
    neg_inf = paddle.full_like(scores, float("-inf"))
    row_max = paddle.where(visible, scores, neg_inf).max(axis=-1, keepdim=True)  # [H, G, n, 1]
    if sink is not None:
        sink = sink.reshape([h, g, 1, 1]).expand([h, g, n, 1])
        row_max = paddle.maximum(row_max, sink)
    row_max = paddle.where(paddle.isinf(row_max), paddle.zeros_like(row_max), row_max)  # fully masked rows
    probs = paddle.where(visible, paddle.exp(scores - row_max), paddle.zeros_like(scores))
    denom = probs.sum(axis=-1, keepdim=True)
    if sink is not None:
        denom = denom + paddle.exp(sink - row_max)
    # masked keys contribute exactly nothing (docs/semantics.md): a non-finite V entry would meet the
    # zero probability of a row that may not see it in the matmul (0 * NaN = NaN); it leaves the
    # matmul, and a row that does see it is NaN, as the dense computation gives
    finite = paddle.isfinite(value)
    value = paddle.where(finite, value, paddle.zeros_like(value))
    key_bad = paddle.logical_not(finite).any(axis=-1)  # [H, L]
    seen_bad = paddle.logical_and(visible, key_bad.reshape([h, 1, 1, length])).any(axis=-1, keepdim=True)
    out = paddle.matmul(probs.reshape([h, g * n, length]), value).reshape([h, g, n, value.shape[-1]])
    # a fully masked row without a sink has denom 0 and out 0: give 0, not NaN
    safe = paddle.where(denom > 0, denom, paddle.ones_like(denom))
    return paddle.where(seen_bad, paddle.full_like(out, float("nan")), out / safe)


class ReferenceBackend(AttentionBackend):
    """Paged attention in plain paddle ops; the semantics every backend must match."""

    name = "reference"
    supports_unequal_v_dim = True

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        layer: LayerAttention,
        meta: BatchMeta,
        kv_cache: tuple[Any, Any],
        sinks: Any = None,
    ) -> Any:
        """Write K/V into ``kv_cache`` then attend; ``q [T, Hq, Dqk]`` -> ``[T, Hq * Dv]`` in q's dtype."""
        import paddle

        host = validate_inputs(q, k, v, layer, meta, kv_cache, sinks)
        return_torch = _is_torch(q)
        q, k, v = (_to_paddle(x) for x in (q, k, v))
        if isinstance(kv_cache, QuantizedKVCache):  # codes and scales, dequantized as they are read
            mults = tuple(None if x is None else _to_paddle(x) for x in kv_cache[5:7])
            kv_cache = QuantizedKVCache(*(_to_paddle(x) for x in kv_cache[:4]), kv_cache.quant, *mults)
        else:
            kv_cache = (_to_paddle(kv_cache[0]), _to_paddle(kv_cache[1]))
        hq, hkv, dv, g = layer.num_q_heads, layer.num_kv_heads, layer.v_head_dim, layer.group_size
        bs = meta.block_size

        _write_cache(k, v, kv_cache, layer, host, bs)

        sink_logits = None
        if layer.sink == "learnable":
            sink_logits = _sink_tensor(sinks).reshape([hkv, g])
        elif layer.sink == "off-by-one":
            sink_logits = paddle.zeros([hkv, g], dtype="float32")

        runs = _head_runs(layer)
        qf = q.astype("float32")
        outs = []
        for b in range(host.batch_size):
            n = int(host.seq_lens_this_time[b])
            if n == 0:
                continue
            start, dec = int(host.cu_seqlens_q[b]), int(host.seq_lens_decoder[b])
            end = dec + n
            pages = _pages(host, layer, b)
            q_b = qf[start : start + n].reshape([n, hkv, g, -1]).transpose([1, 2, 0, 3])  # [Hkv, G, n, Dqk]
            per_run = []
            for h0, h1, window in runs:
                lo = 0 if window is None else max(0, dec - window)
                if isinstance(kv_cache, QuantizedKVCache):
                    heads = list(range(h0, h1))
                    key = _gather_quantized(kv_cache, False, pages[h0:h1], heads, lo, end, bs, hkv)
                    value = _gather_quantized(kv_cache, True, pages[h0:h1], heads, lo, end, bs, hkv)
                else:
                    key = _gather(kv_cache[0], pages[h0:h1], lo, end, bs, hkv)
                    value = _gather(kv_cache[1], pages[h0:h1], lo, end, bs, hkv)
                sink = None if sink_logits is None else sink_logits[h0:h1]
                per_run.append(
                    _attend_run(
                        q_b[h0:h1],
                        key,
                        value,
                        sink,
                        dec,
                        lo,
                        window,
                        layer.softmax_scale,
                        layer.logits_soft_cap,
                    )
                )
            o = per_run[0] if len(per_run) == 1 else paddle.concat(per_run, axis=0)  # [Hkv, G, n, Dv]
            outs.append(o.transpose([2, 0, 1, 3]).reshape([n, hq * dv]))
        if outs:
            out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
        else:
            out = paddle.zeros([0, hq * dv], dtype="float32")
        out = out.astype(q.dtype)
        if return_torch:
            import torch

            return torch.from_dlpack(out)
        return out
