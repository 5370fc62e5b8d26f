"""The dequantizing gather ahead of the Hopper prefill of a quantized KV cache (issue 31).

The Hopper prefill (``kernels/hopper_prefill.py``) reads bf16 / fp16 pages by TMA and has no shared
memory left for a ring of fp8 tiles beside its bf16 ring (benchmarks/NOTES.md, "What a Hopper prefill
over fp8 codes needs"). So a quantized cache's prefill runs in two steps:

1. :func:`_dequant_gather_kernel` dequantizes exactly the pages the step's prefill requests will read
   into a compact **scratch cache** in the model dtype ``T`` (bf16 / fp16): ``key [blocks, Hkv,
   block_size, Dqk]`` and ``value [blocks, Hkv, block_size, Dv]``, laid out like an unquantized cache
   (contiguous, so one block holds ``Hkv`` pages), and writes a **remapped table** of the step's table's
   shape whose entries index the scratch;
2. the unchanged bf16 :class:`~.hopper_prefill.HopperPlan` runs on the scratch and the remapped table.

Decode rows of the same step keep reading the codes directly (the decode kernel, unchanged).

**Which pages.** Request ``b`` of the step prefills when it has ``q_len >= 2`` rows (the prefill
kernels' ``min_q_len``; rows inside ``q``). Its keys some query sees are ``[lo, ctx + q_len)`` with
``lo = max(ctx - window, 0)`` for a sliding kv head, 0 otherwise; the pages covering that range are
gathered (a page-aligned range: logical blocks ``lo // block_size`` to ``(ctx + q_len - 1) //
block_size``). A per-request block table is shared by the kv heads, so its range starts at 0 unless
every kv head slides; each head then zeroes the keys below its own ``lo``. A head-wise table
(``[bsz * Hkv, max_pages]``) is gathered per (request, kv head) row, each with its own window.

**Masked keys.** Inside a gathered page, the slots past ``ctx + q_len`` (never written yet: a cache
may hold NaN there) and the slots below the head's ``lo`` (seen by no query; released or stale data
may sit there) are written as **zeros**, K and V: nothing the kernel may load over a remapped entry is
garbage from an allocation or a stale slot, and the values that are copied are exactly the keys some
query sees. Entries of the remapped table outside the gathered range, of rows that do not prefill,
and of table entries that may not be dereferenced (negative, past the cache, past the table's width)
are ``-1``; such a bad entry inside the range is recorded in the error flag (``kernels/errors.py``,
kernel 5) before the Hopper prefill would record it as ``-1``.

**Dequantization**, bit for bit the portable kernels' values before any rounding: the code converts
exactly (``kv_quant.dequant``: e4m3fn bits, or ``byte - 128``; the NaN codes read as NaN), is
multiplied by its dequant scale in fp32 (per token and kv head, per kv head or per channel; a
16-bit scale makes that product exact: at most 4 + 11 significant bits), and the product is rounded
**once to** ``T``, to nearest even (``kv_quant.to_dtype``: bf16 rounded on the bits, the same as the
GPU's ``cvt.rn``; fp16 by the cast). That rounding is the one difference from the portable prefill,
which never forms ``code * scale`` (codes go to the dot exactly and the scales multiply the scores' /
P's columns in fp32, or q and the output for static scales): each K / V value here carries a relative
error of at most ``2^-9`` (bf16) / ``2^-12`` (fp16) of itself, the rounding an unquantized cache of
the same values would have had. An fp32 scale (static formats may carry one) rounds the product to
fp32 first.

**Scratch size.** Without a host sync the gather cannot count the pages; the host bounds them from
what it knows (:func:`scratch_units`): at most ``R = min(num_reqs, T // 2)`` requests prefill (each
has >= 2 of the step's ``T`` rows), each over at most ``W`` logical blocks: ``ceil(max_context_len /
block_size)`` (the table's width without ``max_context_len``), or for a sliding head ``(window +
max_q_len + block_size - 2) // block_size + 1`` when that is smaller. Request ``b`` of rank ``r``
among the prefill requests gets the scratch blocks ``[r * W, (r + 1) * W)`` (head-wise: pages, a
region per kv head). The scratch then holds ``R * W * Hkv * block_size * (Dqk + Dv) * elem`` bytes
(:meth:`DequantScratch.nbytes`): e.g. one 8192-token prefill of 8 kv heads at 128 / 128 in bf16 is
32 MiB, a 2048-token chunk over a 128K context (64-token blocks, 8 heads) 512 MiB. It is transient
working memory of one layer's prefill, so plans of one geometry (device, dtype, ``Hkv``, block size,
``Dqk``, ``Dv``) **share** one :class:`DequantScratch` (:func:`shared_scratch`, held weakly: it goes
when the last plan does): every layer of a model reuses the same memory, grown on demand (by at least
half its size, never per step once warm) and never shrunk. Layers run one after another on one CUDA
stream, so one layer's gather never overwrites pages another layer's prefill still reads; plans that
share a scratch must not run concurrently on different streams.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import triton
import triton.language as tl

from .. import envs
from ._framework import next_pow2, torch
from .attention_kernels import _scan_table
from .errors import KERNEL_DEQUANT_GATHER
from .kv_quant import dequant, to_dtype

logger = logging.getLogger(__name__)

#: scratch growth: a new allocation is at least this much larger than the one it replaces
GROWTH = 1.5
#: programs the gather aims for per SM (the grid's third dimension splits each row's pages)
PROGRAMS_PER_SM = 16


@triton.jit
def _gather_pages(
    Src, Dst, S, src_page, dst_page, slots, keys, lo, kv_len, h, stride_p, stride_r, stride_sp, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, KV_CODE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
):  # fmt: skip
    """One page of codes ``Src`` (page ``src_page``, rows at ``stride_r``) dequantized into scratch page
    ``dst_page`` of ``Dst [pages, BS, D]``: the keys in ``[lo, kv_len)`` as ``T(code * scale)``, the
    other slots zero."""
    T: tl.constexpr = Dst.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < D
    km = (keys >= lo) & (keys < kv_len) & (slots < BS)
    m = km[:, None] & dm[None, :]
    codes = tl.load(Src + src_page * stride_p + slots[:, None] * stride_r + offs_d[None, :], mask=m, other=0)
    if SCALE_MODE == 1:  # per token and kv head
        sc = tl.load(S + src_page * stride_sp + slots * stride_sr, mask=km, other=0.0).to(tl.float32)[:, None]
    elif SCALE_MODE == 2:  # per (logical) kv head
        sc = tl.load(S + h).to(tl.float32)
    else:  # per channel
        sc = tl.load(S + h * D + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    x = to_dtype(dequant(codes, sc, KV_CODE == 1), T)
    x = tl.where(m, x, 0.0)
    dst = Dst + dst_page * (BS * D) + slots[:, None] * D + offs_d[None, :]
    tl.store(dst, x.to(T), mask=(slots < BS)[:, None] & dm[None, :])


@triton.jit(
    do_not_specialize=[
        "stride_tbl", "n_blk", "n_pages", "n_tok", "num_reqs", "w_full", "w_win", "per_req", "cap",
    ]
)  # fmt: skip
def _dequant_gather_kernel(
    K, V, KS, VS, CuQ, Ctx, Tbl, Err, OK, OV, OTbl,
    stride_kp, stride_kr, stride_vp, stride_vr, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    stride_tbl, n_blk, n_pages, n_tok, num_reqs, window, win_h0, win_h1, w_full, w_win, per_req, cap,
    HKV: tl.constexpr, BS: tl.constexpr, BLOCK_S: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HEADWISE: tl.constexpr, ALL_SLIDE: tl.constexpr,
    PAGE_H: tl.constexpr, KV_CODE: tl.constexpr, SCALE_MODE: tl.constexpr,
    HAS_ERR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Program (request ``b``, kv head ``h``, split ``s``): the pages ``j0 + s, j0 + s + splits, ...`` of
    row ``b`` (head-wise: row ``b * HKV + h``) for head ``h``, and (head ``0`` of a per-request table,
    every head of a head-wise one) the remapped entries of columns ``s * BLOCK_T + splits * BLOCK_T *
    i + [0, BLOCK_T)`` (module docstring)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    splits = tl.num_programs(2)
    q0 = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q0
    valid = (q_len >= 2) & (q0 >= 0) & (q0 + q_len <= n_tok)
    # rank among the prefill requests: the scratch region of this request
    rank = b * 0
    for c in range(0, b, BLOCK_R):
        r = c + tl.arange(0, BLOCK_R)
        rm = r < b
        a0 = tl.load(CuQ + r, mask=rm, other=0)
        a1 = tl.load(CuQ + r + 1, mask=rm, other=0)
        ok = rm & (a1 - a0 >= 2) & (a0 >= 0) & (a1 <= n_tok)
        rank += tl.sum(ok.to(tl.int32), 0)
    ctx = tl.load(Ctx + b)
    kv_len = ctx + q_len
    slide = (h >= win_h0) & (h < win_h1)  # no window: win_h0 = win_h1 = 0
    lo = tl.where(slide, tl.maximum(ctx - window, 0), 0)  # this head's first visible key
    if HEADWISE:
        row = b * HKV + h
        lo_tbl = lo
        width = tl.where(slide, w_win, w_full)
        # pages of the heads before h: full heads w_full each, sliding ones w_win
        n_slide_before = tl.minimum(tl.maximum(h - win_h0, 0), tl.maximum(win_h1 - win_h0, 0))
        base = rank.to(tl.int64) * per_req + h * w_full - n_slide_before * (w_full - w_win)
        write_tbl = True
    else:
        row = b
        lo_tbl = 0
        if ALL_SLIDE:
            lo_tbl = tl.maximum(ctx - window, 0)
        width = w_full
        base = rank.to(tl.int64) * per_req
        write_tbl = h == 0
    j0 = lo_tbl // BS
    j1 = tl.minimum((kv_len + BS - 1) // BS, j0 + width)
    tbl_row = Tbl + row.to(tl.int64) * stride_tbl
    if HAS_ERR:  # the bad entries among those some query sees, as the prefill kernels would record them
        if valid & write_tbl & (s == 0):
            _scan_table(
                Err, tbl_row, n_blk, n_pages, b, h, lo_tbl, kv_len, BS, HEADWISE, KERNEL_DEQUANT_GATHER
            )
    # the remapped entries: scratch units (blocks, head-wise pages) of the gathered range, else -1
    if write_tbl:
        offs_t = tl.arange(0, BLOCK_T)
        for c in range(s * BLOCK_T, n_blk, splits * BLOCK_T):
            cols = c + offs_t
            cm = cols < n_blk
            raw = tl.load(tbl_row + cols, mask=cm, other=-1)
            new = base + (cols - j0)
            keep = valid & (cols >= j0) & (cols < j1) & (raw >= 0) & (raw < n_pages) & (new < cap)
            tl.store(OTbl + row.to(tl.int64) * n_blk + cols, tl.where(keep, new, -1).to(tl.int32), mask=cm)
    if valid:
        slots = tl.arange(0, BLOCK_S)
        for j in range(j0 + s, j1, splits):
            raw = tl.load(tbl_row + j, mask=j < n_blk, other=-1).to(tl.int64)
            new = base + (j - j0)
            if (raw >= 0) & (raw < n_pages) & (j < n_blk) & (new < cap):
                if HEADWISE:  # pages numbered in the layer's view (block * HKV + head)
                    src = raw // HKV * PAGE_H + raw % HKV
                    dst = new
                else:
                    src = raw * PAGE_H + h
                    dst = new * HKV + h
                keys = j * BS + slots
                _gather_pages(
                    K, OK, KS, src, dst, slots, keys, lo, kv_len, h, stride_kp, stride_kr,
                    stride_ksp, stride_ksr, DQK, BLOCK_DQK, BS, KV_CODE, SCALE_MODE,
                )  # fmt: skip
                _gather_pages(
                    V, OV, VS, src, dst, slots, keys, lo, kv_len, h, stride_vp, stride_vr,
                    stride_vsp, stride_vsr, DV, BLOCK_DV, BS, KV_CODE, SCALE_MODE,
                )  # fmt: skip


def scratch_units(
    num_reqs: int,
    n_tok: int,
    n_blk: int,
    block_size: int,
    hkv: int,
    *,
    headwise: bool,
    window: int | None,
    win_h0: int = 0,
    win_h1: int = 0,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
) -> tuple[int, int, int, int]:
    """Host bound of one step's scratch (module docstring): ``(w_full, w_win, per_req, cap)``: logical
    blocks a request's full / sliding head may need, scratch units (blocks of a per-request table, pages
    of a head-wise one) per prefill request, and units in all (``R * per_req``, ``R = min(num_reqs,
    T // 2)``)."""
    bs = block_size
    w_full = n_blk if max_context_len is None else min(n_blk, -(-int(max_context_len) // bs))
    w_win = w_full
    if window is not None:
        span = int(window) + (int(max_q_len) if max_q_len is not None else n_blk * bs)
        w_win = min(w_full, (span + bs - 2) // bs + 1)
    w_full, w_win = max(w_full, 0), max(w_win, 0)
    h0, h1 = (min(max(win_h0, 0), hkv), min(max(win_h1, 0), hkv)) if window is not None else (0, 0)
    n_slide = max(h1 - h0, 0)
    if headwise:
        per_req = (hkv - n_slide) * w_full + n_slide * w_win
    else:
        per_req = w_win if window is not None and n_slide == hkv else w_full
    ranks = max(0, min(num_reqs, n_tok // 2))
    return w_full, w_win, per_req, ranks * per_req


class DequantScratch:
    """The scratch cache of one geometry: ``key [blocks, Hkv, block_size, Dqk]`` and ``value [blocks,
    Hkv, block_size, Dv]`` in the model dtype, and the remapped table's storage (``int32``), grown on
    demand by :meth:`ensure` (never shrunk). ``generation`` counts the allocations: a plan that built
    TMA descriptors over :attr:`key` / :attr:`value` builds them again when it changes."""

    def __init__(self, device: Any, dtype: Any, hkv: int, block_size: int, dqk: int, dv: int) -> None:
        self.device, self.dtype = device, dtype
        self.hkv, self.bs, self.dqk, self.dv = hkv, block_size, dqk, dv
        self.key = self.value = None
        self.table = None
        self.blocks = 0
        self.generation = 0

    def nbytes(self) -> int:
        """Bytes held: both caches and the table."""
        total = 0
        for x in (self.key, self.value, self.table):
            if x is not None:
                total += x.numel() * x.element_size()
        return total

    def ensure(self, blocks: int, table_elems: int, most: int | None = None) -> None:
        """At least ``blocks`` scratch blocks and ``table_elems`` table entries (a larger allocation
        replaces a smaller one: :data:`GROWTH` times the old size at least, but not past ``most``
        blocks where that still holds ``blocks``)."""
        if blocks > self.blocks:
            new = max(int(blocks), int(self.blocks * GROWTH), 1)
            if most is not None and blocks <= most:
                new = min(new, int(most))
            shape_k = (new, self.hkv, self.bs, self.dqk)
            shape_v = (new, self.hkv, self.bs, self.dv)
            self.key = self.value = None  # free the old ones first
            self.key = torch.empty(shape_k, dtype=self.dtype, device=self.device)
            self.value = torch.empty(shape_v, dtype=self.dtype, device=self.device)
            self.blocks = new
            self.generation += 1
            logger.info(
                "dequant scratch %s %s: %d blocks (%.1f MiB)",
                self.device,
                self.dtype,
                new,
                self.nbytes() / 2**20,
            )
        if self.table is None or self.table.numel() < table_elems:
            n = max(int(table_elems), int((0 if self.table is None else self.table.numel()) * GROWTH), 1)
            self.table = torch.empty(n, dtype=torch.int32, device=self.device)


#: scratches by geometry, held by the plans that use them (weakly here)
_SCRATCH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_scratch(device: Any, dtype: Any, hkv: int, block_size: int, dqk: int, dv: int) -> DequantScratch:
    """The :class:`DequantScratch` every plan of this geometry shares (a new one when none is alive)."""
    key = (str(device), str(dtype), int(hkv), int(block_size), int(dqk), int(dv))
    scratch = _SCRATCH.get(key)
    if scratch is None:
        scratch = _SCRATCH[key] = DequantScratch(device, dtype, hkv, block_size, dqk, dv)
    return scratch


class DequantGather:
    """The gather's launches for one layer (module docstring), over a cache checked by
    :class:`.paged_attention.AttentionPlan`: ``KV_CODE`` 1 (e4m3fn) / 2 (int8 + 128), ``SCALE_MODE`` 1
    (per token, scales at the strides ``scale_strides = (K page, K slot, V page, V slot)``), 2 (per kv
    head, flat ``[Hkv]``), 3 (per channel, flat ``[Hkv * D]``); ``page_h`` the caches' heads per block,
    ``common`` their ``(K page, K slot, V page, V slot)`` strides, ``n_pages`` the table entries' bound
    (blocks, or head-wise pages). ``dtype``: the model dtype the scratch holds.
    ``scratch``: a :class:`DequantScratch` (default: :func:`shared_scratch` of this geometry)."""

    def __init__(
        self,
        *,
        hkv: int,
        block_size: int,
        dqk: int,
        dv: int,
        dtype: Any,
        device: Any,
        kv_code: int,
        scale_mode: int,
        page_h: int,
        common: tuple[int, int, int, int],
        scale_strides: tuple[int, int, int, int],
        n_pages: int,
        headwise: bool,
        window: int | None,
        win_h0: int = 0,
        win_h1: int = 0,
        scratch: DequantScratch | None = None,
    ) -> None:
        if kv_code not in (1, 2):
            raise ValueError(f"kv_code must be 1 (e4m3fn) or 2 (int8 + 128), got {kv_code!r}")
        if scale_mode not in (1, 2, 3):
            raise ValueError(f"scale_mode must be 1, 2 or 3, got {scale_mode!r}")
        self.hkv, self.bs, self.dqk, self.dv = hkv, block_size, dqk, dv
        self.headwise, self.window = bool(headwise), window
        # no window: no sliding head (the kernel reads [win_h0, win_h1) as the sliding heads)
        self.win_h0, self.win_h1 = (max(win_h0, 0), min(win_h1, hkv)) if window is not None else (0, 0)
        self.common, self.scale_strides, self.n_pages = tuple(common), tuple(scale_strides), int(n_pages)
        self.scratch = scratch or shared_scratch(device, dtype, hkv, block_size, dqk, dv)
        all_slide = window is not None and self.win_h0 <= 0 and self.win_h1 >= hkv
        self.consts = dict(
            HKV=hkv, BS=block_size, BLOCK_S=next_pow2(block_size), DQK=dqk, DV=dv,
            BLOCK_DQK=next_pow2(max(dqk, 16)), BLOCK_DV=next_pow2(max(dv, 16)), HEADWISE=self.headwise,
            ALL_SLIDE=all_slide, PAGE_H=page_h, KV_CODE=kv_code,
            SCALE_MODE=scale_mode, BLOCK_R=256, BLOCK_T=64, num_stages=1,
        )  # fmt: skip
        # a [block_size, D] page tile in fp32 over 128 threads up to 8192 elements, 256 threads beyond
        tile = self.consts["BLOCK_S"] * max(self.consts["BLOCK_DQK"], self.consts["BLOCK_DV"])
        self.consts["num_warps"] = 4 if tile <= 8192 else 8
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if _is_cuda(device) else 4
        #: the scratch's most bytes (FDFLEET_DEQUANT_SCRATCH_MB, read when the plan is built)
        self.budget = envs.dequant_scratch_mb() << 20
        self._unit_bytes = block_size * (dqk + dv) * torch.empty(0, dtype=dtype).element_size()

    def reserve(self) -> None:
        """Allocate the whole :attr:`budget` now (once; the plan calls it at each prefill, whether the step
        fits or not): FastDeploy sizes the KV cache from the device memory in use after its profile run
        (``gpu_worker.determine_available_memory``: NVML's ``used``, which sees torch's allocations), so a
        scratch that reached its size only later would take memory the cache was given."""
        most = self.budget // (self._unit_bytes * self.hkv)
        if most > self.scratch.blocks:
            self.scratch.ensure(most, 1, most=most)

    def _units(
        self, num_reqs: int, n_tok: int, n_blk: int, max_q_len: int | None, max_context_len: int | None
    ) -> tuple[int, int, int, int]:
        """:func:`scratch_units` of one step of this layer's geometry."""
        return scratch_units(
            num_reqs, n_tok, n_blk, self.bs, self.hkv, headwise=self.headwise, window=self.window,
            win_h0=self.win_h0, win_h1=self.win_h1, max_q_len=max_q_len, max_context_len=max_context_len,
        )  # fmt: skip

    def fits(
        self,
        num_reqs: int,
        n_tok: int,
        rows: int,
        n_blk: int,
        *,
        max_q_len: int | None = None,
        max_context_len: int | None = None,
    ) -> bool:
        """Whether this step's scratch bound (:func:`scratch_units`, its remapped table included) stays
        within :attr:`budget`; where it does not, the caller runs the portable prefill over the codes."""
        *_, cap = self._units(num_reqs, n_tok, n_blk, max_q_len, max_context_len)
        pages = cap if self.headwise else cap * self.hkv
        return pages * self._unit_bytes + rows * n_blk * 4 <= self.budget

    def run(
        self,
        key_cache: Any,
        value_cache: Any,
        key_scale: Any,
        value_scale: Any,
        cu_seqlens_q: Any,
        seq_lens_decoder: Any,
        block_tables: Any,
        n_tok: int,
        *,
        max_q_len: int | None = None,
        max_context_len: int | None = None,
        errors: Any = None,
        kernels: Any = None,
        key: Any = None,
        stream: int | None = None,
    ) -> tuple[Any, Any, Any]:
        """Gather the pages this step's prefill requests read; returns ``(key, value, table)``: the
        scratch caches (``[blocks, Hkv, block_size, D]``, the model dtype) and the remapped table
        (``int32``, ``block_tables``' shape, contiguous). ``kernels`` / ``key`` / ``stream``: a
        :class:`.launch.direct.KernelCache` and this call's key (``None``: Triton's path)."""
        num_reqs = cu_seqlens_q.shape[0] - 1
        rows, n_blk = block_tables.shape[0], block_tables.shape[1]
        hkv = self.hkv
        w_full, w_win, per_req, cap = self._units(num_reqs, n_tok, n_blk, max_q_len, max_context_len)
        blocks = -(-cap // hkv) if self.headwise else cap
        sc = self.scratch
        sc.ensure(max(blocks, 1), rows * n_blk, most=self.budget // (self._unit_bytes * hkv))
        table = sc.table[: rows * n_blk].view(rows, n_blk)
        if num_reqs <= 0 or rows * n_blk == 0:
            return sc.key, sc.value, table
        grid_rows = num_reqs * hkv
        splits = max(1, min(max(w_full, 1), -(-PROGRAMS_PER_SM * self.sms // grid_rows)))
        splits = 1 << (splits.bit_length() - 1)  # a power of two (no compile per value: it is the grid)
        has_err = errors is not None
        args = (
            key_cache, value_cache, key_scale, value_scale, cu_seqlens_q, seq_lens_decoder, block_tables,
            errors if has_err else block_tables, sc.key, sc.value, table, *self.common, *self.scale_strides,
            block_tables.stride(0), n_blk, self.n_pages, n_tok, num_reqs,
            0 if self.window is None else int(self.window), self.win_h0, self.win_h1, w_full, w_win, per_req,
            sc.blocks * hkv if self.headwise else sc.blocks,
        )  # fmt: skip
        grid = (num_reqs, hkv, splits)
        consts = dict(HAS_ERR=has_err, **self.consts)
        if kernels is None:
            _dequant_gather_kernel[grid](*args, **consts)
        else:
            kernels.launch(_dequant_gather_kernel, key, grid, args, consts, stream)
        return sc.key, sc.value, table


def _is_cuda(device: Any) -> bool:
    return getattr(device, "type", str(device)) == "cuda"


def dequant_gather(
    key_cache: Any,
    value_cache: Any,
    key_scale: Any,
    value_scale: Any,
    cu_seqlens_q: Any,
    seq_lens_decoder: Any,
    block_tables: Any,
    *,
    kv_quant: Any,
    dtype: Any,
    headwise: bool = False,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    n_tok: int | None = None,
    errors: Any = None,
    scratch: DequantScratch | None = None,
) -> tuple[Any, Any, Any]:
    """One gather (tests, probes): a quantized cache (``uint8 [num_blocks, Hkv, block_size, D]`` codes,
    ``kv_quant`` a :class:`~..kvcache.quant.KVCacheQuant` or its name, dequant scales ``[num_blocks,
    Hkv, block_size]`` / ``[Hkv]`` / ``[Hkv * D]``) and one step's metadata (as
    :func:`.paged_attention.paged_attention` takes them; ``n_tok``: q's rows, default
    ``cu_seqlens_q[-1]``, a host sync) -> ``(key, value, table)``: the scratch caches in ``dtype`` and
    the remapped table (module docstring). A fresh :class:`DequantScratch` unless ``scratch`` is given."""
    from ..kvcache.quant import KVCacheQuant, kv_cache_quant
    from .paged_attention import KV_CODES, _check_cache, _check_quant

    quant = kv_quant if isinstance(kv_quant, KVCacheQuant) else kv_cache_quant(kv_quant)
    if quant is None:
        raise ValueError(f"kv_quant={kv_quant!r}: the gather reads a quantized cache (a format name)")
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    dqk, dv = key_cache.shape[3], value_cache.shape[3]
    page_h = _check_cache("key_cache", key_cache, hkv, dqk)
    if _check_cache("value_cache", value_cache, hkv, dv) != page_h:
        raise ValueError("key_cache and value_cache must have the same heads per block")
    like = torch.empty(0, dtype=dtype, device=key_cache.device)
    mode, ks, vs, sstrides = _check_quant(quant, key_cache, value_cache, key_scale, value_scale, like, page_h)
    h0, h1 = sliding_heads if (window_left is not None and sliding_heads is not None) else (0, hkv)
    gather = DequantGather(
        hkv=hkv, block_size=bs, dqk=dqk, dv=dv, dtype=dtype, device=key_cache.device,
        kv_code=KV_CODES[quant.code], scale_mode=mode, page_h=page_h,
        common=(key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2)),
        scale_strides=sstrides,
        n_pages=min(key_cache.shape[0], value_cache.shape[0]) * (hkv if headwise else 1),
        headwise=headwise, window=window_left, win_h0=h0, win_h1=h1,
        scratch=scratch or DequantScratch(key_cache.device, dtype, hkv, bs, dqk, dv),
    )  # fmt: skip
    if n_tok is None:
        n_tok = int(cu_seqlens_q[-1])
    return gather.run(
        key_cache, value_cache, ks, vs, cu_seqlens_q, seq_lens_decoder, block_tables, n_tok,
        max_q_len=max_q_len, max_context_len=max_context_len, errors=errors,
    )  # fmt: skip


__all__ = ["DequantGather", "DequantScratch", "dequant_gather", "scratch_units", "shared_scratch"]
