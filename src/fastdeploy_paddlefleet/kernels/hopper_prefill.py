"""Hopper (sm_90) prefill attention over the paged cache, FA3-style, in Gluon.

Same contract as the prefill half of :func:`.paged_attention.paged_attention` (packed requests with
context in the cache, GQA packing, sliding windows that skip whole key tiles, head-wise windows and
tables, sinks, soft-capping, ``Dqk != Dv``) for head dims 64 / 128 in any mix, MLA's 192 / 128 and
256 / 256; the portable Triton kernel stays the path for every other GPU and for the interpreter.
:func:`supported` says when this path applies; the caller falls back otherwise. Shared memory sets
the tiles (:func:`tile_for`): 128-key tiles with two Q buffers up to 128 / 128, one Q buffer for
192 / 128, 64-key tiles and one Q buffer for 256 / 256.

Structure: a persistent grid (one CTA per SM) whose CTA ``p`` takes the work items ``p, p + grid,
...`` (every second full wave in reverse: :func:`_scheduled`); an item is (a tile of ``2 * BLOCK_Q``
query tokens of one request, kv head), numbered so that a request's longest tiles come first.
Three warpgroups per CTA:

* a **producer** (4 warps, few registers) walks the block table and streams K/V tiles of
  ``BLOCK_N`` keys into a ``NUM_STAGES``-deep shared-memory ring by TMA, one ``[box, 64]`` copy per
  page and 64-column chunk (the cache viewed as ``[pages * block_size, D]``), completing on
  ``k_ready`` / ``v_ready`` mbarriers; it also copies each item's query rows into one of two Q
  buffers (one where shared memory is short) by ``cp.async`` that complete ``q_ready`` on their own,
  so the next item's Q and first K/V tiles arrive while the consumers finish the current one (no
  pipeline refill between items, and no producer stall on Q's round trips: the plain loads it used
  before cost 2-6 % on the H200, ``q_async=False``). A tile whose keys run
  past the sequence end or into an absent page (``-1``) gets its V rows by plain loads instead, the
  invalid rows zero-filled (stale slots may hold NaN and ``0 * NaN`` would poison ``P @ V``);
* two **consumers** own 64-row halves of the query rows (tokens x padded group heads) and run
  the online softmax against their own wgmma's: ``S(j) = Q K(j)^T`` (for 192-wide heads three
  chained wgmma's over 64-column parts: shared-memory shapes are powers of two) is issued before
  ``O += P(j-1) V(j-1)``, so the softmax of tile ``j`` runs while the tensor cores finish the
  previous ``P @ V`` (wgmma groups retire in order); the two warpgroups interleave on the tensor
  cores on their own. An enforced ping-pong (each warpgroup issuing its wgmma's only after the
  other's, through two mbarriers) measured 10 % slower on the H200 and was dropped
  (benchmarks/NOTES.md). Each consumer frees a ring slot (``k_empty`` / ``v_empty``, two arrivals)
  as soon as its wgmma's have read it. The first key tile of an item is peeled off the loop
  (``HopperPlan(peel=True)``, the default): with the loop's ``j > 0`` branches every wgmma wait was
  conditional and ptxas serialised every wgmma of the kernel (C7514 in ``ptxas -v``); peeled, the
  H200 ran 128/128 causal +21-27 %, MLA +21-25 % (benchmarks/NOTES.md). Each consumer converts its
  finished rows to 16-byte row segments before storing them (``o_vec``). ``pingpong`` (FA3's
  turn-taking of the consumers on named barriers, inline PTX) measured no better than ``peel``.

Masks: a tile gets the mask only when it touches the causal diagonal or the window's leading edge
of that consumer's rows (a runtime branch); tiles wholly outside every row's window are never
loaded.

Masked keys contribute exactly nothing (docs/semantics.md) at the cost of one check per output row
and a second launch that exits at once: the kernel runs twice per step. The fast launch walks the
items as if there were no such rule; a non-finite V at a key a row may not see meets that row's
``P = 0`` in ``P @ V`` (``0 * NaN = NaN``), so it can only make the row non-finite, and each consumer
marks such a row in ``Redo`` as it stores the item (a store only then: a flag kept in registers over
the items cost the first consumer's window key loop 5 % more instructions, sm_90 offline; the safe
launch clears the flags it read). In the safe launch (``SAFE``) only the
CTAs with such a row walk their items again (a persistent CTA takes the same items in both
launches): a tile that some rows of the item see and others do not (causal diagonal, window edge)
gets its non-finite V entries zeroed and their keys flagged (``_clean_tile``: by TMA onto the
producer's own barrier, cleaned in shared memory once the next tile's K copies are issued, since the
consumers need this V only for the next tile's ``P @ V``), and the consumers make a row NaN when it
sees a flagged key (``_poison``, when they issue that ``P @ V``): a seen NaN is not hidden, and the
rows that never met a bad value come out with the fast launch's bits (same tiles, same order). The
safe walk is a kernel of its own: compiled into the fast one, it cost that one's key loop 9 % more
instructions (sm_90, offline) and its window prefill 10 % (H100).

Scores run in base 2 (``qk_scale`` folds ``log2(e)``); sinks enter as the initial softmax state, as
in the portable kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

try:  # the Hopper path runs on torch tensors (Gluon's TensorDescriptor); without torch it is never chosen
    import torch
except ImportError:  # a FastDeploy deployment without torch: the portable kernel serves
    torch = None

from ._framework import next_pow2
from .hopper_support import triton_blocks, triton_version

logger = logging.getLogger(__name__)

try:  # Gluon exists in Triton >= 3.5; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper as gh
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
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
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=8)
def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.x."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


BLOCK_M = 64  # query rows (tokens x padded group heads) per consumer warpgroup
# sm_90's shared memory per block (227 KB) less room for the mbarriers, the V tiles' key flags
# (num_stages * block_n bytes, _clean_tile) and layout-conversion scratch
SMEM_LIMIT = 232448 - 2048
# head dims (qk, v) this kernel is built and tested for (tile_for fits each in shared memory; others
# run on the portable kernel)
HEAD_DIMS = frozenset({(64, 64), (64, 128), (128, 64), (128, 128), (192, 128), (256, 256)})


def smem_bytes(dqk: int, dv: int, block_n: int, q_bufs: int, num_stages: int, elem: int = 2) -> int:
    """Shared memory of the Q buffers (``[q_bufs, 2 * BLOCK_M, dqk]``) and the K/V ring
    (``[num_stages, block_n, dqk + dv]``), in bytes."""
    return elem * (q_bufs * 2 * BLOCK_M * dqk + num_stages * block_n * (dqk + dv))


def store_scratch_bytes(dv: int, elem: int = 2) -> int:
    """Shared memory the output's layout conversion takes (``HopperPlan(o_vec=True)``): one consumer's
    ``[BLOCK_M, dv]`` rows (measured from the compiled kernels: +16 KB at dv 128, +32 KB at 256)."""
    return BLOCK_M * dv * elem


def tile_for(dqk: int, dv: int, elem: int = 2) -> tuple[int, int, int]:
    """``(block_n, q_bufs, num_stages)``: the largest key tile, then a double-buffered Q, that fit in
    shared memory with a 2-stage K/V ring (128/128: 128 keys, 2 Q buffers, 192 KB; MLA's 192/128:
    128 keys, 1 Q buffer, 208 KB; 256/256: 64 keys, 1 Q buffer, 192 KB)."""
    for block_n, q_bufs in ((128, 2), (128, 1), (64, 2), (64, 1)):
        if smem_bytes(dqk, dv, block_n, q_bufs, 2, elem) <= SMEM_LIMIT:
            return block_n, q_bufs, 2
    raise ValueError(f"head dims {dqk}/{dv} do not fit the hopper prefill's shared memory")


def block_n_for(dqk: int, dv: int, block_size: int) -> int:
    """Keys per tile (loaded as ``block_n / min(block_n, block_size)`` page boxes)."""
    return tile_for(dqk, dv)[0]


def supported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """``None`` when the Hopper kernel can run these inputs, else the reason it cannot."""
    if not gluon_available():
        return f"gluon unavailable with Triton {triton_version()} ({GLUON_IMPORT_ERROR!r})"
    if torch is None or not isinstance(q, torch.Tensor):
        return "inputs are not torch tensors (the Hopper path launches through torch)"
    if not q.is_cuda or not is_hopper(q.device):
        return "not an sm_90 GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    dqk, dv, bs = q.shape[2], value_cache.shape[3], key_cache.shape[2]
    if (dqk, dv) not in HEAD_DIMS:
        return f"head dims {dqk}/{dv} (built for {sorted(HEAD_DIMS)}: shared memory and registers)"
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
    kv_quant: object = None,
) -> str:
    """``"hopper"`` or ``"portable"``: ``impl`` if given, else ``FDFLEET_PREFILL_KERNEL``; ``auto`` picks
    the Hopper kernel when :func:`supported`, the installed Triton is a tested release
    (:func:`.hopper_support.triton_blocks`: else one WARNING) and no portable ``prefill_config`` was asked
    for. ``hopper`` on inputs it cannot run, or on a Triton it does not compile with, raises
    ``ValueError`` with the reason. ``kv_quant``: the cache's quantized format (``kvcache/quant.py``):
    the Hopper kernel then runs on the bf16 / fp16 scratch that ``kernels/kv_dequant_gather.py``
    dequantizes the step's pages into (q's dtype, the caches' ``[blocks, Hkv, block_size, D]``
    contiguous), so the same checks apply to that scratch instead of the ``uint8`` codes; with
    ``FDFLEET_DEQUANT_SCRATCH_MB=0`` (no scratch) ``auto`` picks the portable prefill and ``hopper``
    raises ``ValueError``."""
    from .. import envs

    choice = impl if impl is not None else envs.prefill_kernel()
    if choice not in envs.PREFILL_KERNELS:
        raise ValueError(f"prefill_impl must be one of {envs.PREFILL_KERNELS}, got {choice!r}")
    if choice == "portable" or (choice == "auto" and prefill_config is not None):
        return "portable"
    if kv_quant is not None and envs.dequant_scratch_mb() == 0:  # no scratch: the codes' own prefill
        if choice == "hopper":
            setting = "prefill_impl='hopper'" if impl is not None else "FDFLEET_PREFILL_KERNEL=hopper"
            name = getattr(kv_quant, "name", kv_quant)
            raise ValueError(
                f"{setting} with FDFLEET_DEQUANT_SCRATCH_MB=0: the hopper prefill reads a quantized KV "
                f"cache (kv_cache_quant_type={name!r}) only through its scratch; allow one or use portable"
            )
        return "portable"
    if kv_quant is not None and torch is not None and isinstance(q, torch.Tensor):
        # the scratch's geometry (no memory: a meta tensor's address is 0, aligned like an allocation)
        hkv, bs = key_cache.shape[1], key_cache.shape[2]
        key_cache = torch.empty((1, hkv, bs, key_cache.shape[3]), dtype=q.dtype, device="meta")
        value_cache = torch.empty((1, hkv, bs, value_cache.shape[3]), dtype=q.dtype, device="meta")
    why = supported(q, key_cache, value_cache) or triton_blocks(choice)  # the Triton: hopper_support.py
    if why is None:
        return "hopper"
    if choice == "hopper":
        raise ValueError(f"the hopper prefill kernel cannot run these inputs: {why}")
    return "portable"


if GLUON_IMPORT_ERROR is None:
    CHUNK_C = gl.constexpr(CHUNK)
    # the copies' names: Triton 3.6's async_copy_global_to_shared became async_load (same arguments) in
    # later releases, which keep the old name only to raise
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # a shared-memory view under another dtype: Triton 3.6's _reinterpret(dtype, shape, layout) became
    # reinterpret(dtype=, shape=, layout=) later
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _page_entry(
        tbl_row, blk, n_blk, n_pages, need, Err, req, kvh,
        HEADWISE: gl.constexpr, HAS_ERR: gl.constexpr,
    ):  # fmt: skip
        """Table entry of logical block ``blk`` (a scalar) if it may be dereferenced (``0 <= entry <
        n_pages``, ``blk < n_blk``), else -1; with ``HAS_ERR`` a ``need``-ed bad entry is recorded in
        ``Err`` unless one was already (``kernels/errors.py``: first compare-and-swap wins)."""
        raw = gl.load(tbl_row + blk, mask=blk < n_blk, other=-1)
        good = (raw >= 0) & (raw < n_pages) & (blk < n_blk)
        if HAS_ERR:
            if need & (good == 0):
                code = gl.where(blk >= n_blk, 3, gl.where(raw < 0, 2, 1))
                if gl.atomic_cas(Err, 0, code) == 0:
                    gl.store(Err + 1, req)
                    gl.store(Err + 2, blk)
                    gl.store(Err + 3, gl.where(blk >= n_blk, n_blk, raw))
                    if HEADWISE:
                        gl.store(Err + 4, kvh)
                    else:
                        gl.store(Err + 4, -1)
                    gl.store(Err + 5, 4)  # errors.KERNEL_HOPPER_PREFILL
                    gl.store(Err + 6, n_pages)
        return gl.where(good, raw, -1).to(gl.int64)

    @gluon.jit
    def _tanh(x):
        """``tanh(x)`` from one ``exp2`` of ``-2|x|`` (no overflow), as the portable kernel computes it."""
        e = gl.exp2(-2.8853900817779268 * gl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return gl.where(x < 0, -t, t)

    @gluon.jit
    def _scheduled(item, n_items, SNAKE: gl.constexpr):
        """The work item a persistent CTA takes at loop index ``item`` (``p, p + grid, ...``). Items
        are numbered longest first; round robin gives CTA 0 the longest of every wave. ``SNAKE``
        reverses every second full wave, so each CTA's long and short items pair up (a model of the
        one-sequence 2048-token chunk: the slowest CTA does 44 tile-steps against 36.8 on average round
        robin, 38 with the snake). The last, partial wave keeps its order: reversed, it would skip
        items."""
        if SNAKE:
            g = gl.num_programs(0)
            k = item // g
            r = item - k * g
            flip = (k % 2 == 1) & ((k + 1) * g <= n_items)
            return gl.where(flip, k * g + g - 1 - r, item)
        else:
            return item

    @gluon.jit
    def _work_item(
        item, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_tok,
        HKV: gl.constexpr, TILE_Q: gl.constexpr, BLOCK_N: gl.constexpr,
        HEADWISE: gl.constexpr, HAS_WINDOW: gl.constexpr,
    ):  # fmt: skip
        """Work item ``item`` = (query tile, kv head): whether it exists, its request's offsets, the
        first token, the window, and its key tiles ``[a, a + n_tiles * BLOCK_N)``."""
        kvh = item % HKV
        tpid = item // HKV
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
        valid = (local < n_qt) & (q_len >= min_q_len) & (q0 >= 0) & (q0 + q_len <= n_tok)  # rows inside q
        tok0 = (n_qt - 1 - local) * TILE_Q  # a request's longest tiles first: less tail
        ctx = gl.load(Ctx + b)
        if HAS_WINDOW:
            w = gl.where((kvh >= win_h0) & (kvh < win_h1), window, 1 << 30)
        else:
            w = 1 << 30
        p_first = ctx + tok0
        p_last = ctx + gl.minimum(tok0 + TILE_Q, q_len) - 1
        a = gl.maximum(p_first - w, 0) // BLOCK_N * BLOCK_N
        n_tiles = gl.where(valid, (p_last + 1 - a + BLOCK_N - 1) // BLOCK_N, 0)
        tbl_row = Tbl + (b * HKV + kvh if HEADWISE else b) * stride_tbl
        return valid, kvh, q0, q_len, ctx, tok0, w, a, n_tiles, tbl_row, b

    @gluon.jit
    def _redo_wanted(Redo):
        """In the safe launch: whether this CTA's consumers found a non-finite output row in the fast
        launch (``Redo [2 * grid]``, one flag per consumer, set by the fast launch where a row came out
        non-finite, cleared by the safe launch once every partition has read it). Every partition asks,
        so all three agree; the CTA walks the same items in both launches."""
        pid = gl.program_id(0)
        return (gl.load(Redo + 2 * pid) | gl.load(Redo + 2 * pid + 1)) != 0

    @gluon.jit
    def _producer(
        Q, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
        flags, v_own, Redo, CuQ, Ctx, Tbl, stride_tbl, n_blk, num_reqs, min_q_len, window,
        win_h0, win_h1, n_items, stride_qt, stride_qh, stride_vr, Err, n_pages, n_tok,
        G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, HEADWISE: gl.constexpr, BS: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr, DQK: gl.constexpr,
        DV: gl.constexpr, QKC: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
        HAS_WINDOW: gl.constexpr, HAS_ERR: gl.constexpr, Q_LATE: gl.constexpr, SNAKE: gl.constexpr,
        Q_ASYNC: gl.constexpr, SAFE: gl.constexpr,
    ):  # fmt: skip
        """This CTA's items: in the fast launch always, in the safe launch (``SAFE``) only where a consumer
        asked for it (:func:`_redo_wanted`)."""
        go = True
        if SAFE:
            go = _redo_wanted(Redo)
        if go:
            _produce_pass(
                Q, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                v_empty, flags, v_own, CuQ, Ctx, Tbl, stride_tbl, n_blk, num_reqs, min_q_len, window, win_h0,
                win_h1, n_items, stride_qt, stride_qh, stride_vr, Err, n_pages, n_tok,
                G, GP, HKV, HEADWISE, BS, BLOCK_M, BLOCK_N, BOX, DQK, DV, QKC, NUM_STAGES, Q_BUFS,
                HAS_WINDOW, HAS_ERR, Q_LATE, SNAKE, Q_ASYNC, SAFE,
            )  # fmt: skip

    @gluon.jit
    def _produce_pass(
        Q, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
        flags, v_own, CuQ, Ctx, Tbl, stride_tbl, n_blk, num_reqs, min_q_len, window, win_h0, win_h1, n_items,
        stride_qt, stride_qh, stride_vr, Err, n_pages, n_tok,
        G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, HEADWISE: gl.constexpr, BS: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr, DQK: gl.constexpr,
        DV: gl.constexpr, QKC: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
        HAS_WINDOW: gl.constexpr, HAS_ERR: gl.constexpr, Q_LATE: gl.constexpr, SNAKE: gl.constexpr,
        Q_ASYNC: gl.constexpr, SAFE: gl.constexpr,
    ):  # fmt: skip
        """The producer's walk over the items; ``SAFE``: mixed tiles' V cleaned (:func:`_clean_tile`)."""
        NQC: gl.constexpr = DQK // QKC
        TILE_Q: gl.constexpr = 2 * (BLOCK_M // GP)
        NBOX: gl.constexpr = BLOCK_N // BOX
        K_BYTES: gl.constexpr = BLOCK_N * DQK * k_desc.dtype.primitive_bitwidth // 8
        V_BYTES: gl.constexpr = BLOCK_N * DV * v_desc.dtype.primitive_bitwidth // 8
        # plain loads of 16 rows x whole heads (192-wide ones in three 64-column parts: gl.arange needs
        # powers of two); one load per row chunk keeps several 16-byte vectors per thread in flight
        # (64-column chunks throughout measured 2-4 % slower on 128 / 128, benchmarks/NOTES.md)
        ROWS: gl.constexpr = 16
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        offs_q = gl.arange(0, QKC, layout=gl.SliceLayout(0, ld))
        offs_v = gl.arange(0, DV, layout=gl.SliceLayout(0, ld))
        it = 0
        qi = 0
        own = 0  # V tiles copied on v_own (its phase; only the safe launch uses it)
        pend = -1  # the stage of a V tile on v_own not yet cleaned (-1: none)
        for step in range(gl.program_id(0), n_items, gl.num_programs(0)):
            item = _scheduled(step, n_items, SNAKE)
            valid, kvh, q0, q_len, ctx, tok0, w, a, n_tiles, tbl_row, b = _work_item(
                item, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_tok,
                HKV, TILE_Q, BLOCK_N, HEADWISE, HAS_WINDOW,
            )  # fmt: skip
            if valid:
                kv_len = ctx + q_len
                lo_key = gl.maximum(ctx + tok0 - w, 0)  # keys below it may be released (-1)
                p_first = ctx + tok0
                p_last = ctx + gl.minimum(tok0 + TILE_Q, q_len) - 1
                if not Q_LATE:
                    _load_q(Q, q_bufs, q_ready, q_empty, qi, q0, q_len, tok0, kvh, stride_qt, stride_qh,
                            offs_r, offs_q, G, GP, BLOCK_M, DQK, QKC, Q_BUFS, Q_ASYNC)  # fmt: skip
                for j in range(n_tiles):
                    s = it % NUM_STAGES
                    phase = (it // NUM_STAGES) & 1
                    key0 = a + j * BLOCK_N
                    # K: one copy per page box and 64-column chunk (absent pages read page 0: masked;
                    # entries past the cache or the table count as absent, never dereferenced)
                    mbarrier.wait(k_empty.index(s), phase)
                    mbarrier.expect(k_ready.index(s), K_BYTES)
                    absent = False
                    for i in gl.static_range(NBOX):
                        kb0 = key0 + i * BOX
                        blk = kb0 // BS
                        need = (kb0 < kv_len) & (kb0 + BOX > lo_key)
                        page = _page_entry(tbl_row, blk, n_blk, n_pages, need, Err, b, kvh, HEADWISE, HAS_ERR)
                        if not HEADWISE:
                            page = gl.where(page >= 0, page * HKV + kvh, -1)
                        absent = absent | (page < 0)
                        row = (gl.maximum(page, 0) * BS + (key0 + i * BOX) % BS).to(gl.int32)
                        for c in gl.static_range(DQK // CHUNK_C):
                            _tma_load(
                                k_desc, [row, c * CHUNK_C], k_ready.index(s),
                                k_bufs.index(s * NQC + c * CHUNK_C // QKC).slice(i * BOX, BOX, dim=0)
                                .slice(c * CHUNK_C % QKC, CHUNK_C, dim=1),
                            )  # fmt: skip
                    if Q_LATE:  # Q behind the item's first K tile: its copy overlaps the Q loads
                        if j == 0:
                            _load_q(Q, q_bufs, q_ready, q_empty, qi, q0, q_len, tok0, kvh, stride_qt,
                                    stride_qh, offs_r, offs_q, G, GP, BLOCK_M, DQK, QKC, Q_BUFS,
                                    Q_ASYNC)  # fmt: skip
                    if SAFE:
                        if pend >= 0:  # the previous tile's V: cleaned now that this tile's K is on its way
                            own = _clean_own(v_bufs, flags, v_ready, v_own, pend, own, key0 - BLOCK_N,
                                             p_first, p_last - w, BLOCK_N, DV)  # fmt: skip
                            pend = -1
                    mbarrier.wait(v_empty.index(s), phase)
                    vb = v_bufs.index(s)
                    # in the safe launch, a tile whose keys some rows of the item see and others do not
                    # (the causal diagonal, the window's edge: a superset of what either consumer masks)
                    # has its non-finite V entries zeroed and flagged per key (_clean_tile): in P @ V
                    # they would meet the zero P of the rows that may not see them (0 * NaN = NaN)
                    mixed = False
                    if SAFE:
                        mixed = _masked(key0, p_first, p_last, w, BLOCK_N, HAS_WINDOW)
                    if absent | (key0 + BLOCK_N > kv_len):
                        # plain loads with the invalid rows zeroed (stale slots may hold NaN and
                        # 0 * NaN = NaN in P @ V), then published to the async proxy
                        for r0 in gl.static_range(0, BLOCK_N, ROWS):
                            keys = key0 + r0 + offs_r
                            pg = gl.load(tbl_row + keys // BS, mask=keys // BS < n_blk, other=-1).to(gl.int64)
                            pg = gl.where(pg < n_pages, pg, -1)
                            if not HEADWISE:
                                pg = gl.where(pg >= 0, pg * HKV + kvh, -1)
                            v_ok = (pg >= 0) & (keys < kv_len)
                            v_rows = (gl.maximum(pg, 0) * BS + keys % BS) * stride_vr
                            v_ptrs = V + gl.expand_dims(v_rows, 1) + gl.expand_dims(offs_v, 0)
                            vals = gl.load(v_ptrs, mask=gl.expand_dims(v_ok, 1), other=0.0)
                            vb.slice(r0, ROWS, dim=0).store(vals)
                        if SAFE:
                            _clean_tile(vb, flags.index(s), key0, p_first, p_last - w, BLOCK_N, DV)
                        gh.fence_async_shared()
                        mbarrier.arrive(v_ready.index(s), count=1)
                    else:
                        # by TMA: onto v_ready, or for a mixed tile onto the producer's own barrier,
                        # cleaned in shared memory after the next tile's K copies are issued (the
                        # consumers need this V only for the next tile's P @ V)
                        if mixed:
                            _copy_v(v_desc, v_own.index(0), vb, tbl_row, key0, n_blk, kvh, V_BYTES, HKV,
                                    HEADWISE, BS, BOX, NBOX, DV)  # fmt: skip
                            pend = s
                        else:
                            _copy_v(v_desc, v_ready.index(s), vb, tbl_row, key0, n_blk, kvh, V_BYTES, HKV,
                                    HEADWISE, BS, BOX, NBOX, DV)  # fmt: skip
                    it += 1
                if SAFE:
                    if pend >= 0:  # the item's last V: its consumers wait for it before its last P @ V
                        own = _clean_own(v_bufs, flags, v_ready, v_own, pend, own,
                                         a + (n_tiles - 1) * BLOCK_N, p_first, p_last - w, BLOCK_N,
                                         DV)  # fmt: skip
                        pend = -1
                qi += 1

    @gluon.jit
    def _copy_v(
        v_desc, bar, vb, tbl_row, key0, n_blk, kvh, V_BYTES: gl.constexpr, HKV: gl.constexpr,
        HEADWISE: gl.constexpr, BS: gl.constexpr, BOX: gl.constexpr, NBOX: gl.constexpr, DV: gl.constexpr,
    ):  # fmt: skip
        """The V tile of keys ``[key0, key0 + NBOX * BOX)`` into ``vb`` by TMA, one copy per page box and
        64-column chunk, completing on ``bar`` (its expected bytes set here)."""
        mbarrier.expect(bar, V_BYTES)
        for i in gl.static_range(NBOX):
            blk = (key0 + i * BOX) // BS
            page = gl.load(tbl_row + blk, mask=blk < n_blk, other=0).to(gl.int64)
            if not HEADWISE:
                page = page * HKV + kvh
            row = (page * BS + (key0 + i * BOX) % BS).to(gl.int32)
            for c in gl.static_range(DV // CHUNK_C):
                _tma_load(
                    v_desc, [row, c * CHUNK_C], bar,
                    vb.slice(i * BOX, BOX, dim=0).slice(c * CHUNK_C, CHUNK_C, dim=1),
                )  # fmt: skip

    @gluon.jit
    def _clean_own(v_bufs, flags, v_ready, v_own, st, own, key0, lo, hi, BLOCK_N: gl.constexpr,
                   DV: gl.constexpr):  # fmt: skip
        """Wait for the V tile of stage ``st`` (keys from ``key0``) copied onto ``v_own`` (its ``own``-th
        copy), clean it in shared memory (:func:`_clean_tile`) and publish it on ``v_ready``; returns
        ``own + 1``."""
        vb = v_bufs.index(st)
        mbarrier.wait(v_own.index(0), own & 1)
        _clean_tile(vb, flags.index(st), key0, lo, hi, BLOCK_N, DV)
        gh.fence_async_shared()
        mbarrier.arrive(v_ready.index(st), count=1)
        return own + 1

    @gluon.jit
    def _clean_tile(vb, flags_st, key0, lo, hi, BLOCK_N: gl.constexpr, DV: gl.constexpr):
        """Zero the non-finite entries of the V tile ``vb [BLOCK_N, DV]`` (keys from ``key0``) in shared
        memory and set ``flags_st[n]`` to 1 for each key that had one (else 0): the consumers make the
        rows that see a flagged key NaN (:func:`_poison`), and in ``P @ V`` the zeros meet the rows that
        may not see it exactly. Only 16-key chunks holding a key that some row may not see (above
        ``lo``, the item's first position, or below ``hi``, its last position less the window) are
        read; a NaN in a key every row sees reaches every row through ``P @ V`` as dense attention's
        would. Read as 32-bit words of two elements (the producer's 40 registers and issue slots are
        shared with the consumers' softmax): an element is Inf or NaN when all its exponent bits are
        set, i.e. when adding one exponent step carries into its sign bit."""
        ROWS: gl.constexpr = 16
        W: gl.constexpr = DV // 2
        LANES: gl.constexpr = W // 4 if W // 4 < 32 else 32
        wl: gl.constexpr = gl.BlockedLayout([1, 4], [32 // LANES, LANES], [4, 1], [1, 0])
        if vb.dtype == gl.bfloat16:
            EXP: gl.constexpr = 0x7F807F80
            STEP: gl.constexpr = 0x00800080
        else:
            EXP: gl.constexpr = 0x7C007C00
            STEP: gl.constexpr = 0x04000400
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, W], gl.uint32)
        if _NEW_REINTERPRET:
            words = vb.reinterpret(gl.uint32, [BLOCK_N, W], w_layout)
        else:
            words = vb._reinterpret(gl.uint32, [BLOCK_N, W], w_layout)
        for r0 in gl.static_range(0, BLOCK_N, ROWS):
            fl = flags_st.slice(r0, ROWS, dim=0)
            if (key0 + r0 + ROWS - 1 > lo) | (key0 + r0 < hi):
                chunk = words.slice(r0, ROWS, dim=0)
                x = chunk.load(wl)
                sign = ((x & EXP) + STEP) & 0x80008000  # bit 15 / 31: that half is Inf or NaN
                chunk.store(x & ~((sign >> 15) * 0xFFFF))
                fl.store((gl.max(sign, 1) != 0).to(gl.int8))
            else:
                fl.store(gl.zeros([ROWS], gl.int8, gl.SliceLayout(1, wl)))

    @gluon.jit
    def _load_q(
        Q, q_bufs, q_ready, q_empty, qi, q0, q_len, tok0, kvh, stride_qt, stride_qh, offs_r, offs_q,
        G: gl.constexpr, GP: gl.constexpr, BLOCK_M: gl.constexpr, DQK: gl.constexpr, QKC: gl.constexpr,
        Q_BUFS: gl.constexpr, Q_ASYNC: gl.constexpr,
    ):  # fmt: skip
        """An item's query rows (tokens x padded group heads, both consumers' halves) into Q buffer
        ``qi % Q_BUFS`` once both consumers released it, in ``[16, QKC]`` parts: with ``Q_ASYNC`` by
        ``cp.async`` (masked rows zero-filled) that complete ``q_ready`` on their own, so the producer
        goes straight on to the item's K/V copies (the consumers fence before their wgmma's read the
        buffer); else by plain loads through registers, whose round trips the producer waits out."""
        ROWS: gl.constexpr = 16
        NQC: gl.constexpr = DQK // QKC
        qs = qi % Q_BUFS
        mbarrier.wait(q_empty.index(qs), (qi // Q_BUFS) & 1)
        for r0 in gl.static_range(0, 2 * BLOCK_M, ROWS):
            r = r0 + offs_r
            tok = tok0 + r // GP
            hh = r % GP
            q_ok = gl.expand_dims((tok < q_len) & (hh < G), 1)
            q_rows = gl.expand_dims((q0 + tok).to(gl.int64) * stride_qt + (kvh * G + hh) * stride_qh, 1)
            for c in gl.static_range(NQC):
                q_ptrs = Q + q_rows + gl.expand_dims(c * QKC + offs_q, 0)
                dst = q_bufs.index(qs * NQC + c).slice(r0, ROWS, dim=0)
                if Q_ASYNC:
                    _cp_async(dst, q_ptrs, mask=q_ok)
                else:
                    dst.store(gl.load(q_ptrs, mask=q_ok, other=0.0))
        if Q_ASYNC:
            # each thread's copies hold q_ready's phase open (pending count +1, arrival when they land);
            # the one plain arrival below is the phase's expected count
            async_copy.mbarrier_arrive(q_ready.index(qs))
        else:
            gh.fence_async_shared()
        mbarrier.arrive(q_ready.index(qs), count=1)

    @gluon.jit
    def _qk(q_bufs, k_bufs, qs, st, s_zero, HALF: gl.constexpr, NQC: gl.constexpr, BLOCK_M: gl.constexpr):
        """Issue ``S = Q K^T`` for this warpgroup's ``[BLOCK_M]`` rows of Q buffer ``qs`` and K stage ``st``
        (async, one commit group; Dqk in ``NQC`` parts: shared-memory shapes are powers of 2)."""
        s_tok = s_zero
        for c in gl.static_range(NQC):
            s_tok = gh.warpgroup_mma(
                q_bufs.index(qs * NQC + c).slice(HALF * BLOCK_M, BLOCK_M, dim=0),
                k_bufs.index(st * NQC + c).permute((1, 0)),
                s_tok,
                use_acc=c > 0,
                is_async=True,
            )
        return s_tok

    @gluon.jit
    def _visible(key0, w, pos, offs_n, HAS_WINDOW: gl.constexpr):
        """``[BLOCK_M, BLOCK_N]``: whether the row at position ``pos`` may see key ``key0 + n`` (causal,
        and within the window ``w`` where there is one)."""
        keys = key0 + offs_n
        vis = gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1)
        if HAS_WINDOW:
            vis = vis & (gl.expand_dims(pos, 1) - gl.expand_dims(keys, 0) <= w)
        return vis

    @gluon.jit
    def _masked(key0, p_lo, p_hi, w, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """Whether the key tile from ``key0`` touches the causal diagonal or the window's leading edge of
        the rows at positions ``[p_lo, p_hi]`` (the only tiles that need the mask)."""
        need = key0 + BLOCK_N - 1 > p_lo
        if HAS_WINDOW:
            need = need | (key0 < p_hi - w)
        return need

    @gluon.jit
    def _softmax_tile(
        s, m_i, l_i, key0, p_lo, p_hi, w, pos, offs_n, sc, qk_scale,
        BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, PROFILE: gl.constexpr,
    ):  # fmt: skip
        """Online softmax of one tile's scores ``s [BLOCK_M, BLOCK_N]`` (keys from ``key0``): ``(p, m_i,
        l_i, alpha)``, ``alpha`` the factor for the accumulator. The mask only on tiles touching the
        causal diagonal or the window's edge of these rows (:func:`_masked`)."""
        if PROFILE == 1:  # timing ablation (benchmarks only): no softmax, P = S
            p = s
            alpha = m_i
        else:
            if SOFTCAP != 0.0:  # cap * log2(e) * tanh(scale * q.k / cap): qk_scale is scale / cap
                s = _tanh(s * qk_scale) * SOFTCAP
            if _masked(key0, p_lo, p_hi, w, BLOCK_N, HAS_WINDOW):
                s = gl.where(_visible(key0, w, pos, offs_n, HAS_WINDOW), s * sc, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                p = gl.exp2(s - gl.expand_dims(m_new, 1))
            else:
                m_new = gl.maximum(m_i, gl.max(s, 1) * sc)
                p = gl.exp2(s * sc - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
        return p, m_i, l_i, alpha

    @gluon.jit
    def _poison(l_i, key0, i_lo, i_hi, w, pos, offs_n, flags_st,
                BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr, SAFE: gl.constexpr):  # fmt: skip
        """``l_i`` made NaN in the rows that see a key of a masked tile whose V the producer cleaned
        (``flags_st``, valid once that tile's ``v_ready`` has been waited for): the zeroed entries would
        otherwise hide a NaN that dense attention returns, while the rows that may not see the key stay
        exact (masked keys contribute nothing). Asked when the tile's ``P @ V`` is issued, a tile after
        its softmax, so the consumers never wait for V before a softmax. ``i_lo`` / ``i_hi``: the first
        and last positions of the whole item (both consumers' rows), as the producer decides which
        tiles it cleans: a tile it cleaned for the other consumer's rows may hide a NaN from these."""
        if SAFE:  # the fast pass cleans nothing
            if _masked(key0, i_lo, i_hi, w, BLOCK_N, HAS_WINDOW):
                bad = flags_st.load(offs_n.type.layout)
                seen = _visible(key0, w, pos, offs_n, HAS_WINDOW) & (gl.expand_dims(bad, 0) != 0)
                l_i = gl.where(gl.max(seen.to(gl.int32), 1) > 0, float("nan"), l_i)
        return l_i

    @gluon.jit
    def _turn(tok, HALF: gl.constexpr, MODE: gl.constexpr):
        """FA3's ping-pong between the two consumer warpgroups on hardware named barriers 8 (warpgroup 0's
        turn) and 9 (warpgroup 1's); Triton 3.6 takes 0 for the default partition's own barrier, 1 for
        warp_specialize's entry / exit and 2, 3 for the other partitions. ``MODE`` 0: wait for this
        warpgroup's turn (``bar.sync`` on its barrier: its 128 threads plus the other warpgroup's 128
        arrivals); 1: pass the turn (``bar.arrive`` on the other's barrier, no wait); 2: give this
        warpgroup the first turn (``bar.arrive`` on its own barrier, once, warpgroup 0). ``tok``: one
        int32 per thread (``[128]`` over 4 warps), so the barrier runs exactly once per thread."""
        if MODE == 0:
            if HALF == 0:
                asm: gl.constexpr = "bar.sync 8, 256;\n\tmov.b32 $0, $1;"
            else:
                asm: gl.constexpr = "bar.sync 9, 256;\n\tmov.b32 $0, $1;"
        elif MODE == 1:
            if HALF == 0:
                asm: gl.constexpr = "bar.arrive 9, 256;\n\tmov.b32 $0, $1;"
            else:
                asm: gl.constexpr = "bar.arrive 8, 256;\n\tmov.b32 $0, $1;"
        else:
            asm: gl.constexpr = "bar.arrive 8, 256;\n\tmov.b32 $0, $1;"  # warpgroup 0's first turn
        return gl.inline_asm_elementwise(asm, "=r,r", [tok], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _item_peeled(
        q_bufs, k_bufs, v_bufs, flags, k_ready, v_ready, k_empty, v_empty, q_empty, qs, it, n_tiles, a,
        acc, p_prev, s_zero, m_i, l_i, p_lo, p_hi, i_lo, i_hi, w, pos, offs_n, sc, qk_scale, tok,
        HALF: gl.constexpr, NQC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, PROFILE: gl.constexpr,
        PINGPONG: gl.constexpr, SAFE: gl.constexpr,
    ):  # fmt: skip
        """One item's key tiles with the first tile peeled off the loop, so every wgmma wait in the loop
        is unconditional: with ``if j > 0`` around the ``P @ V`` issue and again around its wait, ptxas
        cannot tell the branches agree, finds a path on which the accumulator is read with its wgmma in
        flight, and serialises every wgmma of the kernel (C7514 / C7512 in ``ptxas -v``;
        ``benchmarks/probes/hopper_compile.py`` reports it). Returns ``(acc, l_i, tok)``.

        ``PINGPONG``: each group of wgmma issues (tile 0's ``S``; ``S(j)`` with ``P(j-1) V(j-1)``; the
        last ``P @ V``) is one turn: wait for the turn, issue, pass it. Cannot deadlock: (1) both
        consumers walk the same items with the same ``n_tiles`` (``_work_item`` of the same item; a
        half whose rows are all padding still walks every tile), so they take ``n_tiles + 1`` turns per
        item each and the turns strictly alternate, warpgroup 0 first; (2) nothing blocks inside a turn
        (the mbarrier waits for K / V come before it), so a turn is always passed; (3) a consumer
        waiting for its turn is at most one turn ahead of the other, which has already released every
        stage and Q buffer older than its current tile, so the producer is never waiting on it. The
        last pass of a CTA stays unmatched (128 arrivals on a barrier nobody waits on): harmless at exit."""
        dtype: gl.constexpr = p_prev.dtype
        p_layout: gl.constexpr = p_prev.type.layout
        o_layout: gl.constexpr = acc.type.layout
        if n_tiles > 0:  # always (a valid item has a key tile); the guard keeps the turns balanced anyway
            st = it % NUM_STAGES
            mbarrier.wait(k_ready.index(st), (it // NUM_STAGES) & 1)
            if PINGPONG:
                tok = _turn(tok, HALF, 0)
            s_tok = _qk(q_bufs, k_bufs, qs, st, s_zero, HALF, NQC, BLOCK_M)
            if PINGPONG:
                tok = _turn(tok, HALF, 1)
            s = gh.warpgroup_mma_wait(0, deps=[s_tok])
            mbarrier.arrive(k_empty.index(st), count=1)
            # acc is still zero: nothing to rescale
            p, m_i, l_i, alpha = _softmax_tile(
                s, m_i, l_i, a, p_lo, p_hi, w, pos, offs_n, sc, qk_scale,
                BLOCK_N, HAS_WINDOW, SOFTCAP, PROFILE,
            )  # fmt: skip
            p_prev = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_tiles):
                st = (it + j) % NUM_STAGES
                pst = (it + j - 1) % NUM_STAGES
                mbarrier.wait(k_ready.index(st), ((it + j) // NUM_STAGES) & 1)
                mbarrier.wait(v_ready.index(pst), ((it + j - 1) // NUM_STAGES) & 1)
                if PINGPONG:
                    tok = _turn(tok, HALF, 0)
                s_tok = _qk(q_bufs, k_bufs, qs, st, s_zero, HALF, NQC, BLOCK_M)
                # P(j-1) V(j-1) behind S(j): retires while this tile's softmax runs
                acc = gh.warpgroup_mma(p_prev, v_bufs.index(pst), acc, is_async=True)
                if PINGPONG:
                    tok = _turn(tok, HALF, 1)
                l_i = _poison(l_i, a + (j - 1) * BLOCK_N, i_lo, i_hi, w, pos, offs_n, flags.index(pst),
                              BLOCK_N, HAS_WINDOW, SAFE)  # fmt: skip
                s, acc = gh.warpgroup_mma_wait(1, deps=[s_tok, acc])
                mbarrier.arrive(k_empty.index(st), count=1)
                p, m_i, l_i, alpha = _softmax_tile(
                    s, m_i, l_i, a + j * BLOCK_N, p_lo, p_hi, w, pos, offs_n, sc, qk_scale,
                    BLOCK_N, HAS_WINDOW, SOFTCAP, PROFILE,
                )  # fmt: skip
                acc = gh.warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(v_empty.index(pst), count=1)
                if PROFILE != 1:
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p_prev = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.arrive(q_empty.index(qs), count=1)  # every S wgmma of this item has retired
            lst = (it + n_tiles - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(lst), ((it + n_tiles - 1) // NUM_STAGES) & 1)
            if PINGPONG:
                tok = _turn(tok, HALF, 0)
            acc = gh.warpgroup_mma(p_prev, v_bufs.index(lst), acc, is_async=True)
            if PINGPONG:
                tok = _turn(tok, HALF, 1)
            l_i = _poison(l_i, a + (n_tiles - 1) * BLOCK_N, i_lo, i_hi, w, pos, offs_n, flags.index(lst),
                          BLOCK_N, HAS_WINDOW, SAFE)  # fmt: skip
            acc = gh.warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(v_empty.index(lst), count=1)
        else:
            mbarrier.arrive(q_empty.index(qs), count=1)
        return acc, l_i, tok

    @gluon.jit
    def _store_o(O, out, tok0, q0, q_len, kvh, stride_ot, stride_oh, offs_m, offs_d, G: gl.constexpr,
                 GP: gl.constexpr):  # fmt: skip
        """Store a consumer's output rows ``out [BLOCK_M, DV]`` (rows = tokens from ``tok0`` x padded
        group heads; ``offs_m`` / ``offs_d`` in ``out``'s layout), rows past the request or the group
        left out."""
        otok = tok0 + offs_m // GP
        ohh = offs_m % GP
        o_ok = (otok < q_len) & (ohh < G)
        o_rows = (q0 + otok).to(gl.int64) * stride_ot + (kvh * G + ohh) * stride_oh
        gl.store(O + gl.expand_dims(o_rows, 1) + gl.expand_dims(offs_d, 0), out, mask=gl.expand_dims(o_ok, 1))

    @gluon.jit
    def _consumer(
        O, Sinks, q_bufs, k_bufs, v_bufs, flags, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
        Redo, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_items,
        qk_scale, stride_ot, stride_oh, n_tok,
        HALF: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, DQK: gl.constexpr,
        DV: gl.constexpr, QKC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, HEADWISE: gl.constexpr, HAS_WINDOW: gl.constexpr,
        SINK_MODE: gl.constexpr, SOFTCAP: gl.constexpr, PROFILE: gl.constexpr, PEEL: gl.constexpr,
        PINGPONG: gl.constexpr, SNAKE: gl.constexpr, Q_ASYNC: gl.constexpr, O_VEC: gl.constexpr,
        SAFE: gl.constexpr,
    ):  # fmt: skip
        """Rows ``[HALF * BLOCK_M, (HALF + 1) * BLOCK_M)`` of every work item of this CTA. The fast launch
        sets ``Redo[2 * pid + HALF]`` to 1 where one of these rows came out non-finite (a NaN or Inf,
        maybe from a key it may not see); the safe launch (``SAFE``) walks the items again only where
        either consumer set it (:func:`_redo_wanted`)."""
        go = True
        if SAFE:
            go = _redo_wanted(Redo)
        if go:
            _consume_pass(
                Redo, O, Sinks, q_bufs, k_bufs, v_bufs, flags, q_ready, q_empty, k_ready, v_ready, k_empty,
                v_empty, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_items,
                qk_scale, stride_ot, stride_oh, n_tok,
                HALF, G, GP, HKV, DQK, DV, QKC, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFS, HEADWISE, HAS_WINDOW,
                SINK_MODE, SOFTCAP, PROFILE, PEEL, PINGPONG, SNAKE, Q_ASYNC, O_VEC, SAFE,
            )  # fmt: skip

    @gluon.jit
    def _consume_pass(
        Redo, O, Sinks, q_bufs, k_bufs, v_bufs, flags, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
        CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_items, qk_scale,
        stride_ot, stride_oh, n_tok,
        HALF: gl.constexpr, G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, DQK: gl.constexpr,
        DV: gl.constexpr, QKC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, HEADWISE: gl.constexpr, HAS_WINDOW: gl.constexpr,
        SINK_MODE: gl.constexpr, SOFTCAP: gl.constexpr, PROFILE: gl.constexpr, PEEL: gl.constexpr,
        PINGPONG: gl.constexpr, SNAKE: gl.constexpr, Q_ASYNC: gl.constexpr, O_VEC: gl.constexpr,
        SAFE: gl.constexpr,
    ):  # fmt: skip
        """The consumer's walk over this CTA's items. The fast pass sets ``Redo[2 * pid + HALF]`` to 1 when
        a row of an item comes out non-finite (not asked with ``SAFE``, where rows that see a key whose V
        the producer cleaned are made NaN: :func:`_poison`)."""
        BLOCK_Q: gl.constexpr = BLOCK_M // GP
        TILE_Q: gl.constexpr = 2 * BLOCK_Q
        NQC: gl.constexpr = DQK // QKC
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = O.dtype.element_ty
        offs_m = gl.arange(0, BLOCK_M, layout=row_l)
        offs_n = gl.arange(0, BLOCK_N, layout=col_l)
        offs_om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_od = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        # the output's store layout: 8 elements (16 bytes) per thread, a row's DV columns over DV // 8 lanes
        LANES_D: gl.constexpr = DV // 8 if DV // 8 < 32 else 32
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_D, LANES_D], [4, 1], [1, 0])
        offs_sm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
        offs_sd = gl.arange(0, DV, layout=gl.SliceLayout(0, st_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        if SOFTCAP != 0.0:  # capped scores are already scaled (base 2)
            sc = 1.0
        else:
            sc = qk_scale
        # ping-pong token: one int32 per thread, so each inline-asm named barrier runs once per thread
        tok = gl.zeros([128], gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        if PINGPONG:
            if HALF == 0:  # warpgroup 0 takes the first turn (see _turn)
                tok = _turn(tok, 0, 2)
        it = 0
        qi = 0
        flag = Redo + 2 * gl.program_id(0) + HALF + offs_om * 0  # [BLOCK_M] pointers to this consumer's flag
        for step in range(gl.program_id(0), n_items, gl.num_programs(0)):
            item = _scheduled(step, n_items, SNAKE)
            valid, kvh, q0, q_len, ctx, tile_tok0, w, a, n_tiles, tbl_row, b = _work_item(
                item, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window, win_h0, win_h1, n_tok,
                HKV, TILE_Q, BLOCK_N, HEADWISE, HAS_WINDOW,
            )  # fmt: skip
            if valid:
                tok0 = tile_tok0 + HALF * BLOCK_Q
                qs = qi % Q_BUFS
                mbarrier.wait(q_ready.index(qs), (qi // Q_BUFS) & 1)
                if Q_ASYNC:  # the producer's cp.async writes (generic proxy) before the wgmma's read them
                    gh.fence_async_shared()
                pos = ctx + tok0 + offs_m // GP
                p_lo = ctx + tok0  # first row's position
                p_hi = ctx + gl.minimum(tok0 + BLOCK_Q, q_len) - 1  # last valid row's position
                i_lo = ctx + tile_tok0  # the item's first and last positions (both consumers' rows)
                i_hi = ctx + gl.minimum(tile_tok0 + TILE_Q, q_len) - 1
                if SINK_MODE == 1:
                    head = kvh * G + offs_m % GP
                    m_i = gl.load(Sinks + head, mask=(offs_m % GP) < G, other=0.0).to(gl.float32)
                    m_i = m_i * 1.4426950408889634
                    l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_l)
                elif SINK_MODE == 2:
                    m_i = gl.zeros([BLOCK_M], gl.float32, row_l)
                    l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_l)
                else:
                    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, row_l)
                    l_i = gl.zeros([BLOCK_M], gl.float32, row_l)
                acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
                p_prev = gl.zeros([BLOCK_M, BLOCK_N], dtype, p_layout)
                if PEEL:
                    acc, l_i, tok = _item_peeled(
                        q_bufs, k_bufs, v_bufs, flags, k_ready, v_ready, k_empty, v_empty, q_empty, qs, it,
                        n_tiles, a, acc, p_prev, s_zero, m_i, l_i, p_lo, p_hi, i_lo, i_hi, w, pos, offs_n, sc,
                        qk_scale,
                        tok, HALF, NQC, BLOCK_M, BLOCK_N, NUM_STAGES, HAS_WINDOW, SOFTCAP, PROFILE, PINGPONG,
                        SAFE,
                    )  # fmt: skip
                else:
                    for j in range(n_tiles):
                        st = (it + j) % NUM_STAGES
                        key0 = a + j * BLOCK_N
                        mbarrier.wait(k_ready.index(st), ((it + j) // NUM_STAGES) & 1)
                        s_tok = _qk(q_bufs, k_bufs, qs, st, s_zero, HALF, NQC, BLOCK_M)
                        if j > 0:  # P(j-1) V(j-1) behind S(j): retires while this tile's softmax runs
                            pst = (it + j - 1) % NUM_STAGES
                            mbarrier.wait(v_ready.index(pst), ((it + j - 1) // NUM_STAGES) & 1)
                            acc = gh.warpgroup_mma(p_prev, v_bufs.index(pst), acc, is_async=True)
                            l_i = _poison(l_i, key0 - BLOCK_N, i_lo, i_hi, w, pos, offs_n, flags.index(pst),
                                          BLOCK_N, HAS_WINDOW, SAFE)  # fmt: skip
                            s, acc = gh.warpgroup_mma_wait(1, deps=[s_tok, acc])
                        else:
                            s = gh.warpgroup_mma_wait(0, deps=[s_tok])
                        mbarrier.arrive(k_empty.index(st), count=1)
                        p, m_i, l_i, alpha = _softmax_tile(
                            s, m_i, l_i, key0, p_lo, p_hi, w, pos, offs_n, sc, qk_scale,
                            BLOCK_N, HAS_WINDOW, SOFTCAP, PROFILE,
                        )  # fmt: skip
                        if j > 0:
                            acc = gh.warpgroup_mma_wait(0, deps=[acc])
                            mbarrier.arrive(v_empty.index((it + j - 1) % NUM_STAGES), count=1)
                        if PROFILE != 1:
                            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
                            acc = acc * gl.expand_dims(alpha_o, 1)
                        p_prev = gl.convert_layout(p.to(dtype), p_layout)
                    mbarrier.arrive(q_empty.index(qs), count=1)  # every S wgmma of this item has retired
                    if n_tiles > 0:
                        lst = (it + n_tiles - 1) % NUM_STAGES
                        mbarrier.wait(v_ready.index(lst), ((it + n_tiles - 1) // NUM_STAGES) & 1)
                        acc = gh.warpgroup_mma(p_prev, v_bufs.index(lst), acc, is_async=True)
                        l_i = _poison(l_i, a + (n_tiles - 1) * BLOCK_N, i_lo, i_hi, w, pos, offs_n,
                                      flags.index(lst), BLOCK_N, HAS_WINDOW, SAFE)  # fmt: skip
                        acc = gh.warpgroup_mma_wait(0, deps=[acc])
                        mbarrier.arrive(v_empty.index(lst), count=1)
                it += n_tiles
                qi += 1
                l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
                # l_i NaN where _poison found a seen non-finite V: the row is NaN, as dense attention's
                o32 = acc / gl.expand_dims(gl.where(l_o == 0, 1.0, l_o), 1)
                # a row's sum is NaN or Inf when one of its entries is (x - x is then NaN)
                if not SAFE and PROFILE != 3:
                    rs = gl.sum(o32, 1)
                    ok = (tok0 + offs_om // GP < q_len) & (offs_om % GP < G)
                    gl.store(flag, gl.full_like(offs_om, 1), mask=ok & (rs - rs != 0))
                out = o32.to(dtype)
                if O_VEC:  # 16-byte stores of whole row segments (the wgmma layout stores 4 bytes each)
                    out = gl.convert_layout(out, st_layout)
                    _store_o(O, out, tok0, q0, q_len, kvh, stride_ot, stride_oh, offs_sm, offs_sd, G, GP)
                else:
                    _store_o(O, out, tok0, q0, q_len, kvh, stride_ot, stride_oh, offs_om, offs_od, G, GP)

    @gluon.jit(do_not_specialize=["stride_tbl", "n_blk", "n_pages", "n_tok", "num_reqs", "n_items"])
    def _hopper_prefill_kernel(
        Q, O, V, k_desc, v_desc, Sinks, CuQ, Ctx, Tbl, Err, Redo,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_vr, stride_tbl, n_blk, n_pages, n_tok,
        num_reqs, min_q_len, qk_scale, window, win_h0, win_h1, n_items,
        G: gl.constexpr, GP: gl.constexpr, HKV: gl.constexpr, DQK: gl.constexpr, DV: gl.constexpr,
        QKC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BS: gl.constexpr, BOX: gl.constexpr,
        NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, HEADWISE: gl.constexpr, HAS_WINDOW: gl.constexpr,
        SINK_MODE: gl.constexpr, SOFTCAP: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, HAS_ERR: gl.constexpr, Q_LATE: gl.constexpr, PROFILE: gl.constexpr = 0,
        PEEL: gl.constexpr = False, PINGPONG: gl.constexpr = False, SNAKE: gl.constexpr = False,
        Q_ASYNC: gl.constexpr = False, O_VEC: gl.constexpr = False, SAFE: gl.constexpr = False,
    ):  # fmt: skip
        # persistent: CTA p takes work items p, p + grid, ... (items are ordered longest first)
        # Q and K rows held in DQK // QKC parts of QKC columns (192 = 3 x 64: smem shapes are powers of 2)
        NQC: gl.constexpr = DQK // QKC
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_M, QKC], Q.dtype.element_ty)
        q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [Q_BUFS * NQC, 2 * BLOCK_M, QKC], q_layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES * NQC, BLOCK_N, QKC], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, DV], v_desc.layout)
        bl: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], bl)
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], bl)
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bl)
        v_own = gl.allocate_shared_memory(gl.int64, [1, 1], bl)  # the producer's V copies it cleans
        # per key of each stage's V tile: 1 if the producer zeroed a non-finite entry (_clean_tile); in
        # the 2 KB that SMEM_LIMIT keeps free
        flags_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        flags = gl.allocate_shared_memory(gl.int8, [NUM_STAGES, BLOCK_N], flags_layout)
        mbarrier.init(v_own.index(0), count=1)
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumers release a Q buffer
            mbarrier.arrive(q_empty.index(i), count=2)  # which starts empty
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)
            mbarrier.arrive(k_empty.index(i), count=2)  # every slot starts empty
            mbarrier.arrive(v_empty.index(i), count=2)
        gl.warp_specialize(
            [
                (_consumer, (
                    O, Sinks, q_bufs, k_bufs, v_bufs, flags, q_ready, q_empty, k_ready, v_ready, k_empty,
                    v_empty, Redo, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window,
                    win_h0, win_h1, n_items, qk_scale, stride_ot, stride_oh, n_tok,
                    0, G, GP, HKV, DQK, DV, QKC, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFS, HEADWISE, HAS_WINDOW,
                    SINK_MODE, SOFTCAP, PROFILE, PEEL, PINGPONG, SNAKE, Q_ASYNC, O_VEC, SAFE,
                )),
                (_consumer, (
                    O, Sinks, q_bufs, k_bufs, v_bufs, flags, q_ready, q_empty, k_ready, v_ready, k_empty,
                    v_empty, Redo, CuQ, Ctx, Tbl, stride_tbl, num_reqs, min_q_len, window,
                    win_h0, win_h1, n_items, qk_scale, stride_ot, stride_oh, n_tok,
                    1, G, GP, HKV, DQK, DV, QKC, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFS, HEADWISE, HAS_WINDOW,
                    SINK_MODE, SOFTCAP, PROFILE, PEEL, PINGPONG, SNAKE, Q_ASYNC, O_VEC, SAFE,
                )),
                (_producer, (
                    Q, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                    k_empty, v_empty, flags, v_own, Redo, CuQ, Ctx, Tbl, stride_tbl, n_blk,
                    num_reqs, min_q_len, window, win_h0, win_h1, n_items, stride_qt, stride_qh, stride_vr,
                    Err, n_pages, n_tok,
                    G, GP, HKV, HEADWISE, BS, BLOCK_M, BLOCK_N, BOX, DQK, DV, QKC, NUM_STAGES, Q_BUFS,
                    HAS_WINDOW, HAS_ERR, Q_LATE, SNAKE, Q_ASYNC, SAFE,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
        if SAFE:  # every partition has read this CTA's flags (_redo_wanted): clear them for the next step
            two = gl.arange(0, 2, layout=gl.BlockedLayout([1], [32], [4], [0]))
            gl.store(Redo + 2 * gl.program_id(0) + two, gl.zeros_like(two))


def _descriptor(cache: torch.Tensor, box: int):
    """TMA descriptor over ``cache [NB, Hkv, BS, D]`` viewed as ``[NB * Hkv * BS, D]`` (row stride
    ``cache.stride(2)``), box ``[box, 64]``."""
    nb, hkv, bs, d = cache.shape
    gdt = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([box, CHUNK], gdt)
    return TensorDescriptor(cache, [nb * hkv * bs, d], [cache.stride(2), 1], [box, CHUNK], layout)


class HopperPlan:
    """The Hopper prefill kernel's launches for one layer (the fast one and the safe one, module
    docstring): TMA descriptors over the caches, tile shapes and compile-time constants derived once
    (``run`` per step). Arguments checked and prepared by
    :class:`.paged_attention.AttentionPlan` (``qk_scale`` includes ``log2(e)``; with ``softcap`` = cap *
    log2(e) > 0 it is ``scale / cap`` and scores become ``softcap * tanh(qk_scale * q.k)``).
    ``block_n`` / ``q_bufs`` / ``num_stages``: key tile, Q buffers, K/V ring depth (default
    :func:`tile_for`; others for tuning, checked against shared memory). ``num_ctas``: persistent grid
    size (default: one CTA per SM). ``profile=1``: a timing ablation with the softmax left out (wrong
    results; ``benchmarks/probes/hopper_variants.py`` only); ``profile=3``: the fast launch without its
    row check (a masked key's NaN then stays; ``benchmarks/probes/safe_launch.py`` only). ``peel``
    (default): the first key tile out of the loop (wgmma's stay asynchronous, :func:`_item_peeled`;
    ``False``: the old loop); ``pingpong``:
    ``peel`` plus the consumers' ping-pong on named barriers (:func:`_turn`). ``snake`` (default): every
    second full wave of work items reversed (:func:`_scheduled`; the H200 ran 2-10 % faster in 9 of 10
    same-call cases over two calls; ``False``: round robin). ``consumer_regs`` / ``producer_regs``: the
    ``setmaxnreg`` split (``2 * 128 * consumer + 128 * producer <= 65536``). ``q_async`` (default): Q
    copied by ``cp.async`` (:func:`_load_q`; ``False``: plain loads through the producer's registers).
    ``o_vec`` (default): the output converted (through shared memory, :func:`store_scratch_bytes`; tiles that
    leave no room for it store as with ``False``) to a layout of 16-byte row segments before its store;
    ``False``: stored from the wgmma layout, 4 bytes per store (clock stamps on the H200
    put that epilogue at ~2.5 us per work item, against ~1.8 us per 128-key tile)."""

    def __init__(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        hq: int,
        sinks: torch.Tensor | None,
        *,
        qk_scale: float,
        sink_mode: int,
        headwise: bool,
        has_window: bool,
        window: int,
        win_h0: int,
        win_h1: int,
        softcap: float = 0.0,
        block_n: int | None = None,
        q_bufs: int | None = None,
        num_stages: int | None = None,
        num_ctas: int | None = None,
        q_late: bool = False,
        profile: int = 0,
        peel: bool = True,
        pingpong: bool = False,
        consumer_regs: int = 232,
        producer_regs: int = 40,
        snake: bool = True,
        q_async: bool = True,
        o_vec: bool = True,
    ) -> None:
        hkv, bs = key_cache.shape[1], key_cache.shape[2]
        dqk, dv = key_cache.shape[3], value_cache.shape[3]
        g = hq // hkv
        gp = next_pow2(g)
        block_m = BLOCK_M
        if gp > block_m:
            raise ValueError(f"hopper prefill packs at most {block_m} q heads per kv head, got {g}")
        d_n, d_q, d_s = tile_for(dqk, dv, key_cache.element_size())
        block_n, q_bufs, num_stages = block_n or d_n, q_bufs or d_q, num_stages or d_s
        if block_n not in (64, 128) or q_bufs not in (1, 2) or num_stages < 2:
            raise ValueError(
                f"block_n {block_n} (64 or 128), q_bufs {q_bufs} (1 or 2), num_stages {num_stages} (>= 2)"
            )
        need = smem_bytes(dqk, dv, block_n, q_bufs, num_stages, key_cache.element_size())
        if need > SMEM_LIMIT:
            raise ValueError(
                f"block_n {block_n}, q_bufs {q_bufs}, num_stages {num_stages} need {need} B of shared memory "
                f"for head dims {dqk}/{dv} (limit {SMEM_LIMIT})"
            )
        if (
            consumer_regs % 8 or producer_regs % 8 or not 24 <= producer_regs <= consumer_regs <= 256
            or 128 * (2 * consumer_regs + producer_regs) > 65536
        ):  # fmt: skip
            raise ValueError(
                f"consumer_regs {consumer_regs} / producer_regs {producer_regs}: multiples of 8 in [24, 256] "
                "whose 2 x 128 + 128 threads fit the 65536 registers of an SM"
            )
        # the output's 16-byte stores need room for their layout conversion; without it, the 4-byte ones
        o_vec = o_vec and need + store_scratch_bytes(dv, key_cache.element_size()) <= SMEM_LIMIT
        box = min(block_n, bs)
        qkc = dqk if dqk & (dqk - 1) == 0 else CHUNK  # Q / K smem parts: powers of two (192 = 3 x 64)
        self.tile_q = 2 * (block_m // gp)
        self.hkv = hkv
        self.value_cache = value_cache
        self.k_desc = _descriptor(key_cache, box)
        self.v_desc = _descriptor(value_cache, box)
        self.sinks = sinks
        self.n_pages = min(key_cache.shape[0], value_cache.shape[0]) * (hkv if headwise else 1)
        self.scalars = (qk_scale, window, win_h0, win_h1)
        #: the value cache's row stride: the same for every cache :meth:`.paged_attention.AttentionPlan.bind`
        #: points the plan at (equal in ``tensor_key``), read once
        self.stride_vr = value_cache.stride(2)
        self.ctas = num_ctas or _num_sms(key_cache.device)
        self.consts = dict(
            G=g, GP=gp, HKV=hkv, DQK=dqk, DV=dv, QKC=qkc, BLOCK_M=block_m, BLOCK_N=block_n, BS=bs, BOX=box,
            NUM_STAGES=num_stages, Q_BUFS=q_bufs, HEADWISE=bool(headwise), HAS_WINDOW=bool(has_window),
            SINK_MODE=sink_mode, SOFTCAP=float(softcap), PROFILE=int(profile), Q_LATE=bool(q_late),
            PEEL=bool(peel or pingpong), PINGPONG=bool(pingpong), SNAKE=bool(snake), Q_ASYNC=bool(q_async),
            O_VEC=bool(o_vec),
            PRODUCER_REGS=int(producer_regs), CONSUMER_REGS=int(consumer_regs), num_warps=4,
        )  # fmt: skip
        # per launch kind: the fast launch with or without the error flag, the safe launch (no errors:
        # the fast one recorded them)
        self._consts = {e: dict(HAS_ERR=e, **self.consts) for e in (False, True)}
        self._consts["safe"] = dict(HAS_ERR=False, SAFE=True, **self.consts)
        # Q by cp.async takes 16-byte copies: Triton proves their alignment from the pointer and the
        # strides it specialises on (divisible by 16); a query that is not gets the plain loads
        self._consts_plain_q = {e: dict(c, Q_ASYNC=False) for e, c in self._consts.items()}
        #: ``int32 [2 * ctas]``: per CTA and consumer, whether the fast launch left a non-finite row (set
        #: by the fast launch, read and cleared by the safe one)
        self.redo = torch.zeros(2 * self.ctas, dtype=torch.int32, device=key_cache.device)

    def run(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens_decoder: torch.Tensor,
        block_tables: torch.Tensor,
        errors: torch.Tensor | None = None,
        kernels: object = None,
        key: object = None,
        stream: int | None = None,
        ptrs: tuple | None = None,
    ) -> None:
        """Prefill rows of ``q [T, Hq, Dqk]`` into ``out [T, Hq, Dv]`` (rows of one-token requests
        untouched). ``errors``: the ``int32 [8]`` device error flag (``kernels/errors.py``) or ``None``;
        table entries outside the cache are never dereferenced either way. ``kernels`` / ``key`` /
        ``stream``: a :class:`.launch.direct.KernelCache` and this call's key for direct launches (the safe
        launch's: :func:`safe_key`); ``ptrs``: the addresses of ``(q, key_cache, value_cache, out, sinks,
        cu_seqlens_q, seq_lens_decoder, block_tables, errors)`` a direct launch passes (sinks / errors:
        any pointer when unused). Two launches: the fast one, then the safe one (module docstring)."""
        t = q.shape[0]
        num_reqs = cu_seqlens_q.shape[0] - 1
        qs = q.stride()
        hits = None
        if kernels is not None and ptrs is not None and kernels.addresses:
            hits = (kernels.kernel(key), kernels.kernel(safe_key(key)))
        if hits is not None and None not in hits:  # kept kernels: addresses, no tensors (KernelCache.kernel)
            qp, _, vp, op, sp, cp, dp, tp, ep = ptrs
            self.run_kept(
                hits, qp, vp, op, sp, cp, dp, tp, ep, qs, out.stride(), t, num_reqs, block_tables.stride(0),
                block_tables.shape[1], stream,
            )  # fmt: skip
            return
        n_items, grid = self._items(t, num_reqs)
        tail = (
            qs[0], qs[1], out.stride(0), out.stride(1), self.stride_vr,
            block_tables.stride(0), block_tables.shape[1], self.n_pages, t, num_reqs, 2, *self.scalars,
            n_items,
        )  # fmt: skip
        has_err = errors is not None
        args = (
            q, out, self.value_cache, self.k_desc, self.v_desc, self.sinks if self.sinks is not None else q,
            cu_seqlens_q, seq_lens_decoder, block_tables, errors if has_err else block_tables, self.redo,
            *tail,
        )  # fmt: skip
        table = self._consts
        if self._consts[False]["Q_ASYNC"] and (q.data_ptr() % 16 or qs[0] % 16 or qs[1] % 16):
            table = self._consts_plain_q
        for consts, k in ((table[has_err], key), (table["safe"], safe_key(key))):
            if kernels is None:
                _hopper_prefill_kernel[grid](*args, **consts)
            else:
                kernels.launch(_hopper_prefill_kernel, k, grid, args, consts, stream)

    def _items(self, t: int, num_reqs: int) -> tuple[int, tuple[int]]:
        """The work items of ``t`` query rows over ``num_reqs`` requests ((query tile, kv head) ids, some
        past the end) and the persistent grid that walks them."""
        n_items = (t // self.tile_q + num_reqs) * self.hkv
        return n_items, (max(1, min(n_items, self.ctas)),)

    def run_kept(
        self, hits: tuple[Any, Any], qp: int, vp: int, op: int, sp: int, cp: int, dp: int, tp: int, ep: int,
        qs: Sequence[int], ost: Sequence[int], t: int, num_reqs: int, stride_tbl: int, n_blk: int,
        stream: int | None,
    ) -> None:  # fmt: skip
        """Launch the kept kernels ``hits`` (the fast and the safe launch's,
        :meth:`.launch.direct.KernelCache.kernel`) by addresses only: q,
        the value cache, out, sinks (any pointer when unused), cu_seqlens_q, seq_lens_decoder, the table, the
        error flag (the table when none); ``qs`` / ``ost``: q's ``[T, Hq, Dqk]`` and out's ``[T, Hq, Dv]``
        strides (the first two read), ``t`` q's rows, the table's row stride and width. No tensor is
        touched but the plan's own, so the caller's framework does not matter (the backend's paddle
        lane)."""
        n_items, grid = self._items(t, num_reqs)
        s0, s1, s2, s3 = self.scalars
        args = (
            qp, op, vp, self.k_desc, self.v_desc, sp, cp, dp, tp, ep, self.redo.data_ptr(), qs[0], qs[1],
            ost[0], ost[1], self.stride_vr, stride_tbl, n_blk, self.n_pages, t, num_reqs, 2, s0, s1, s2, s3,
            n_items,
        )  # fmt: skip
        hits[0](grid, args, stream)
        hits[1](grid, args, stream)


def safe_key(key: tuple | None) -> tuple | None:
    """The kernel-cache key of the safe launch that goes with the fast launch's ``key`` (``("hopper", ...)``
    or ``("prefill", ...)``; ``None``: none): its kind with ``-safe``, the rest alike."""
    return None if key is None else (f"{key[0]}-safe", *key[1:])


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
    softcap: float = 0.0,
    num_stages: int | None = None,
    num_ctas: int | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """One step of the Hopper prefill kernel (:class:`HopperPlan` built and run once: its fast and safe
    launches): ``q [T, Hq,
    Dqk]``, caches ``[NB, Hkv, BS, D]``, ``out [T, Hq, Dv]`` (rows of one-token requests untouched)."""
    plan = HopperPlan(
        key_cache, value_cache, q.shape[1], sinks, qk_scale=qk_scale, sink_mode=sink_mode, headwise=headwise,
        has_window=has_window, window=window, win_h0=win_h0, win_h1=win_h1, softcap=softcap,
        num_stages=num_stages, num_ctas=num_ctas,
    )  # fmt: skip
    plan.run(q, out, cu_seqlens_q, seq_lens_decoder, block_tables, errors)


__all__ = [
    "HopperPlan",
    "block_n_for",
    "smem_bytes",
    "store_scratch_bytes",
    "tile_for",
    "choose_prefill_impl",
    "gluon_available",
    "hopper_prefill",
    "is_hopper",
    "safe_key",
    "supported",
]
