"""The portable paged-attention kernels (Triton): ``_prefill_kernel``, ``_decode_kernel`` and the
device functions they share (the key loop ``_attend``, page lookups, masks, the softmax's initial
state). Launched only through :mod:`.paged_attention` (its module docstring describes both kernels,
the cache layout and the page format; its plans choose tiles and constants)."""

from __future__ import annotations

import triton
import triton.language as tl

from .errors import KERNEL_CACHE_WRITE, KERNEL_DECODE, KERNEL_PREFILL, check_entries

PAGE_CHUNK: tl.constexpr = tl.constexpr(16)  # key tiles whose pages are loaded at once
BAD_NONE: tl.constexpr = tl.constexpr(1 << 30)  # "no bad table entry met"
#: the prefill's safe launch: programs (a grid-stride over the fast launch's) and flags each loads at once
SAFE_GRID = 128
SAFE_CHUNK: tl.constexpr = tl.constexpr(32)


@triton.jit
def _dot(a, b, acc):
    """``tl.dot(a, b, acc)`` (``acc`` may be None). fp32 operands multiply in IEEE fp32: Triton's
    default for fp32 is TF32 (10-bit mantissa, ~1e-3 relative error), and docs/semantics.md promises
    fp32 math. bf16 / fp16 operands run at their native precision (fp32 accumulation)."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _codes(x, dtype, KV_CODE: tl.constexpr):
    """Cache codes ``x`` (uint8) as ``dtype`` values, exactly: ``KV_CODE`` 1 reads e4m3fn bits, 2 an int8
    code stored as ``code + 128``; 0 (an unquantized cache) returns ``x`` as it is."""
    if KV_CODE == 1:
        y = x.to(tl.float8e4nv, bitcast=True).to(dtype)
    elif KV_CODE == 2:
        y = (x.to(tl.int16) - 128).to(dtype)
    else:
        y = x
    return y


@triton.jit
def _e4m3_as_f16_in_place(x):
    """e4m3fn codes ``x [N, D]`` (uint8, D even) as fp16 ``[N, D]``, exactly: one ``cvt.rn.f16x2.e4m3x2``
    (inline PTX, so GPU only) per pair of neighbouring codes, in the layout they were loaded in.

    Why not ``x.to(tl.float8e4nv, bitcast=True).to(tl.float16)``: Triton moves that conversion past the
    shared memory into the dot's operand layout, and for ``P @ V``'s B operand (pairs along the keys,
    codes contiguous along D) it then reads V's codes one byte at a time (64 ``LDS.U8`` per 64-key
    tile, sm_90 offline). The split into pairs and the join after it keep the conversion where the
    codes were loaded; the fp16 tile then takes the transposing ``ldmatrix`` as a bf16 tile would."""
    n: tl.constexpr = x.shape[0]
    d: tl.constexpr = x.shape[1]
    lo, hi = tl.split(tl.reshape(x, (n, d // 2, 2)))
    pair = (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.int16, bitcast=True)
    f16x2 = tl.inline_asm_elementwise(
        "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [pair], dtype=tl.int32, is_pure=True, pack=1
    )
    first = (f16x2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    second = (f16x2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(first, second), (n, d))


@triton.jit
def _q_for_codes(q, qk_scale, F16_CODES: tl.constexpr):
    """``(q, qk_scale)`` for the score dots. ``F16_CODES`` (e4m3 codes under a bf16 model; 1: K's, 2 and
    3: K's and V's, 3 by :func:`_e4m3_as_f16_in_place`): the codes are read as fp16, one
    ``cvt.f16x2.e4m3x2`` per pair (to bf16 it takes four, and they bound the key loops), so ``q [M, D]``
    goes to fp16 too, exactly: bf16 has fewer mantissa bits, and a power of two ``2^-e`` brings
    ``max|q|`` under ``2^15`` first (``e`` is folded back into ``qk_scale``). Otherwise: as they are."""
    if F16_CODES > 0:
        amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        big = (amax > 32768.0) & (amax < float("inf"))
        e = tl.where(big, tl.math.ceil(tl.log2(tl.where(big, amax, 1.0))) - 15.0, 0.0)
        q = (q.to(tl.float32) * tl.exp2(-e)).to(tl.float16)
        qk_scale = qk_scale * tl.exp2(e)
    return q, qk_scale


@triton.jit
def _fold_k_scale(q, KS, kvh, offs_dk, DQK: tl.constexpr, SCALE_MODE: tl.constexpr):
    """``q [M, BLOCK_DQK]`` times a static K scale (``SCALE_MODE`` 2: ``KS [Hkv]``, 3: ``KS [Hkv * Dqk]``),
    rounded back to q's dtype: the scores then read the codes as they are. Other modes: ``q``."""
    if SCALE_MODE == 2:
        q = (q.to(tl.float32) * tl.load(KS + kvh).to(tl.float32)).to(q.dtype)
    elif SCALE_MODE == 3:
        ks = tl.load(KS + kvh * DQK + offs_dk, mask=offs_dk < DQK, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * ks[None, :]).to(q.dtype)
    return q


