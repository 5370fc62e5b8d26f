"""Hopper (sm_90) prefill attention over the paged cache, FA3-style, in Gluon.

Same contract as the prefill half of :func:`.paged_attention.paged_attention` (packed requests with
context in the cache, GQA packing, sliding windows that skip whole key tiles, head-wise windows and
tables, sinks, ``Dqk != Dv``); the portable Triton kernel stays the path for every other GPU and for
the interpreter. :func:`supported` says when this path applies; the caller falls back otherwise.

Structure (one CTA per (tile of ``2 * BLOCK_Q`` query tokens of one request, kv head)):

* a **producer** warpgroup (4 warps, few registers) walks the block table and streams K/V tiles of
  ``BLOCK_N`` keys into a ``NUM_STAGES``-deep shared-memory ring by TMA, one ``[box, 64]`` copy per
  page and 64-column chunk (the cache viewed as ``[pages * block_size, D]``), completing on
  ``k_ready`` / ``v_ready`` mbarriers. A tile whose keys run past the sequence end or into an absent
  page (``-1``) gets its V rows by plain loads instead, the invalid rows zero-filled (stale slots
  may hold NaN and ``0 * NaN`` would poison ``P @ V``);
* two **consumer** warpgroups own 64-row halves of the query rows (tokens x padded group heads) and
  run the online softmax against their own wgmma's: ``S(j) = Q K(j)^T`` is issued before
  ``O += P(j-1) V(j-1)``, so the softmax of tile ``j`` runs while the tensor cores finish the
  previous ``P @ V`` (wgmma groups retire in order); the two warpgroups interleave on the tensor
  cores on their own. An enforced ping-pong (``pingpong=True``: each warpgroup issues its wgmma's
  only after the other issued its own, through two mbarriers) measured 10 % slower on the H200
  (benchmarks/NOTES.md) and is off. Each consumer frees a ring slot (``k_empty`` / ``v_empty``,
  two arrivals) as soon as its wgmma's have read it.

Masks: a tile gets the mask only when it touches the causal diagonal or the window's leading edge
of that consumer's rows (a runtime branch); tiles wholly outside every row's window are never
loaded. Scores run in base 2 (``qk_scale`` folds ``log2(e)``); sinks enter as the initial softmax
state, as in the portable kernel.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

try:  # Gluon exists in Triton >= 3.5; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper as gh
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_IMPORT_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any failure means: no Hopper path
    GLUON_IMPORT_ERROR = e

CHUNK = 64  # columns per TMA copy (128 B rows with 128-byte swizzle)


def gluon_available() -> bool:
    """Whether ``triton.experimental.gluon`` (with the Hopper ops) imported."""
    return GLUON_IMPORT_ERROR is None


@functools.lru_cache(maxsize=8)
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.x."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def block_n_for(dqk: int, dv: int, block_size: int) -> int:
    """Keys per tile: 128 (64 when a head dim exceeds 128: shared memory), at most one box per page
    row count multiple."""
    return 128 if max(dqk, dv) <= 128 else 64


def supported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """``None`` when the Hopper kernel can run these inputs, else the reason it cannot."""
    if not gluon_available():
        return f"gluon unavailable ({GLUON_IMPORT_ERROR!r})"
    if not q.is_cuda or not is_hopper(q.device):
        return "not an sm_90 GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    dqk, dv, bs = q.shape[2], value_cache.shape[3], key_cache.shape[2]
    if dqk not in (64, 128, 256) or dv not in (64, 128, 256):
        return f"head dims {dqk}/{dv} (64, 128 or 256 each)"
    if bs < 16 or bs & (bs - 1):
        return f"block size {bs} (a power of two >= 16)"
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        s = c.stride()
        if s[3] != 1 or s[1] != c.shape[2] * s[2] or s[0] != c.shape[1] * s[1]:
            return f"{name} strides {s} (rows of one page must be evenly spaced across pages)"
        if (s[2] * c.element_size()) % 16 or c.data_ptr() % 16:
            return f"{name} rows not 16-byte aligned"
    return None


def choose_prefill_impl(
    impl: str | None,
    prefill_config: object,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> str:
    """``"hopper"`` or ``"portable"``: ``impl`` if given, else ``FDFLEET_PREFILL_KERNEL``; ``auto`` picks
    the Hopper kernel when :func:`supported` and no portable ``prefill_config`` was asked for.
    ``hopper`` on inputs it cannot run raises ``ValueError`` with the reason."""
    from .. import envs

    choice = impl if impl is not None else envs.prefill_kernel()
    if choice not in envs.PREFILL_KERNELS:
        raise ValueError(f"prefill_impl must be one of {envs.PREFILL_KERNELS}, got {choice!r}")
    if choice == "portable" or (choice == "auto" and prefill_config is not None):
        return "portable"
    why = supported(q, key_cache, value_cache)
    if why is None:
        return "hopper"
    if choice == "hopper":
        raise ValueError(f"the hopper prefill kernel cannot run these inputs: {why}")
    return "portable"


if GLUON_IMPORT_ERROR is None:
    CHUNK_C = gl.constexpr(CHUNK)

    @gluon.jit
    def _producer(
        k_desc, v_desc, V, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
        tbl_row, n_blk, kvh, a, n_tiles, kv_len, stride_vr,
        HKV: gl.constexpr, HEADWISE: gl.constexpr, BS: gl.constexpr, BLOCK_N: gl.constexpr,
        BOX: gl.constexpr, DQK: gl.constexpr, DV: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        NBOX: gl.constexpr = BLOCK_N // BOX
        K_BYTES: gl.constexpr = BLOCK_N * DQK * k_desc.dtype.primitive_bitwidth // 8
        V_BYTES: gl.constexpr = BLOCK_N * DV * v_desc.dtype.primitive_bitwidth // 8
        FIX_ROWS: gl.constexpr = 16
        fix_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_r = gl.arange(0, FIX_ROWS, layout=gl.SliceLayout(1, fix_layout))
        offs_d = gl.arange(0, DV, layout=gl.SliceLayout(0, fix_layout))
        for j in range(n_tiles):
            s = j % NUM_STAGES
            phase = (j // NUM_STAGES) & 1
            key0 = a + j * BLOCK_N
            # K: one copy per page box and 64-column chunk (absent pages read page 0: masked)
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), K_BYTES)
            kb = k_bufs.index(s)
            absent = False
            for i in gl.static_range(NBOX):
                blk = (key0 + i * BOX) // BS
                page = gl.load(tbl_row + blk, mask=blk < n_blk, other=-1).to(gl.int64)
                if not HEADWISE:
                    page = gl.where(page >= 0, page * HKV + kvh, -1)
                absent = absent | (page < 0)
                row = (gl.maximum(page, 0) * BS + (key0 + i * BOX) % BS).to(gl.int32)
                for c in gl.static_range(DQK // CHUNK_C):
                    tma.async_copy_global_to_shared(
                        k_desc, [row, c * CHUNK_C], k_ready.index(s),
                        kb.slice(i * BOX, BOX, dim=0).slice(c * CHUNK_C, CHUNK_C, dim=1),
                    )  # fmt: skip
            mbarrier.wait(v_empty.index(s), phase)
            vb = v_bufs.index(s)
            if absent | (key0 + BLOCK_N > kv_len):
                # plain loads with the invalid rows zeroed, then publish to the async proxy
                for r0 in gl.static_range(0, BLOCK_N, FIX_ROWS):
                    keys = key0 + r0 + offs_r
                    pg = gl.load(tbl_row + keys // BS, mask=keys // BS < n_blk, other=-1).to(gl.int64)
                    if not HEADWISE:
                        pg = gl.where(pg >= 0, pg * HKV + kvh, -1)
                    ok = (pg >= 0) & (keys < kv_len)
                    rows = (gl.maximum(pg, 0) * BS + keys % BS) * stride_vr
                    ptrs = V + gl.expand_dims(rows, 1) + gl.expand_dims(offs_d, 0)
                    vals = gl.load(ptrs, mask=gl.expand_dims(ok, 1), other=0.0)
                    vb.slice(r0, FIX_ROWS, dim=0).store(vals)
                gh.fence_async_shared()
                mbarrier.arrive(v_ready.index(s), count=1)
            else:
                mbarrier.expect(v_ready.index(s), V_BYTES)
                for i in gl.static_range(NBOX):
                    blk = (key0 + i * BOX) // BS
                    page = gl.load(tbl_row + blk).to(gl.int64)
                    if not HEADWISE:
                        page = page * HKV + kvh
                    row = (page * BS + (key0 + i * BOX) % BS).to(gl.int32)
                    for c in gl.static_range(DV // CHUNK_C):
                        tma.async_copy_global_to_shared(
                            v_desc, [row, c * CHUNK_C], v_ready.index(s),
                            vb.slice(i * BOX, BOX, dim=0).slice(c * CHUNK_C, CHUNK_C, dim=1),
                        )  # fmt: skip

    @gluon.jit
    def _consumer(
        Q, O, Sinks, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, other_turn,
        q0, tok0, q_len, ctx, kvh, w, a, n_tiles, qk_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        G: gl.constexpr, GP: gl.constexpr, DQK: gl.constexpr, DV: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        HAS_WINDOW: gl.constexpr, SINK_MODE: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        BLOCK_Q: gl.constexpr = BLOCK_M // GP
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)

        # this consumer's query rows (tokens x padded group heads) into shared memory
        offs_qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        offs_qd = gl.arange(0, DQK, layout=gl.SliceLayout(0, q_layout))
        qtok = tok0 + offs_qm // GP
        qhh = offs_qm % GP
        q_ok = (qtok < q_len) & (qhh < G)
        q_rows = (q0 + qtok).to(gl.int64) * stride_qt + (kvh * G + qhh) * stride_qh
        q = gl.load(
            Q + gl.expand_dims(q_rows, 1) + gl.expand_dims(offs_qd, 0),
            mask=gl.expand_dims(q_ok, 1),
            other=0.0,
        )
        q_smem.store(q)
        gh.fence_async_shared()
        gl.thread_barrier()

        offs_m = gl.arange(0, BLOCK_M, layout=row_l)
        pos = ctx + tok0 + offs_m // GP
        offs_n = gl.arange(0, BLOCK_N, layout=col_l)
        p_lo = ctx + tok0  # first row's position
        p_hi = ctx + gl.minimum(tok0 + BLOCK_Q, q_len) - 1  # last valid row's position
        head = kvh * G + offs_m % GP
        if SINK_MODE == 1:
            m_i = gl.load(Sinks + head, mask=(offs_m % GP) < G, other=0.0).to(gl.float32) * 1.4426950408889634
            l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_l)
        elif SINK_MODE == 2:
            m_i = gl.zeros([BLOCK_M], gl.float32, row_l)
            l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_l)
        else:
            m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_l)
            l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
        acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        p_prev = gl.zeros([BLOCK_M, BLOCK_N], Q.dtype.element_ty, p_layout)

        for j in range(n_tiles):
            st = j % NUM_STAGES
            phase = (j // NUM_STAGES) & 1
            key0 = a + j * BLOCK_N
            mbarrier.wait(k_ready.index(st), phase)
            if j > 0:
                mbarrier.wait(v_ready.index((j - 1) % NUM_STAGES), ((j - 1) // NUM_STAGES) & 1)
            if PINGPONG:  # issue this tile's wgmma's only in our turn: the other one runs its softmax
                mbarrier.wait(my_turn, j & 1)
            s_tok = gh.warpgroup_mma(
                q_smem, k_bufs.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            if j > 0:  # P(j-1) V(j-1) behind S(j): retires while this tile's softmax runs
                acc = gh.warpgroup_mma(p_prev, v_bufs.index((j - 1) % NUM_STAGES), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(other_turn, count=1)
                s, acc = gh.warpgroup_mma_wait(1, deps=[s_tok, acc])
            else:
                if PINGPONG:
                    mbarrier.arrive(other_turn, count=1)
                s = gh.warpgroup_mma_wait(0, deps=[s_tok])
            mbarrier.arrive(k_empty.index(st), count=1)
            need_mask = key0 + BLOCK_N - 1 > p_lo
            if HAS_WINDOW:
                need_mask = need_mask | (key0 < p_hi - w)
            if need_mask:
                keys = key0 + offs_n
                vis = gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1)
                if HAS_WINDOW:
                    vis = vis & (gl.expand_dims(pos, 1) - gl.expand_dims(keys, 0) <= w)
                s = gl.where(vis, s * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                p = gl.exp2(s - gl.expand_dims(m_new, 1))
            else:
                m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
                p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            if j > 0:
                acc = gh.warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(v_empty.index((j - 1) % NUM_STAGES), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_prev = gl.convert_layout(p.to(Q.dtype.element_ty), p_layout)
        if n_tiles > 0:
            lst = (n_tiles - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(lst), ((n_tiles - 1) // NUM_STAGES) & 1)
            acc = gh.warpgroup_mma(p_prev, v_bufs.index(lst), acc, is_async=True)
            acc = gh.warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(v_empty.index(lst), count=1)

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1)
        offs_om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_od = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        otok = tok0 + offs_om // GP
        ohh = offs_om % GP
        o_ok = (otok < q_len) & (ohh < G)
        o_rows = (q0 + otok).to(gl.int64) * stride_ot + (kvh * G + ohh) * stride_oh
        gl.store(
            O + gl.expand_dims(o_rows, 1) + gl.expand_dims(offs_od, 0),
            out.to(O.dtype.element_ty),
            mask=gl.expand_dims(o_ok, 1),
        )

    @gluon.jit
    def _hopper_prefill_kernel(
        Q, O, V, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_vr, stride_tbl, n_blk,
        num_reqs, min_q_len, qk_scale, window, win_h0, win_h1,
        G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, DQK: gl.constexpr, DV: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BS: gl.constexpr, BOX: gl.constexpr,
        NUM_STAGES: gl.constexpr, HEADWISE: gl.constexpr, HAS_WINDOW: gl.constexpr,
        SINK_MODE: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PINGPONG: gl.constexpr,
    ):  # fmt: skip
        BLOCK_Q: gl.constexpr = BLOCK_M // GP  # tokens per consumer
        TILE_Q: gl.constexpr = 2 * BLOCK_Q  # tokens per CTA
        pid = gl.program_id(0)
        kvh = pid % HKV
        tpid = pid // HKV
        # request b owns tile ids [CuQ[b] // TILE_Q + b, ...): the largest b whose first id <= tpid
        lo = 0
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if gl.load(CuQ + mid) // TILE_Q + mid <= tpid:
                lo = mid
            else:
                hi = mid - 1
        b = lo
        q0 = gl.load(CuQ + b)
        q_len = gl.load(CuQ + b + 1) - q0
        n_qt = (q_len + TILE_Q - 1) // TILE_Q
        local = tpid - (q0 // TILE_Q + b)
        if (local < n_qt) & (q_len >= min_q_len):
            qt = n_qt - 1 - local  # longest tiles first: less tail
            ctx = gl.load(Ctx + b)
            kv_len = ctx + q_len
            tok0 = qt * TILE_Q
            if HAS_WINDOW:
                w = gl.where((kvh >= win_h0) & (kvh < win_h1), window, 1 << 30)
            else:
                w = 1 << 30
            p_first = ctx + tok0
            p_last = ctx + gl.minimum(tok0 + TILE_Q, q_len) - 1
            a = gl.maximum(p_first - w, 0) // BLOCK_N * BLOCK_N
            n_tiles = (p_last + 1 - a + BLOCK_N - 1) // BLOCK_N
            tbl_row = Tbl + (b * HKV + kvh if HEADWISE else b) * stride_tbl

            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQK], Q.dtype.element_ty)
            q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, DQK], q_layout)
            k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, DQK], k_desc.layout)
            v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, DV], v_desc.layout)
            bl: gl.constexpr = mbarrier.MBarrierLayout()
            k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
            v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
            k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
            v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
                mbarrier.init(v_empty.index(i), count=2)
                mbarrier.arrive(k_empty.index(i), count=2)  # every slot starts empty
                mbarrier.arrive(v_empty.index(i), count=2)
            turns = gl.allocate_shared_memory(gl.int64, [2, 1], bl)  # ping-pong: whose wgmma's go next
            mbarrier.init(turns.index(0), count=1)
            mbarrier.init(turns.index(1), count=1)
            mbarrier.arrive(turns.index(0), count=1)  # consumer 0 starts

            gl.warp_specialize(
                [
                    (_consumer, (
                        Q, O, Sinks, q_smem.index(0), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                        turns.index(0), turns.index(1),
                        q0, tok0, q_len, ctx, kvh, w, a, n_tiles, qk_scale,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        G, GP, DQK, DV, BLOCK_M, BLOCK_N, NUM_STAGES, HAS_WINDOW, SINK_MODE, PINGPONG,
                    )),
                    (_consumer, (
                        Q, O, Sinks, q_smem.index(1), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                        turns.index(1), turns.index(0),
                        q0, tok0 + BLOCK_Q, q_len, ctx, kvh, w, a, n_tiles, qk_scale,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        G, GP, DQK, DV, BLOCK_M, BLOCK_N, NUM_STAGES, HAS_WINDOW, SINK_MODE, PINGPONG,
                    )),
                    (_producer, (
                        k_desc, v_desc, V, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                        tbl_row, n_blk, kvh, a, n_tiles, kv_len, stride_vr,
                        HKV, HEADWISE, BS, BLOCK_N, BOX, DQK, DV, NUM_STAGES,
                    )),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )  # fmt: skip


def _descriptor(cache: torch.Tensor, box: int):
    """TMA descriptor over ``cache [NB, Hkv, BS, D]`` viewed as ``[NB * Hkv * BS, D]`` (row stride
    ``cache.stride(2)``), box ``[box, 64]``."""
    nb, hkv, bs, d = cache.shape
    gdt = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([box, CHUNK], gdt)
    return TensorDescriptor(cache, [nb * hkv * bs, d], [cache.stride(2), 1], [box, CHUNK], layout)


def hopper_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_decoder: torch.Tensor,
    block_tables: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    qk_scale: float,
    sink_mode: int,
    headwise: bool,
    has_window: bool,
    window: int,
    win_h0: int,
    win_h1: int,
    num_stages: int | None = None,
    pingpong: bool = False,
) -> None:
    """Launch the Hopper prefill kernel for the requests with >= 2 query tokens (arguments checked
    and prepared by :func:`.paged_attention.paged_attention`; ``qk_scale`` includes ``log2(e)``).

    ``q [T, Hq, Dqk]``, caches ``[NB, Hkv, BS, D]``, ``out [T, Hq, Dv]`` (rows of one-token requests
    untouched)."""
    t, hq, dqk = q.shape
    hkv, bs, dv = key_cache.shape[1], key_cache.shape[2], value_cache.shape[3]
    num_reqs = cu_seqlens_q.shape[0] - 1
    g = hq // hkv
    gp = _next_pow2(g)
    block_m = 64
    if gp > block_m:
        raise ValueError(f"hopper prefill packs at most {block_m} q heads per kv head, got {g}")
    block_n = block_n_for(dqk, dv, bs)
    box = min(block_n, bs)
    tile_q = 2 * (block_m // gp)
    if num_stages is None:  # as deep as the 227 KB of shared memory allow (Q: 2 x 64 rows; 3 KB spare)
        per_stage = block_n * (dqk + dv) * q.element_size()
        room = 227 * 1024 - 3072 - 2 * block_m * dqk * q.element_size()
        num_stages = max(2, min(3, room // per_stage))
    k_desc = _descriptor(key_cache, box)
    v_desc = _descriptor(value_cache, box)
    sink_arg = sinks if sinks is not None else q
    grid = ((t // tile_q + num_reqs) * hkv,)
    _hopper_prefill_kernel[grid](
        q, out, value_cache, k_desc, v_desc, sink_arg, cu_seqlens_q, seq_lens_decoder, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_tables.shape[1],
        num_reqs, 2, qk_scale, window, win_h0, win_h1,
        G=g, GP=gp, HKV=hkv, DQK=dqk, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n, BS=bs, BOX=box,
        NUM_STAGES=num_stages, HEADWISE=bool(headwise), HAS_WINDOW=bool(has_window),
        SINK_MODE=sink_mode, PRODUCER_REGS=40, CONSUMER_REGS=232, PINGPONG=bool(pingpong), num_warps=4,
    )  # fmt: skip


__all__ = [
    "block_n_for",
    "choose_prefill_impl",
    "gluon_available",
    "hopper_prefill",
    "is_hopper",
    "supported",
]