@triton.jit
def _apply_v_scale(out, VS, kvh, offs_dv, DV: tl.constexpr, SCALE_MODE: tl.constexpr):
    """The normalised output ``out [M, BLOCK_DV]`` (fp32) times a static V scale (``SCALE_MODE`` 2: per
    head, 3: per channel); per-token V scales (1) were applied to P's columns in ``_tile``."""
    if SCALE_MODE == 2:
        out = out * tl.load(VS + kvh).to(tl.float32)
    elif SCALE_MODE == 3:
        out = out * tl.load(VS + kvh * DV + offs_dv, mask=offs_dv < DV, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _pages(
    tbl_row, blk, n_blk, kvh, Err, n_pages, req, need,
    HKV: tl.constexpr, HEADWISE: tl.constexpr, PAGE_H: tl.constexpr = 0,
    HAS_ERR: tl.constexpr = False, KERNEL: tl.constexpr = 0,
):  # fmt: skip
    """Physical page(s) of logical block(s) ``blk`` for kv head ``kvh`` (int64, -1 where absent).

    ``PAGE_H``: heads per block of the cache tensor (its ``stride(0) // stride(1)``), larger than
    ``HKV`` when the layer reads the leading heads of a wider (uniform) cache; 0 means ``HKV``.
    Head-wise pages are numbered in the layer's own view (``block * HKV + head``).

    Bounds: an entry outside ``[0, n_pages)`` (blocks, or head-wise pages) or a block past the table's
    ``n_blk`` columns gives -1 (never dereferenced); with ``HAS_ERR`` the first such entry among the
    ``need``-ed ones (keys some query sees) is recorded in ``Err`` (``kernels/errors.py``)."""
    raw = tl.load(tbl_row + blk, mask=blk < n_blk, other=-1)
    if HEADWISE:
        head = blk * 0 + kvh
    else:
        head = blk * 0 - 1
    good = check_entries(Err, raw, blk, n_blk, need, n_pages, req, head, blk, KERNEL, HAS_ERR)
    page = tl.where(good, raw, -1).to(tl.int64)
    if not HEADWISE:
        if PAGE_H == 0:
            page = tl.where(page >= 0, page * HKV + kvh, -1)
        else:
            page = tl.where(page >= 0, page * PAGE_H + kvh, -1)
    elif PAGE_H != 0 and PAGE_H != HKV:
        page = tl.where(page >= 0, page // HKV * PAGE_H + page % HKV, -1)
    return page


@triton.jit
def _scan_table(
    Err, tbl_row, n_blk, n_pages, req, kvh, lo, hi,
    BS: tl.constexpr, HEADWISE: tl.constexpr, KERNEL: tl.constexpr, SCAN: tl.constexpr = 64,
):  # fmt: skip
    """Record in ``Err`` the first table entry of keys ``[lo, hi)`` that may not be dereferenced
    (``kernels/errors.py``). Kept out of the key loop, which only masks such entries: recording
    there cost the prefill kernel ~8 % (registers, code in every phase; benchmarks/NOTES.md)."""
    offs = tl.arange(0, SCAN)
    for c in range(lo // BS, (hi + BS - 1) // BS, SCAN):
        blk = c + offs
        need = blk * BS < hi
        raw = tl.load(tbl_row + blk, mask=need & (blk < n_blk), other=-1)
        if HEADWISE:
            head = blk * 0 + kvh
        else:
            head = blk * 0 - 1
        check_entries(Err, raw, blk, n_blk, need, n_pages, req, head, blk, KERNEL, True)


@triton.jit
def _load_kv_tile(
    K, V, page, slot, ok, stride_kp, stride_kr, stride_vp, stride_vr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, KV_CODE: tl.constexpr,
):  # fmt: skip
    """A key tile's K ``[BLOCK_N, BLOCK_DQK]`` and V ``[BLOCK_N, BLOCK_DV]`` through pointers, as stored
    (values, or uint8 codes): keys whose ``ok`` is False and channels past ``DQK`` / ``DV`` read as zero
    (codes: the code of 0). ``page`` is a scalar where the tile lies in one page, else one per key."""
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    if BS % BLOCK_N == 0:
        k_off = page * stride_kp + slot[:, None] * stride_kr
        v_off = page * stride_vp + slot[:, None] * stride_vr
    else:
        k_off = page[:, None] * stride_kp + slot[:, None] * stride_kr
        v_off = page[:, None] * stride_vp + slot[:, None] * stride_vr
    k_mask = ok[:, None]
    v_mask = ok[:, None]
    if BLOCK_DQK != DQK:
        k_mask = k_mask & (offs_dk[None, :] < DQK)
    if BLOCK_DV != DV:
        v_mask = v_mask & (offs_dv[None, :] < DV)
    if KV_CODE == 0:
        k = tl.load(K + k_off + offs_dk[None, :], mask=k_mask, other=0.0)
        v = tl.load(V + v_off + offs_dv[None, :], mask=v_mask, other=0.0)
    else:
        zero_code = 128 if KV_CODE == 2 else 0
        k = tl.load(K + k_off + offs_dk[None, :], mask=k_mask, other=zero_code)
        v = tl.load(V + v_off + offs_dv[None, :], mask=v_mask, other=zero_code)
    return k, v


@triton.jit
def _tile(
    acc, l_i, m_i, q, K, V, k_desc, v_desc, s, page, slot, ok, pos, lo_key, kv_len, window, qk_scale,
    stride_kp, stride_kr, stride_vp, stride_vr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    USE_TMA: tl.constexpr, EXP_BF16: tl.constexpr, PROFILE: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, ROWS_ALIKE: tl.constexpr = False,
    KS=None, VS=None, stride_ksp=0, stride_ksr=0, stride_vsp=0, stride_vsr=0,
    KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0, F16_CODES: tl.constexpr = 0,
    CLEAN: tl.constexpr = True,
):  # fmt: skip
    """One key tile ``[s, s + BLOCK_N)`` into the online softmax. ``page`` is a scalar (the tile lies
    in one page) or one page per key; ``ok`` marks keys whose page exists.

    Masked keys contribute exactly nothing (docs/semantics.md): a NaN / Inf in K at a key a row may
    not see only meets the ``-inf`` of the mask; in V it would meet that row's ``P = 0`` inside the
    ``P @ V`` dot (``0 * NaN = NaN``). Keys outside ``[lo_key, kv_len)`` and absent pages are loaded
    as zeros. ``ROWS_ALIKE`` (decode: every row is the same position) means every other key is seen
    by all rows or none, so nothing more is needed; otherwise (prefill's masked tiles: the causal
    diagonal, the window's edge) non-finite V entries are zeroed for the dot and the rows that do see
    such a key get a NaN score for it, so their output is NaN as the dense computation's would be.
    ``CLEAN=False`` leaves that out (the prefill's fast pass: a non-finite V at a masked key then turns
    the rows' output non-finite, which the kernel checks before it stores them).

    ``EXP_BF16``: exponentials as packed bf16 (``ex2.approx.ftz.bf16x2``, half the special-function
    issue of fp32 ``ex2``; P feeds the bf16 P @ V dot anyway). ``PROFILE`` (timing ablations only,
    wrong results): 1 drops the softmax (P = S), 2 drops the P @ V dot.

    Quantized caches (``KV_CODE`` 1: e4m3fn, 2: int8 + 128): the codes convert exactly to q's dtype for
    the dots (``F16_CODES`` 1: K's e4m3 codes as fp16, with q, V's as bf16; 2 and 3: both as fp16:
    ``_q_for_codes``); per-token
    scales (``SCALE_MODE`` 1: ``KS`` / ``VS`` ``[pages, block_size]`` at strides ``stride_ksp`` /
    ``stride_ksr``) multiply the scores' columns (K) and P's columns (V), in fp32 (with fp16 codes each
    row of the scaled P relative to its largest entry: :func:`_pv_token_scaled`). A
    key's scale is loaded like its codes (zero where not loaded); in prefill's masked tiles a
    non-finite V scale counts as a non-finite V entry (zeroed for the dot, NaN where seen), a
    non-finite K scale scores NaN, which only reaches scores the mask replaces (or a row that sees it)."""
    keys = s + tl.arange(0, BLOCK_N)
    if MASK:
        ok = ok & (keys >= lo_key) & (keys < kv_len)
    if USE_TMA:  # an absent page (-1) reads page 0 instead, and everything read from it is masked
        row = (tl.maximum(page, 0) * BS + s % BS).to(tl.int32)
        k = _codes(k_desc.load([row, 0]), q.dtype, KV_CODE)
        v = _codes(v_desc.load([row, 0]), q.dtype, KV_CODE)
        if MASK:  # stale slots may hold NaN and 0 * NaN = NaN in the P @ V dot
            v = tl.where(ok[:, None], v, 0.0)
    else:
        k, v = _load_kv_tile(
            K, V, page, slot, ok, stride_kp, stride_kr, stride_vp, stride_vr,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N, BS, KV_CODE,
        )  # fmt: skip
        if KV_CODE != 0:  # codes: what is not loaded reads as the code of 0
            k = _codes(k, q.dtype, KV_CODE)
            if F16_CODES == 1:  # V's codes in the model's bf16: P @ V as it was (no fp16 range to keep)
                v = _codes(v, tl.bfloat16, KV_CODE)
            elif F16_CODES == 3:  # fp16, converted where loaded (GPU only): the same values as 2
                v = _e4m3_as_f16_in_place(v)
            else:  # F16_CODES 2: fp16 like q; P's rows then keep their bits by _pv_token_scaled
                v = _codes(v, q.dtype, KV_CODE)
    if SCALE_MODE == 1:  # per-token scales, loaded like the keys' codes (page: a scalar or per key)
        ks = tl.load(KS + page * stride_ksp + slot * stride_ksr, mask=ok, other=0.0).to(tl.float32)
        vs = tl.load(VS + page * stride_vsp + slot * stride_vsr, mask=ok, other=0.0).to(tl.float32)
    # rows see different keys here (prefill's masked tiles): non-finite V entries leave the P @ V dot
    # and reach the scores instead, so the mask keeps them only in the rows that see them. With K and V
    # tiles alike the move is elementwise (a NaN in K where V is non-finite: q . k is NaN in every row);
    # otherwise per key (a reduction over V's channels, below).
    POISON_K: tl.constexpr = MASK and CLEAN and not ROWS_ALIKE and BLOCK_DQK == BLOCK_DV
    if POISON_K:
        finite = tl.abs(v) < float("inf")  # False for NaN too
        k = tl.where(finite, k, float("nan"))
        v = tl.where(finite, v, 0.0)
        if SCALE_MODE == 1:  # a non-finite V scale: as a non-finite V entry
            vs_ok = tl.abs(vs) < float("inf")
            ks = tl.where(vs_ok, ks, float("nan"))
            vs = tl.where(vs_ok, vs, 0.0)
    qk = _dot(q, tl.trans(k), None)
    if SCALE_MODE == 1:  # a non-finite K scale scores NaN (an infinite one times q.k could read -inf)
        qk = qk * tl.where(tl.abs(ks) < float("inf"), ks, float("nan"))[None, :]
    if SOFTCAP != 0.0:  # soft-capping: qk_scale is scale / cap, SOFTCAP is cap * log2(e)
        qk = _tanh(qk * qk_scale) * (SOFTCAP / qk_scale)  # the scaling below makes it SOFTCAP * tanh
    if PROFILE == 1:
        return _dot(qk.to(v.dtype), v, acc), l_i, m_i
    if MASK:
        vis = ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            vis = vis & (pos[:, None] - keys[None, :] <= window)
        if ROWS_ALIKE or POISON_K or not CLEAN:
            qk = tl.where(vis, qk * qk_scale, float("-inf"))
        else:  # K and V tiles differ in shape: non-finite V entries out of the dot, their keys NaN
            finite = tl.abs(v) < float("inf")  # False for NaN too
            v = tl.where(finite, v, 0.0)
            key_bad = tl.max(tl.where(finite, 0, 1), 1)
            if SCALE_MODE == 1:  # a non-finite V scale: as a non-finite V entry
                vs_ok = tl.abs(vs) < float("inf")
                vs = tl.where(vs_ok, vs, 0.0)
                key_bad = tl.where(vs_ok, key_bad, 1)
            qk = tl.where(key_bad[None, :] == 0, qk * qk_scale, float("nan"))
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        x = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        x = qk * qk_scale - m_new[:, None]
    if EXP_BF16:
        p = tl.inline_asm_elementwise(
            "ex2.approx.ftz.bf16x2 $0, $1;",
            "=r,r",
            [x.to(tl.bfloat16)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=2,
        )
        p_sum = tl.sum(p.to(tl.float32), 1)
    else:
        p = tl.exp2(x)
        p_sum = tl.sum(p, 1)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_sum
    acc = acc * alpha[:, None]
    if PROFILE != 2:
        if SCALE_MODE == 1:  # V's per-token scales on P's columns (fp32), then P @ codes
            acc = _pv_token_scaled(p.to(tl.float32) * vs[None, :], v, acc)
        else:
            acc = _dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _pv_token_scaled(pv, v, acc):
    """``acc + pv @ v`` for ``pv [M, N]`` (P times V's per-token scales, fp32) and ``v [N, DV]`` (codes
    in the dot's dtype), accumulated in fp32. fp16 codes: ``pv`` in fp16 would lose bits below 2^-14
    and vanish below 2^-24 (small scales: a cache of small V values), so each row is taken relative to
    its largest finite entry, a power of two ``2^e`` taken out of the dot and put back on the row
    (exact). A key a row may not see has ``P = 0`` there and so leaves that row's ``2^e`` alone."""
    if v.dtype == tl.float16:
        top = tl.max(tl.where(tl.abs(pv) < float("inf"), tl.abs(pv), 0.0), 1)  # [M]
        bits = top.to(tl.int32, bitcast=True) & 0x7F800000
        bits = tl.where(bits > 0, bits, 127 << 23)  # a zero or subnormal row: as it is
        unit = bits.to(tl.float32, bitcast=True)  # 2^e
        inv = ((254 << 23) - bits).to(tl.float32, bitcast=True)  # 2^-e
        out = _dot((pv * inv[:, None]).to(v.dtype), v, acc * inv[:, None]) * unit[:, None]
    else:
        out = _dot(pv.to(v.dtype), v, acc)
    return out


@triton.jit
def _tile_key_rows(
    acc, l_i, m_i, qt, K, V, k_desc, v_desc, s, page, slot, ok, lo_key, kv_len, qk_scale,
    stride_kp, stride_kr, stride_vp, stride_vr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
    KS=None, VS=None, stride_ksp=0, stride_ksr=0, stride_vsp=0, stride_vsr=0,
    KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0, F16_CODES: tl.constexpr = 0,
):  # fmt: skip
    """Decode's key tile ``[s, s + BLOCK_N)`` with the keys as the dots' rows: ``S^T = K q^T``
    (``[BLOCK_N, BLOCK_H]``) and ``acc^T [BLOCK_DV, BLOCK_H] += V^T P^T``; ``qt`` is ``q^T [BLOCK_DQK,
    BLOCK_H]``, ``m_i`` ``[BLOCK_H]``. The same arithmetic as :func:`_tile` with ``ROWS_ALIKE`` (every
    row of a decode query sees the same keys), laid out for a small group of query heads: the 64-key
    tile fills the tensor cores' 16-row side instead of 4 query heads padded to 16, so each dot takes a
    quarter of the MMAs, and the cache codes convert into the dots' A operand without the query's
    operand being read again from shared memory every tile (sm_90 offline: 376 against 626
    instructions per 64-key tile of an e4m3 cache, benchmarks/NOTES.md).

    ``l_i`` is ``[BLOCK_N, BLOCK_H]``: each key slot's share of the softmax sum, added up once after the
    key loops (a sum over the keys each tile is a reduction across warps: shared memory and barriers).

    Masked keys (outside ``[lo_key, kv_len)``, absent pages) are loaded as zeros and score ``-inf``:
    they contribute exactly nothing. Per-token V scales under fp16 codes: the running maximum ``m``
    is that of ``score + log2 |v_scale|``, so ``P^T * v_scale = 2^(score + log2 |v_scale| - m)`` is at
    most 1 in every column and keeps fp16's precision however small the scales are."""
    keys = s + tl.arange(0, BLOCK_N)
    if MASK:
        ok = ok & (keys >= lo_key) & (keys < kv_len)
    if USE_TMA:  # an absent page (-1) reads page 0 instead, and everything read from it is masked
        row = (tl.maximum(page, 0) * BS + s % BS).to(tl.int32)
        k = k_desc.load([row, 0])
        v = v_desc.load([row, 0])
        if MASK:
            k = tl.where(ok[:, None], k, 0.0)
            v = tl.where(ok[:, None], v, 0.0)
    else:
        k, v = _load_kv_tile(
            K, V, page, slot, ok, stride_kp, stride_kr, stride_vp, stride_vr,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N, BS, KV_CODE,
        )  # fmt: skip
        if KV_CODE != 0:
            if F16_CODES == 3:  # fp16, converted where loaded (GPU only)
                k = _e4m3_as_f16_in_place(k)
                v = _e4m3_as_f16_in_place(v)
            else:
                k = _codes(k, qt.dtype, KV_CODE)
                v = _codes(v, qt.dtype, KV_CODE)
    if SCALE_MODE == 1:  # per-token scales, loaded like the keys' codes (page: a scalar or per key)
        if BS % BLOCK_N == 0 and not MASK:  # one page, every key loaded: unmasked vector loads
            # (an absent page reads page 0's scales, zeroed below like its codes' scores)
            slot = tl.multiple_of(s % BS, BLOCK_N) + tl.arange(0, BLOCK_N)
            pg = tl.maximum(page, 0)
            ks = tl.where(ok, tl.load(KS + pg * stride_ksp + slot * stride_ksr), 0.0).to(tl.float32)
            vs = tl.where(ok, tl.load(VS + pg * stride_vsp + slot * stride_vsr), 0.0).to(tl.float32)
        else:
            ks = tl.load(KS + page * stride_ksp + slot * stride_ksr, mask=ok, other=0.0).to(tl.float32)
            vs = tl.load(VS + page * stride_vsp + slot * stride_vsr, mask=ok, other=0.0).to(tl.float32)
    st = _dot(k, qt, None)
    if SCALE_MODE == 1:  # a non-finite K scale scores NaN (an infinite one times q.k could read -inf)
        st = st * tl.where(tl.abs(ks) < float("inf"), ks, float("nan"))[:, None]
    if SOFTCAP != 0.0:  # soft-capping: qk_scale is scale / cap, SOFTCAP is cap * log2(e)
        st = _tanh(st * qk_scale) * (SOFTCAP / qk_scale)
    if MASK:
        st = tl.where(ok[:, None], st * qk_scale, float("-inf"))
    else:
        st = st * qk_scale
    if SCALE_MODE == 1 and v.dtype == tl.float16:
        # fp16 P^T * v_scale: the running maximum is taken over score + log2 |v_scale| (clamped at -64),
        # so each column's largest P^T * v_scale is 1 (fp16 keeps its bits) and no reduction over the
        # scales is needed; the sum l then holds 2^(s - m) <= 2^64, in fp32
        if F16_CODES == 3:  # inline PTX already (GPU only): one lg2.approx (2^-22 absolute error) instead
            # of the accurate log2's polynomial (24 FFMAs per tile and thread)
            lv = tl.inline_asm_elementwise(
                "lg2.approx.f32 $0, $1;", "=r,r", [tl.abs(vs)], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            lv = tl.log2(tl.abs(vs))
        lv = tl.maximum(lv, -64.0)
        t = st + lv[:, None]
        m_new = tl.maximum(m_i, tl.max(t, 0))
        p = tl.exp2(st - m_new[None, :])
        pv = tl.exp2(t - m_new[None, :])
        pv = tl.where(vs[:, None] < 0, -pv, pv).to(v.dtype)
    else:
        m_new = tl.maximum(m_i, tl.max(st, 0))
        p = tl.exp2(st - m_new[None, :])
        if SCALE_MODE == 1:
            pv = (p * vs[:, None]).to(v.dtype)
        else:
            pv = p.to(v.dtype)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha[None, :] + p  # [BLOCK_N, BLOCK_H]: summed once after the key loops
    acc = _dot(tl.trans(v), pv, acc * alpha[None, :])
    return acc, l_i, m_new


@triton.jit
def _attend(
    acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, req,
    start, stop, pos, lo_key, kv_len, window, qk_scale,
    stride_kp, stride_kr, stride_vp, stride_vr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, HKV: tl.constexpr, HEADWISE: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_TMA: tl.constexpr, CHUNK: tl.constexpr,
    EXP_BF16: tl.constexpr = False, PROFILE: tl.constexpr = 0, PAGE_H: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, HAS_ERR: tl.constexpr = False, KERNEL: tl.constexpr = 0,
    ROWS_ALIKE: tl.constexpr = False,
    KS=None, VS=None, stride_ksp=0, stride_ksr=0, stride_vsp=0, stride_vsr=0,
    KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0, F16_CODES: tl.constexpr = 0,
    CLEAN: tl.constexpr = True, KEY_ROWS: tl.constexpr = False,
):  # fmt: skip
    """Online softmax over key tiles ``[start, stop)``; ``KEY_ROWS`` (decode): :func:`_tile_key_rows`'s
    layout (``q`` is then ``q^T``, ``acc`` ``acc^T``); ``pos [M]`` are the rows' positions (all the
    same with ``ROWS_ALIKE``: a decode query's group heads, see ``_tile``; ``CLEAN``: see ``_tile``).

    Table entries of keys in ``[lo_key, kv_len)`` must exist; entries outside the cache are never
    dereferenced (``_pages`` masks them). ``HAS_ERR``: ``bad`` carries the smallest logical block whose
    needed entry could not be used (``BAD_NONE`` if none); the kernel records it after the loop
    (recording inside the loop cost the prefill kernel ~8 %: benchmarks/NOTES.md).

    ``MASK=False`` is only used for tiles every row sees entirely (no mask, no predicated loads
    beyond the page check). Keys below ``lo_key`` or at/after ``kv_len`` are never loaded.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if BS % BLOCK_N == 0:  # every tile lies in one page
        offs_c = tl.arange(0, CHUNK)
        for c0 in range(start, stop, CHUNK * BLOCK_N):
            # the pages of CHUNK tiles, loaded up front: no key load waits on a table load, so the
            # compiler can pipeline the key loads several tiles deep
            tiles = c0 + offs_c * BLOCK_N
            need = (tiles < stop) & (tiles < kv_len) & (tiles + BLOCK_N > lo_key)
            pages = _pages(
                tbl_row, tiles // BS, n_blk, kvh, Err, n_pages, req, need,
                HKV, HEADWISE, PAGE_H, False, KERNEL,
            )  # fmt: skip
            if HAS_ERR:
                bad = tl.minimum(bad, tl.min(tl.where(need & (pages < 0), tiles // BS, BAD_NONE), 0))
            for s in range(c0, tl.minimum(c0 + CHUNK * BLOCK_N, stop), BLOCK_N):
                page = tl.sum(tl.where(offs_c == (s - c0) // BLOCK_N, pages, 0))
                ok = (page + offs_n * 0) >= 0  # a vector compare (the interpreter mis-splats scalar bools)
                if KEY_ROWS:
                    acc, l_i, m_i = _tile_key_rows(
                        acc, l_i, m_i, q, K, V, k_desc, v_desc, s, page, s % BS + offs_n, ok, lo_key, kv_len,
                        qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
                        BLOCK_N, BS, MASK, USE_TMA, SOFTCAP, KS, VS, stride_ksp, stride_ksr, stride_vsp,
                        stride_vsr, KV_CODE, SCALE_MODE, F16_CODES,
                    )  # fmt: skip
                else:
                    acc, l_i, m_i = _tile(
                        acc, l_i, m_i, q, K, V, k_desc, v_desc, s, page, s % BS + offs_n, ok, pos, lo_key,
                        kv_len, window, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV,
                        BLOCK_DQK, BLOCK_DV, BLOCK_N, BS, MASK, HAS_WINDOW, USE_TMA, EXP_BF16, PROFILE,
                        SOFTCAP, ROWS_ALIKE, KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
                        KV_CODE, SCALE_MODE, F16_CODES, CLEAN,
                    )  # fmt: skip
    else:  # a tile spans several pages: gather one page per key
        for s in range(start, stop, BLOCK_N):
            keys = s + offs_n
            need = (keys >= lo_key) & (keys < kv_len)
            page = _pages(
                tbl_row, keys // BS, n_blk, kvh, Err, n_pages, req, need,
                HKV, HEADWISE, PAGE_H, False, KERNEL,
            )  # fmt: skip
            if HAS_ERR:
                bad = tl.minimum(bad, tl.min(tl.where(need & (page < 0), keys // BS, BAD_NONE), 0))
            if KEY_ROWS:
                acc, l_i, m_i = _tile_key_rows(
                    acc, l_i, m_i, q, K, V, k_desc, v_desc, s, page, keys % BS, page >= 0, lo_key, kv_len,
                    qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
                    BLOCK_N, BS, MASK, False, SOFTCAP, KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
                    KV_CODE, SCALE_MODE, F16_CODES,
                )  # fmt: skip
            else:
                acc, l_i, m_i = _tile(
                    acc, l_i, m_i, q, K, V, k_desc, v_desc, s, page, keys % BS, page >= 0, pos, lo_key,
                    kv_len, window, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV,
                    BLOCK_DQK, BLOCK_DV, BLOCK_N, BS, MASK, HAS_WINDOW, False, EXP_BF16, PROFILE,
                    SOFTCAP, ROWS_ALIKE, KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
                    KV_CODE, SCALE_MODE, F16_CODES, CLEAN,
                )  # fmt: skip
    return acc, l_i, m_i, bad


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one ``exp2`` of ``-2|x|``: no overflow for any ``x`` (the interpreter has no tanh)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|) in (0, 1]
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _init_state(Sinks, head, M: tl.constexpr, SINK_MODE: tl.constexpr):
    """Online-softmax state ``(m, l)`` in base 2: the sink as the first logit, or empty."""
    if SINK_MODE == 1:
        m = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        l = tl.full([M], 1.0, tl.float32)
    elif SINK_MODE == 2:
        m = tl.zeros([M], tl.float32)
        l = tl.full([M], 1.0, tl.float32)
    else:
        m = tl.full([M], -1.0e30, tl.float32)  # finite: alpha = exp2(m - m_new) stays 1, never NaN
        l = tl.zeros([M], tl.float32)
    return m, l


@triton.jit
def _head_window(kvh, window, win_h0, win_h1, HAS_WINDOW: tl.constexpr):
    """``window_left`` of kv head ``kvh``: ``window`` inside ``[win_h0, win_h1)``, else far."""
    if HAS_WINDOW:
        w = tl.where((kvh >= win_h0) & (kvh < win_h1), window, 1 << 30)
    else:
        w = 1 << 30
    return w


@triton.jit
def _prefill_keys(
    q, K, V, k_desc, v_desc, Sinks, head, tbl_row, n_blk, kvh, Err, n_pages, b, a, ul, uh, p_last, pos,
    lo_key, kv_len, w, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr,
    KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NM: tl.constexpr, BS: tl.constexpr,
    HKV: tl.constexpr, HEADWISE: tl.constexpr, HAS_WINDOW: tl.constexpr, SINK_MODE: tl.constexpr,
    USE_TMA: tl.constexpr, EXP_BF16: tl.constexpr, PROFILE: tl.constexpr, PAGE_H: tl.constexpr,
    SOFTCAP: tl.constexpr, ERR: tl.constexpr, KV_CODE: tl.constexpr, SCALE_MODE: tl.constexpr,
    F16_CODES: tl.constexpr, CLEAN: tl.constexpr,
):  # fmt: skip
    """One prefill program's keys from the sink state: the masked tiles ``[a, ul)`` (the window's left
    edge), the tiles every row sees ``[ul, uh)``, the masked tiles ``[uh, p_last]`` (the causal
    diagonal); ``(acc [BLOCK_M, BLOCK_DV], l_i, m_i, bad)``. ``CLEAN``: ``_tile``'s."""
    m_i, l_i = _init_state(Sinks, head, BLOCK_M, SINK_MODE)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    bad = tl.full([], BAD_NONE, tl.int32)  # ERR: smallest logical block with an unusable entry
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        a, ul, pos, lo_key, kv_len, w,
        qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_NM, BS, HKV, HEADWISE, True, HAS_WINDOW, USE_TMA, PAGE_CHUNK, EXP_BF16, PROFILE, PAGE_H,
        SOFTCAP, ERR, KERNEL_PREFILL, False,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, CLEAN,
    )  # fmt: skip
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        ul, uh, pos, lo_key, kv_len, w,
        qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_N, BS, HKV, HEADWISE, False, HAS_WINDOW, USE_TMA, PAGE_CHUNK, EXP_BF16, PROFILE, PAGE_H,
        SOFTCAP, ERR, KERNEL_PREFILL, False,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, CLEAN,
    )  # fmt: skip
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        uh, p_last + 1, pos, lo_key, kv_len, w,
        qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_NM, BS, HKV, HEADWISE, True, HAS_WINDOW, USE_TMA, PAGE_CHUNK, EXP_BF16, PROFILE, PAGE_H,
        SOFTCAP, ERR, KERNEL_PREFILL, False,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, CLEAN,
    )  # fmt: skip
    return acc, l_i, m_i, bad


@triton.jit
def _prefill_program(
    pid, Q, K, V, O, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl, Err, Redo,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kr, stride_vp, stride_vr, stride_tbl, n_blk, n_pages, n_tok,
    num_reqs, min_q_len, qk_scale, window, win_h0, win_h1,
    KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    G: tl.constexpr, GP: tl.constexpr, HKV: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
    HEADWISE: tl.constexpr, HAS_WINDOW: tl.constexpr, SINK_MODE: tl.constexpr, USE_TMA: tl.constexpr,
    EXP_BF16: tl.constexpr = False, PROFILE: tl.constexpr = 0, PAGE_H: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, HAS_ERR: tl.constexpr = False, ERR_LOOP: tl.constexpr = True,
    KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0, BLOCK_NM: tl.constexpr = 16,
    F16_CODES: tl.constexpr = 0, SAFE: tl.constexpr = False,
):  # fmt: skip
    """Program ``pid`` of the prefill launch (a tile of ``BLOCK_Q`` query tokens of one request, kv head;
    ``_prefill_kernel``); ``SAFE``: the masked tiles cleaned, else ``Redo[pid]`` written."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    kvh = pid % HKV
    tpid = pid // HKV
    # request b owns tile ids [CuQ[b] // BLOCK_Q + b, ...): the largest b whose first id <= tpid
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CuQ + mid) // BLOCK_Q + mid <= tpid:
            lo = mid
        else:
            hi = mid - 1
    b = lo
    q0 = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q0
    n_tiles = tl.cdiv(q_len, BLOCK_Q)
    local = tpid - (q0 // BLOCK_Q + b)
    if (local >= n_tiles) | (q_len < min_q_len):
        if not SAFE:
            tl.store(Redo + pid, 0)  # nothing for the safe launch to do here
        return
    tile = n_tiles - 1 - local  # longest tiles first: less tail
    ctx = tl.load(Ctx + b)
    kv_len = ctx + q_len
    tok0 = tile * BLOCK_Q

    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // GP
    hh = offs_m % GP
    row_ok = (tok < q_len) & (hh < G) & (q0 + tok >= 0) & (q0 + tok < n_tok)  # rows inside q / out
    head = kvh * G + hh
    pos = ctx + tok
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q0 + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_mask = row_ok[:, None] & (offs_dk[None, :] < DQK)
    q = tl.load(Q + q_rows[:, None] + offs_dk[None, :], mask=q_mask, other=0.0)
    q = _fold_k_scale(q, KS, kvh, offs_dk, DQK, SCALE_MODE)
    q, qk_scale = _q_for_codes(q, qk_scale, F16_CODES)

    w = _head_window(kvh, window, win_h0, win_h1, HAS_WINDOW)
    p_first = ctx + tok0
    p_last = ctx + tl.minimum(tok0 + BLOCK_Q, q_len) - 1
    lo_key = tl.maximum(p_first - w, 0)
    a = lo_key // BLOCK_N * BLOCK_N
    ul = tl.maximum(tl.cdiv(tl.maximum(p_last - w, 0), BLOCK_N) * BLOCK_N, a)  # every row sees [ul, uh)
    uh = tl.maximum((p_first + 1) // BLOCK_N * BLOCK_N, ul)

    tbl_row = Tbl + (b * HKV + kvh if HEADWISE else b) * stride_tbl
    acc, l_i, m_i, bad = _prefill_keys(
        q, K, V, k_desc, v_desc, Sinks, head, tbl_row, n_blk, kvh, Err, n_pages, b, a, ul, uh, p_last, pos,
        lo_key, kv_len, w, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
        DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_NM, BS, HKV, HEADWISE, HAS_WINDOW, SINK_MODE,
        USE_TMA, EXP_BF16, PROFILE, PAGE_H, SOFTCAP, HAS_ERR & ERR_LOOP, KV_CODE, SCALE_MODE, F16_CODES, SAFE,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not SAFE:  # a row's sum is NaN or Inf when one of its entries is (and x - x is then NaN)
        rs = tl.sum(o, 1)
        tl.store(Redo + pid, tl.max(tl.where(row_ok & (rs - rs != 0), 1, 0), 0))
    if HAS_ERR & ERR_LOOP:  # after the key loop: the first bad block it met, read again and recorded
        if bad < BAD_NONE:
            _scan_table(
                Err, tbl_row, n_blk, n_pages, b, kvh, bad * BS, bad * BS + 1, BS, HEADWISE, KERNEL_PREFILL
            )
    elif HAS_ERR:  # one scan of the table entries of the keys these rows see
        _scan_table(Err, tbl_row, n_blk, n_pages, b, kvh, lo_key, p_last + 1, BS, HEADWISE, KERNEL_PREFILL)
    out = _apply_v_scale(o, VS, kvh, offs_dv, DV, SCALE_MODE)
    o_rows = (q0 + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        O + o_rows[:, None] + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )


@triton.jit(do_not_specialize=["stride_tbl", "n_blk", "n_pages", "n_tok", "num_reqs"])
def _prefill_kernel(
    Q, K, V, O, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl, Err, Redo,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kr, stride_vp, stride_vr, stride_tbl, n_blk, n_pages, n_tok,
    num_reqs, min_q_len, qk_scale, window, win_h0, win_h1,
    KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    G: tl.constexpr, GP: tl.constexpr, HKV: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
    HEADWISE: tl.constexpr, HAS_WINDOW: tl.constexpr, SINK_MODE: tl.constexpr, USE_TMA: tl.constexpr,
    EXP_BF16: tl.constexpr = False, PROFILE: tl.constexpr = 0, PAGE_H: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, HAS_ERR: tl.constexpr = False, ERR_LOOP: tl.constexpr = True,
    KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0, BLOCK_NM: tl.constexpr = 16,
    F16_CODES: tl.constexpr = 0, SAFE: tl.constexpr = False,
):  # fmt: skip
    """One (tile of ``BLOCK_Q`` query tokens of one request, kv head). ``KV_CODE`` / ``SCALE_MODE``: a
    quantized cache (``_tile``; static scales: K's folded into q, V's applied to the output).

    Masked keys contribute exactly nothing (docs/semantics.md) in two launches. The fast one walks
    the keys without cleaning the masked tiles (``_prefill_keys(CLEAN=False)``) and writes ``Redo[pid]``:
    1 if one of its output rows came out NaN or Inf (a non-finite V at a key a row may not see does
    that), else 0. In the safe one (``SAFE``) only those programs walk the keys again, cleaning the
    masked tiles, on the same tiles in the same order (the other rows keep their bits). The safe walk
    is a kernel of its own (compiled into the fast one, it cost the portable prefill 15-18 %, H100) on
    a grid of at most ``SAFE_GRID`` programs, each striding over the fast launch's ``Redo`` (one program
    per fast one, the grid of the fast launch, cost 2-3 % in wave start-ups alone).

    ``BLOCK_NM``: keys per tile in the masked loops (the causal diagonal, the window's left edge; a
    divisor of ``BLOCK_N``, >= 16: ``paged_attention.masked_block_n``), in both walks. Keeping masked
    keys out (``_tile``) holds K and V tiles in registers there; at full width that pushed the whole
    kernel to 255 registers with spills (+15 % time on an H100), at half width it compiles without
    (benchmarks/NOTES.md)."""
    if SAFE:  # a few programs walk the fast launch's flags (one vector load each when none is set)
        n_prog = (n_tok // BLOCK_Q + num_reqs) * HKV  # the fast launch's grid
        step = tl.num_programs(0)
        for c0 in range(tl.program_id(0), n_prog, step * SAFE_CHUNK):
            pids = c0 + step * tl.arange(0, SAFE_CHUNK)
            if tl.max(tl.load(Redo + pids, mask=pids < n_prog, other=0), 0) != 0:
                for k in range(SAFE_CHUNK):
                    pid = c0 + step * k
                    if tl.load(Redo + pid, mask=pid < n_prog, other=0) != 0:
                        _prefill_program(
                            pid, Q, K, V, O, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl, Err, Redo, stride_qt,
                            stride_qh, stride_ot, stride_oh, stride_kp, stride_kr, stride_vp, stride_vr,
                            stride_tbl, n_blk, n_pages, n_tok, num_reqs, min_q_len, qk_scale, window, win_h0,
                            win_h1, KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, G, GP, HKV, DQK,
                            DV, BLOCK_DQK, BLOCK_DV, BLOCK_Q, BLOCK_N, BS, HEADWISE, HAS_WINDOW, SINK_MODE,
                            USE_TMA, EXP_BF16, PROFILE, PAGE_H, SOFTCAP, HAS_ERR, ERR_LOOP, KV_CODE,
                            SCALE_MODE, BLOCK_NM, F16_CODES, SAFE,
                        )  # fmt: skip
    else:
        _prefill_program(
            tl.program_id(0), Q, K, V, O, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl, Err, Redo, stride_qt,
            stride_qh, stride_ot, stride_oh, stride_kp, stride_kr, stride_vp, stride_vr, stride_tbl, n_blk,
            n_pages, n_tok, num_reqs, min_q_len, qk_scale, window, win_h0, win_h1, KS, VS, stride_ksp,
            stride_ksr, stride_vsp, stride_vsr, G, GP, HKV, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_Q, BLOCK_N,
            BS, HEADWISE, HAS_WINDOW, SINK_MODE, USE_TMA, EXP_BF16, PROFILE, PAGE_H, SOFTCAP, HAS_ERR,
            ERR_LOOP, KV_CODE, SCALE_MODE, BLOCK_NM, F16_CODES, SAFE,
        )  # fmt: skip


@triton.jit
def _write_and_attend_new(
    acc, l_i, m_i, Q, q_rows, q_mask, K, V, Kn, Vn, tbl_row, n_blk, kvh, Err, n_pages, req, q0, pos,
    qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BS: tl.constexpr, HKV: tl.constexpr, HEADWISE: tl.constexpr, PAGE_H: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ERR: tl.constexpr,
):  # fmt: skip
    """The decode query's own key (position ``pos``, row ``q0`` of ``Kn`` / ``Vn``, kv head ``kvh``):
    written into its cache slot, then one more step of the online softmax. A table entry that may not
    be dereferenced is recorded as the cache write's (``KERNEL_CACHE_WRITE``) and neither written
    through nor attended, as the separate write and decode kernels do. Called before the key loops,
    with the query rows loaded again (``Q + q_rows``, ``q_mask``): after the loops and on their ``q``,
    the kernel compiled to 168 registers with a stack frame instead of 252 and ran 20 % slower on the
    H200 (``benchmarks/NOTES.md``)."""
    blk = pos // BS + tl.arange(0, 2) * 0  # a vector (the interpreter mis-splats scalar bools)
    page = tl.max(
        _pages(tbl_row, blk, n_blk, kvh, Err, n_pages, req, blk >= 0, HKV, HEADWISE, PAGE_H, HAS_ERR,
               KERNEL_CACHE_WRITE),
        0,
    )  # fmt: skip
    if page >= 0:
        offs_dk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        row = q0.to(tl.int64)
        k = tl.load(Kn + row * stride_knt + kvh * stride_knh + offs_dk, mask=offs_dk < DQK, other=0.0)
        v = tl.load(Vn + row * stride_vnt + kvh * stride_vnh + offs_dv, mask=offs_dv < DV, other=0.0)
        k = k.to(K.dtype.element_ty)  # what the cache holds: the unfused decode reads it back as this
        v = v.to(V.dtype.element_ty)
        slot = pos % BS
        tl.store(K + page * stride_kp + slot * stride_kr + offs_dk, k, mask=offs_dk < DQK)
        tl.store(V + page * stride_vp + slot * stride_vr + offs_dv, v, mask=offs_dv < DV)
        q = tl.load(Q + q_rows, mask=q_mask, other=0.0)
        qk = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)
        if SOFTCAP != 0.0:  # as _tile: qk_scale is scale / cap, SOFTCAP is cap * log2(e)
            qk = _tanh(qk * qk_scale) * (SOFTCAP / qk_scale)
        s = qk * qk_scale
        m_new = tl.maximum(m_i, s)
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + p
        # P rounded to V's type as the tiles' P @ V takes it
        acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)[None, :]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_tbl", "n_blk", "n_pages", "n_tok"])
def _decode_kernel(
    Q, K, V, O, k_desc, v_desc, MidO, MidL, Sinks, CuQ, Ctx, Tbl, Err,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kr, stride_vp, stride_vr, stride_tbl, n_blk, n_pages, n_tok,
    qk_scale, window, win_h0, win_h1, Kn, Vn, stride_knt, stride_knh, stride_vnt, stride_vnh,
    KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    G: tl.constexpr, BLOCK_H: tl.constexpr, HKV: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr, HEADWISE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SINK_MODE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_TMA: tl.constexpr, PAGE_H: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0, HAS_ERR: tl.constexpr = False, ERR_LOOP: tl.constexpr = True,
    FUSE_WRITE: tl.constexpr = False, KV_CODE: tl.constexpr = 0, SCALE_MODE: tl.constexpr = 0,
    F16_CODES: tl.constexpr = 0, KEY_ROWS: tl.constexpr = False,
):  # fmt: skip
    """One (request, kv head, split) of a decode step. ``FUSE_WRITE``: the step's own K/V (row ``q0``
    of ``Kn [T, Hkv, Dqk]`` / ``Vn [T, Hkv, Dv]``) are not in the cache yet: the split holding the
    query's position writes them there (as ``_write_kv_kernel`` would) and attends them from
    registers, every other key comes from the cache (no program reads the slot being written).
    ``KV_CODE`` / ``SCALE_MODE``: a quantized cache, as in ``_prefill_kernel`` (never with
    ``FUSE_WRITE``: the plan refuses it). ``KEY_ROWS``: the key tiles as the dots' rows
    (:func:`_tile_key_rows`; never with ``FUSE_WRITE``)."""
    tl.static_assert(not (KEY_ROWS and FUSE_WRITE), "KEY_ROWS does not fuse the cache write")
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q0 = tl.load(CuQ + b)
    if (tl.load(CuQ + b + 1) - q0 != 1) | (q0 < 0) | (q0 >= n_tok):  # not a decode row inside q / out
        return
    pos = tl.load(Ctx + b)  # the query's position; it sees keys [lo_key, pos]
    kv_len = pos + 1
    w = _head_window(kvh, window, win_h0, win_h1, HAS_WINDOW)
    lo_key = tl.maximum(pos - w, 0)
    t0 = lo_key // BLOCK_N
    per = tl.cdiv(tl.cdiv(kv_len, BLOCK_N) - t0, NUM_SPLITS)
    start = (t0 + split * per) * BLOCK_N
    stop = tl.minimum((t0 + split * per + per) * BLOCK_N, kv_len)
    has_new = False
    if FUSE_WRITE:  # the cache holds keys [lo_key, pos); the key at pos comes from Kn / Vn below
        has_new = (start <= pos) & (pos < stop)
        kv_len = pos
        stop = tl.minimum(stop, kv_len)
    ul = tl.maximum(start, tl.cdiv(lo_key, BLOCK_N) * BLOCK_N)  # whole tiles in [ul, uh) need no mask
    uh = tl.maximum(stop // BLOCK_N * BLOCK_N, ul)

    offs_h = tl.arange(0, BLOCK_H)
    row_ok = offs_h < G
    head = kvh * G + offs_h
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q0.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_dk[None, :]
    q_mask = row_ok[:, None] & (offs_dk[None, :] < DQK)
    q = _fold_k_scale(tl.load(Q + q_rows, mask=q_mask, other=0.0), KS, kvh, offs_dk, DQK, SCALE_MODE)
    q, qk_scale = _q_for_codes(q, qk_scale, F16_CODES)
    posv = tl.full([BLOCK_H], 0, tl.int32) + pos
    if NUM_SPLITS == 1:
        m_i, l_i = _init_state(Sinks, head, BLOCK_H, SINK_MODE)
    else:  # the sink joins once, in the reduce
        m_i, l_i = _init_state(Sinks, head, BLOCK_H, 0)
    if KEY_ROWS:  # q^T, acc^T and l per key slot: see _tile_key_rows
        q = tl.trans(q)
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
        l_i = tl.where(tl.arange(0, BLOCK_N)[:, None] == 0, l_i[None, :], 0.0)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    bad = tl.full([], BAD_NONE, tl.int32)  # HAS_ERR: smallest logical block with an unusable entry
    tbl_row = Tbl + (b * HKV + kvh if HEADWISE else b) * stride_tbl
    if FUSE_WRITE:  # the new key first: the key loops below stay as without it
        if has_new:
            acc, l_i, m_i = _write_and_attend_new(
                acc, l_i, m_i, Q, q_rows, q_mask, K, V, Kn, Vn, tbl_row, n_blk, kvh, Err, n_pages, b, q0, pos,
                qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, stride_knt, stride_knh, stride_vnt,
                stride_vnh, DQK, DV, BLOCK_DQK, BLOCK_DV, BS, HKV, HEADWISE, PAGE_H, SOFTCAP, HAS_ERR,
            )  # fmt: skip
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        start, ul, posv, lo_key, kv_len,
        w, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_N, BS, HKV, HEADWISE, True, HAS_WINDOW, USE_TMA, PAGE_CHUNK, False, 0, PAGE_H,
        SOFTCAP, HAS_ERR & ERR_LOOP, KERNEL_DECODE, True,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, True,
        KEY_ROWS,
    )  # fmt: skip
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        ul, uh, posv, lo_key, kv_len,
        w, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_N, BS, HKV, HEADWISE, False, HAS_WINDOW, USE_TMA, PAGE_CHUNK, False, 0, PAGE_H,
        SOFTCAP, HAS_ERR & ERR_LOOP, KERNEL_DECODE, True,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, True,
        KEY_ROWS,
    )  # fmt: skip
    acc, l_i, m_i, bad = _attend(
        acc, l_i, m_i, bad, q, K, V, k_desc, v_desc, tbl_row, n_blk, kvh, Err, n_pages, b,
        uh, stop, posv, lo_key, kv_len,
        w, qk_scale, stride_kp, stride_kr, stride_vp, stride_vr, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_N, BS, HKV, HEADWISE, True, HAS_WINDOW, USE_TMA, PAGE_CHUNK, False, 0, PAGE_H,
        SOFTCAP, HAS_ERR & ERR_LOOP, KERNEL_DECODE, True,
        KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr, KV_CODE, SCALE_MODE, F16_CODES, True,
        KEY_ROWS,
    )  # fmt: skip
    if HAS_ERR & ERR_LOOP:  # after the key loop: the first bad block it met, read again and recorded
        if bad < BAD_NONE:
            _scan_table(
                Err, tbl_row, n_blk, n_pages, b, kvh, bad * BS, bad * BS + 1, BS, HEADWISE, KERNEL_DECODE
            )
    elif HAS_ERR:  # one scan of the table entries of this split's visible keys
        _scan_table(
            Err, tbl_row, n_blk, n_pages, b, kvh, tl.maximum(start, lo_key), stop, BS, HEADWISE, KERNEL_DECODE
        )
    if KEY_ROWS:
        acc = tl.trans(acc)
        l_i = tl.sum(l_i, 0)
    out = _apply_v_scale(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], VS, kvh, offs_dv, DV, SCALE_MODE)
    dv_ok = offs_dv[None, :] < DV
    if NUM_SPLITS == 1:
        o_ptr = O + q0.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
    else:  # partial result of this split: normalised output and its base-2 log-sum-exp
        mid = (b * HKV * G + head) * NUM_SPLITS + split
        tl.store(MidO + mid[:, None] * DV + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(MidL + mid, lse, mask=row_ok)
