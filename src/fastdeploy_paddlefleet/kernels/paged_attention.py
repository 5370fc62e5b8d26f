"""Paged attention for packed batches of prefill chunks and decode tokens (Triton).

One launch API, :func:`paged_attention` (and its per-layer :class:`AttentionPlan`), two kernels (in
:mod:`.attention_kernels`):

* ``_prefill_kernel``: one program per (tile of ``BLOCK_Q`` query tokens of one request, kv head).
  The query heads of the kv head are packed into the tile, so the M side of every dot is
  ``BLOCK_Q * GP`` rows (tokens x padded group heads) and each K/V tile is loaded once for the group.
  Keys are visited in three phases: the window's leading edge (masked), the keys every row sees
  (no mask at all), the causal diagonal (masked). Tiles outside the window are never visited.
* ``_decode_kernel``: one program per (request with one query token, kv head, split). With more than
  one split it writes partial results that ``split_kv_reduce`` merges (flash-decoding).

Both share the inner loop ``_attend``. It loads the page indices of ``PAGE_CHUNK`` key tiles before
an inner loop, so no key load waits on a table load inside the loop: that is what lets Triton
pipeline the K/V loads several tiles deep (benchmarks/NOTES.md). Sinks enter the online softmax
as its initial state (``m = sink, l = 1``); off-by-one uses a zero sink. Scores run in base 2
(``qk_scale`` folds ``log2(e)``). Fully masked rows give 0.

Cache layout (FastDeploy): ``key_cache [num_blocks, Hkv, block_size, Dqk]``, ``value_cache
[num_blocks, Hkv, block_size, Dv]``. Page ``p`` is slice ``p`` of the cache viewed as
``[num_blocks * Hkv, block_size, D]``; a block table entry ``blk`` gives page ``blk * Hkv + h``, a
head-wise table gives the page directly. ``-1`` entries are never dereferenced.

Quantized caches (``kv_quant``, ``kvcache/quant.py``): ``uint8`` codes in the same layout (e4m3fn bits,
or int8 codes stored as ``code + 128``) with dequant scales ``x ~= code * scale``: per token and kv head
``[num_blocks, Hkv, block_size]`` (``block_wise_fp8``, beside the codes), per kv head ``[Hkv]`` or per
channel ``[Hkv * D]`` (static). The kernels convert codes exactly to q's dtype for the tensor-core dots
(fp32 accumulation) and apply the scales where they cost least: per-token K scales on the scores'
columns, per-token V scales on P's columns (under an fp16 model each row of that product taken relative
to its largest entry, a power of two: small scales keep fp16's precision), static K scales folded into q,
static V scales on the output. The Hopper prefill reads them through a dequantizing gather
(``kernels/kv_dequant_gather.py``): before its launch, the pages the step's prefill requests read are
dequantized into a bf16 / fp16 scratch cache (``T(code * scale)``, rounded once to the model dtype: the
one difference from the portable prefill's values) with a remapped block table, and the unchanged bf16
Hopper kernel runs on those; decode rows keep reading the codes. ``auto`` picks it where it picks the
Hopper kernel for an unquantized cache of the model dtype; ``prefill_impl='portable'`` keeps the
portable prefill.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import envs
from ..kvcache.quant import KVCacheQuant, kv_cache_quant
from ._framework import empty, is_torch, next_pow2, num_sms, to_float32, torch
from .attention_kernels import SAFE_GRID, _decode_kernel, _prefill_kernel
from .hopper_prefill import HopperPlan, choose_prefill_impl, safe_key
from .kv_dequant_gather import DequantGather
from .launch.direct import (
    KernelCache,
    LaunchStep,
    PlanMemo,
    caches_key,
    fill_step,
    new_step,
    step_values,
    switches_key,
    tensor_version,
)
from .split_kv_reduce import reduce_kept, split_kv_reduce

LOG2E = 1.4426950408889634
SINK_MODES = {"vanilla": 0, "learnable": 1, "off-by-one": 2}
#: the kernels' ``KV_CODE`` per :attr:`KVCacheQuant.code` (0: an unquantized cache)
KV_CODES = {"fp8": 1, "int8": 2}
#: the kernels' ``SCALE_MODE``: 0 none, 1 per token and kv head, 2 per kv head, 3 per channel
SCALE_TOKEN, SCALE_HEAD, SCALE_CHANNEL = 1, 2, 3
#: how the portable kernels find the first bad table entry: True, the key loop carries the smallest bad
#: block and the kernel records it after the loop; False, one scan of the visible table range after the
#: loop. Measured on the H200 against the unchecked kernels (benchmarks/NOTES.md): the loop costs the
#: sliding-window prefill ~4-5 %, the scan costs the head-wise decode ~4 %; each kernel gets the one
#: that costs it nothing measurable. Read when a plan first launches.
ERR_LOOP_PREFILL = False
ERR_LOOP_DECODE = True


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one kernel: ``block_m`` rows (prefill: query tokens x padded group heads),
    ``block_n`` keys per step, warps, pipeline stages, whether K/V tiles load through TMA, whether
    the prefill exponentials run as packed bf16 (bf16 inputs on a GPU only), a timing ablation
    switch (``profile`` 1: no softmax, 2: no P @ V; results are wrong when set) and ``maxnreg``, a
    cap on registers per thread (Triton's option: fewer registers, more programs per SM where shared
    memory allows; ``None``: the compiler's choice)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = False
    exp_bf16: bool = False
    profile: int = 0
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.maxnreg is not None and (type(self.maxnreg) is not int or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"TileConfig.maxnreg must be an int in [24, 255] or None, got {self.maxnreg!r}")


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return num_sms(device)


def default_prefill_config(
    dqk: int, dv: int, device: torch.device, elem_size: int = 2, sliding: bool = False
) -> TileConfig:
    """Prefill tile shape (tuned on an H200; see benchmarks/NOTES.md): 128-row tiles over 8 warps,
    64-row tiles over 4 warps (two programs per SM) for sliding layers."""
    if device.type != "cuda":
        return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    if elem_size > 2:  # fp32: twice the shared memory per tile
        return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if max(dqk, dv) > 128:
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    if sliding:
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def masked_block_n(cfg: TileConfig) -> int:
    """Keys per tile in the portable prefill's masked loops: half of ``cfg.block_n`` from 64 up (their
    K / V tiles sit in registers, where masked keys are kept out; a full-width tile spilled the whole
    kernel), else ``block_n`` (smaller tiles were never seen to spill; ``tl.dot`` needs 16 keys)."""
    return cfg.block_n // 2 if cfg.block_n >= 64 else cfg.block_n


def default_decode_config(
    dqk: int, dv: int, device: torch.device, elem_size: int = 2, sliding: bool = False
) -> TileConfig:
    """Decode tile shape (tuned on an H200; see benchmarks/NOTES.md): 64-key tiles, 3 pipeline
    stages (fewer if they do not fit in about 200 KB of shared memory). ``sliding`` (every kv head
    slides, so each program streams only a window): 32-key tiles over 2 warps, 48 KB of shared
    memory, so 4 programs fit per SM and a 64 x 8 batch runs in one wave (no second ramp-up)."""
    if device.type != "cuda":
        return TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if sliding and elem_size <= 2 and max(dqk, dv) <= 128:
        return TileConfig(block_m=16, block_n=32, num_warps=2, num_stages=3)
    block_n = 64 if elem_size <= 2 else 32
    per_stage = block_n * (next_pow2(dqk) + next_pow2(dv)) * elem_size
    return TileConfig(
        block_m=16, block_n=block_n, num_warps=4, num_stages=max(2, min(3, (200 << 10) // per_stage))
    )


def choose_num_splits(num_requests: int, num_kv_heads: int, span: int, block_n: int, sms: int) -> int:
    """Split count for the decode path: split only when the (request, kv head) programs cannot fill
    ``SPLIT_TARGET`` resident programs per SM, keeping at least ``MIN_TILES_PER_SPLIT`` key tiles
    per split; a power of two (fewer compiles)."""
    programs = max(1, num_requests * num_kv_heads)
    want = max(1, (SPLIT_TARGET * sms) // programs)
    most = max(1, (span + block_n - 1) // block_n // MIN_TILES_PER_SPLIT)  # plain ints: no triton.cdiv call
    splits = max(1, min(want, most, 64))
    return 1 << (splits.bit_length() - 1)


SPLIT_TARGET = 2
#: e4m3 cache codes under a bf16 model, decode and prefill launches: 1 reads K's codes as fp16 (one ``cvt``
#: per pair instead of four) and V's as bf16; 2 reads both as fp16 (``attention_kernels._pv_token_scaled``
#: keeps P's rows exact); 3 as 2, V's converted where they were loaded
#: (``attention_kernels._e4m3_as_f16_in_place``; GPU only, 2 under the interpreter). The prefill keeps 1:
#: with 128-row tiles the row scaling of 2 / 3 costs more than V's conversions (sm_90 offline: 745
#: against 563 instructions per key tile). Decode: ``None`` lets :func:`fp8_decode_setup` choose per
#: plan (3 under a register cap where that was measured faster, else 1); an int forces that mode
FP8_F16_CODES_DECODE: int | None = None
FP8_F16_CODES_PREFILL = 1
#: a register cap (``TileConfig.maxnreg``) on the default decode tiles of every fp8 cache, overriding
#: :func:`fp8_decode_setup`'s; ``None``: that choice
FP8_DECODE_MAXNREG: int | None = None
#: the cap :func:`fp8_decode_setup` puts on mode 3's tiles: 145 registers (3 programs per SM) become 128
#: with no spills (4 programs; 626 against 617 instructions per 64-key tile, sm_90 offline)
FP8_DECODE_AUTO_MAXNREG = 128


def fp8_decode_setup(
    cfg: TileConfig, dqk: int, dv: int, headwise: bool, has_window: bool
) -> tuple[int, int | None]:
    """``(F16_CODES, maxnreg)`` of the decode launches over an e4m3 cache under a bf16 model, where
    :data:`FP8_F16_CODES_DECODE` is ``None``: mode 3 with :data:`FP8_DECODE_AUTO_MAXNREG` on the plain
    decode tile (64 keys, 4 warps) of a full-attention 128 / 128 cache that is not head-wise, where it
    was timed faster (H100, 64 x 4096, 32 / 8 heads: 1.36x our bf16 decode against 1.13x with mode 1);
    mode 1 and no cap elsewhere, where mode 3 (capped or not) was timed slower: the 32-key tiles of
    sliding windows (1.06-1.16x against 1.23-1.29x), head-wise pages (0.98-1.08x against 1.23x) and
    MLA's 192 / 128 (1.07-1.27x against 1.31x) (benchmarks/NOTES.md). (A 64-key window tile in mode 3
    was the default for a while on a comparison that had timed one plan twice: benchmarks/NOTES.md.)"""
    plain = cfg.block_n == 64 and cfg.num_warps == 4
    if plain and dqk == dv == 128 and not headwise and not has_window:
        return 3, FP8_DECODE_AUTO_MAXNREG
    return 1, None


#: decode launches take the key tiles as the dots' rows (``attention_kernels._tile_key_rows``): ``None``
#: where :func:`key_rows_by_default` and ``FDFLEET_DECODE_KEY_ROWS`` (default on) say so, or a bool for
#: every cache (tests, benchmarks)
DECODE_KEY_ROWS: bool | None = None

#: head dims ``(Dqk, Dv)`` whose block_wise_fp8 decode the key-rows layout was timed faster on
KEY_ROWS_DIMS = ((128, 128), (192, 128))


def key_rows_by_default(kv_quant: str | None, headwise: bool, dqk: int, dv: int) -> bool:
    """Whether decode takes the key-rows layout when nothing forces it: block_wise_fp8 caches that are
    not head-wise, at the head dims of :data:`KEY_ROWS_DIMS`, where it was timed faster than the
    query-rows layout (H100, 64 x 4096, 32 / 8 heads, against our bf16 decode: full 1.49x against 1.33x,
    window 1024 1.34x against 1.27x, window + sinks 1.34x against 1.21x, MLA 1.43x against 1.27x) and
    checked on the GPU against the dense reference. Not head-wise pages (1.08x against 1.18x), nor the
    static-scale formats and other head dims, which were not timed (benchmarks/NOTES.md)."""
    return kv_quant == "block_wise_fp8" and not headwise and (dqk, dv) in KEY_ROWS_DIMS


def decode_takes_key_rows(kv_quant: str | None, headwise: bool, dqk: int, dv: int) -> bool:
    """Whether a plan's decode takes the key-rows layout: :data:`DECODE_KEY_ROWS` where it is set, else
    where :func:`key_rows_by_default` and ``FDFLEET_DECODE_KEY_ROWS`` say so (``kv_quant``: the cache's
    format name, ``None`` unquantized)."""
    if DECODE_KEY_ROWS is not None:
        return bool(DECODE_KEY_ROWS)
    return key_rows_by_default(kv_quant, headwise, dqk, dv) and envs.decode_key_rows()


def key_rows_decode_setup(cfg: TileConfig, dqk: int, dv: int) -> tuple[int, int | None]:
    """``(F16_CODES, maxnreg)`` of the key-rows decode over an e4m3 cache under a bf16 or fp16 model
    (:data:`FP8_F16_CODES_DECODE` ``None``), on the default tile ``cfg``: both code tiles converted where
    loaded (mode 3), and a 128-register cap on 128 / 128 caches' 64-key / 4-warp and 32-key / 2-warp
    tiles (sm_90 offline: 160-164 registers, three programs per SM, become 128 with no spill in the key
    loops, four; MLA's 192 / 128 spills under it and keeps its 217)."""
    capped = dqk == dv == 128 and (cfg.block_n, cfg.num_warps) in ((64, 4), (32, 2))
    return 3, FP8_DECODE_AUTO_MAXNREG if capped else None


MIN_TILES_PER_SPLIT = 4


def _reg_cap(cfg: TileConfig) -> dict:
    """Triton's ``maxnreg`` option of a config (none where it is unset: the options stay as they were)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def _tma_descriptors(key_cache, value_cache, block_n: int, dqk: int, dv: int):
    """TMA descriptors over the caches viewed as ``[pages * block_size, D]`` (None if unusable)."""
    on_device = key_cache.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not (on_device and key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    if dqk != next_pow2(dqk) or dv != next_pow2(dv) or key_cache.shape[2] % block_n:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    kd = TensorDescriptor.from_tensor(key_cache.view(-1, dqk), [block_n, dqk])
    vd = TensorDescriptor.from_tensor(value_cache.view(-1, dv), [block_n, dv])
    return kd, vd


def _check_cache(name: str, cache: torch.Tensor, hkv: int, d: int) -> int:
    """Check a ``[num_blocks, hkv, block_size, d]`` cache (or a strided view of the leading heads and
    channels of a wider one); return its heads per block ``stride(0) // stride(1)`` (``PAGE_H``)."""
    if cache.dim() != 4 or cache.shape[1] != hkv or cache.shape[3] != d:
        raise ValueError(f"{name} must be [num_blocks, {hkv}, block_size, {d}], got {list(cache.shape)}")
    s0, s1 = cache.stride(0), cache.stride(1)
    if cache.stride(3) != 1 or s1 <= 0 or s0 % s1 or s0 // s1 < hkv or cache.stride(2) * cache.shape[2] > s1:
        raise ValueError(
            f"{name} must be a view of [num_blocks, heads >= {hkv}, block_size, channels >= {d}] "
            f"(blocks, heads and slots nested, channels contiguous), got strides {cache.stride()}"
        )
    return s0 // s1


_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def _check_quant(
    quant: KVCacheQuant | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    q: torch.Tensor,
    page_h: int,
) -> tuple[int, torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """Check a cache's codes and scales against its format ``quant`` (``None``: unquantized, the caches
    in a float dtype); return the kernels' ``SCALE_MODE``, the K and V scale arguments (the key cache
    where there are none: any pointer; static scales flat) and the per-token scales' strides
    ``(K page, K slot, V page, V slot)`` (zeros for static scales).

    Dynamic scales are ``[num_blocks, Hkv, block_size]`` with the caches' heads per block
    (``stride(0) == page_h * stride(1)``: a view of the leading heads of a wider tensor is read in
    place); static ones ``[Hkv]`` (per head) or ``[Hkv * D]`` (per channel, ``D`` the cache's own dim),
    contiguous. ``TypeError`` / ``ValueError`` name the bad tensor."""
    code_dtypes = [str(c.dtype).rsplit(".", 1)[-1] for c in (key_cache, value_cache)]
    if quant is None:
        if "uint8" in code_dtypes or key_scale is not None or value_scale is not None:
            given = "given" if key_scale is not None or value_scale is not None else "none"
            raise ValueError(
                f"key_cache / value_cache are {code_dtypes[0]} / {code_dtypes[1]} with scales {given}: a "
                "quantized cache needs kv_quant (its format) and both scales; an unquantized one neither"
            )
        return 0, key_cache, key_cache, (0, 0, 0, 0)
    if code_dtypes != ["uint8", "uint8"]:
        raise TypeError(
            f"kv_quant={quant.name!r} needs uint8 key_cache / value_cache (one code per element), got "
            f"{key_cache.dtype} / {value_cache.dtype}"
        )
    if key_scale is None or value_scale is None:
        raise ValueError(f"kv_quant={quant.name!r} needs key_scale and value_scale (dequant multipliers)")
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    out = []
    for name, sc, cache in (("key_scale", key_scale, key_cache), ("value_scale", value_scale, value_cache)):
        dt = str(sc.dtype).rsplit(".", 1)[-1]
        if dt not in _SCALE_DTYPES:
            raise TypeError(f"{name} must be one of {_SCALE_DTYPES}, got {sc.dtype}")
        if getattr(sc, "device", None) != getattr(q, "device", None):
            raise ValueError(f"{name} is on {sc.device} but q is on {q.device}: one device for all")
        d = cache.shape[3]
        if quant.dynamic:
            st = sc.stride()
            if (
                sc.dim() != 3
                or tuple(sc.shape) != (cache.shape[0], hkv, bs)
                or st[1] <= 0
                or st[0] != page_h * st[1]
                or st[2] * (bs - 1) >= st[1]
            ):
                raise ValueError(
                    f"{name} of kv_quant={quant.name!r} must be [{cache.shape[0]}, {hkv}, {bs}] (per token "
                    f"and kv head) with the caches' {page_h} heads per block, got shape {list(sc.shape)} "
                    f"strides {st}"
                )
            out.append((sc, st[1], st[2]))
        else:
            want = hkv * d if quant.channel_wise else hkv
            if sc.numel() != want or not sc.is_contiguous():
                raise ValueError(
                    f"{name} of kv_quant={quant.name!r} must hold {want} contiguous values "
                    f"([{hkv}{' * ' + str(d) if quant.channel_wise else ''}]), got shape {list(sc.shape)}"
                )
            out.append((sc.reshape(-1), 0, 0))
    mode = SCALE_TOKEN if quant.dynamic else (SCALE_CHANNEL if quant.channel_wise else SCALE_HEAD)
    (ks, ksp, ksr), (vs, vsp, vsr) = out
    return mode, ks, vs, (ksp, ksr, vsp, vsr)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_decoder: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    headwise: bool = False,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    sink_kind: str = "vanilla",
    sinks: torch.Tensor | None = None,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    prefill_config: TileConfig | None = None,
    decode_config: TileConfig | None = None,
    prefill_impl: str | None = None,
    logits_soft_cap: float | None = None,
    errors: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_quant: KVCacheQuant | str | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries over the paged cache (which already holds this step's K/V, unless
    ``new_kv`` is given).

    * ``q [T, Hq, Dqk]``; request ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` at positions
      ``seq_lens_decoder[b] + i``; keys are positions ``0 .. seq_lens_decoder[b] + n - 1``.
    * ``key_cache [NB, Hkv, BS, Dqk]``, ``value_cache [NB, Hkv, BS, Dv]``.
    * ``block_tables [bsz, max_blocks]`` (blocks), or with ``headwise=True``
      ``[bsz * Hkv, max_pages]`` (pages ``block * Hkv + head``); ``-1`` = absent, never read.
    * ``window_left``: keys ``i - j <= window_left`` are visible, for kv heads in
      ``sliding_heads = (start, stop)`` (all heads when ``None``); ``None`` = full attention.
    * ``sink_kind``: ``vanilla``, ``off-by-one`` or ``learnable`` (``sinks [Hq]`` logits).
    * ``max_q_len`` (most query tokens of a request) / ``max_context_len`` (longest key range, this
      step's tokens included): host-side maxima (optional) that pick the kernels and the split count
      without a device sync. ``max_q_len`` must not understate: rows it rules out stay unwritten.
    * ``prefill_impl``: ``hopper`` (the warp-specialised Gluon kernel, ``kernels/hopper_prefill.py``),
      ``portable`` (the Triton kernel here) or ``None``: ``FDFLEET_PREFILL_KERNEL`` (default ``auto``:
      hopper on sm_90 when Gluon imports and the inputs suit it, unless ``prefill_config`` is given).
    * ``logits_soft_cap``: scores ``s = scale * q.k`` become ``cap * tanh(s / cap)`` before the
      softmax (Gemma-2's ``attn_logit_softcapping``, FlashInfer's ``logits_soft_cap``); sinks are not
      capped. ``None``: no capping (a compile-time switch: the uncapped kernels are unchanged).
    * ``errors``: an ``int32 [8]`` device error flag (``kernels/errors.py``): the first table entry
      that is needed but negative, past the cache or past the table's width is recorded there (no host
      sync). Such entries are never dereferenced, with or without a flag.
    * ``new_kv``: ``(k [T, Hkv, Dqk], v [T, Hkv, Dv])``, this step's K/V, not in the cache yet: the
      decode launch writes them there itself (what :func:`~.cache_write.write_kv_cache` would write,
      bad table entries recorded as the cache write's) and attends them from registers: one launch
      instead of two. Only for steps where every request decodes one token (``max_q_len=1``;
      ``ValueError`` otherwise), and not for a quantized cache.
    * ``kv_quant``: the caches hold ``uint8`` codes of this format (a :class:`KVCacheQuant` or its
      FastDeploy name, e.g. ``"block_wise_fp8"``), with dequant multipliers ``key_scale`` /
      ``value_scale``: ``[num_blocks, Hkv, block_size]`` (dynamic formats), ``[Hkv]`` or ``[Hkv * D]``
      (static). ``None``: the caches hold q's dtype.

    Returns ``out [T, Hq, Dv]`` in q's dtype. Requests with one query token go through the decode
    kernel (split-KV when the batch is too small to fill the GPU), longer ones through the prefill
    kernel.

    Repeated calls with the same caches and arguments reuse one :class:`AttentionPlan` (a memo of the
    last 16 setups, keyed by the caches' address, shape, strides, dtype and device, q's heads, dims and
    dtype, every scalar and flag, the sinks tensor and its in-place version, the environment switches
    and the module settings a plan reads); the memo holds no cache between calls. A server keeps its
    own plans instead (``backends/triton.py``).
    """
    qs = q.stride()
    if len(qs) != 3 or qs[2] != 1:
        raise ValueError(f"q must be [T, Hq, Dqk] with a contiguous last dim, got shape {list(q.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    qsh, qdt = q.shape, q.dtype
    ost = None
    if out is not None:
        ost = out.stride()
        if out.dtype != qdt or len(ost) != 3 or ost[2] != 1:
            raise ValueError(
                f"out must be a [T, Hq, Dv] {qdt} tensor with a contiguous last dim, got {out.dtype} "
                f"{list(out.shape)}"
            )
    # the plan of an earlier call with the same setup (_PLANS), else a new one. Its key: what the plan
    # derives from the caches (caches_key: address, shape, strides, dtype, device), q's heads, dims,
    # dtype and device, every scalar and flag, the sinks tensor (identity, in-place version, address),
    # the environment switches and the module settings a plan reads (tests, benchmarks)
    key = (
        caches_key(key_cache, value_cache), qsh[1], qsh[2], qdt, q.device, scale, headwise, window_left,
        None if sliding_heads is None else tuple(sliding_heads), sink_kind,
        None if sinks is None else (id(sinks), tensor_version(sinks), sinks.data_ptr()), prefill_config,
        decode_config, prefill_impl, logits_soft_cap, switches_key(), ERR_LOOP_PREFILL, ERR_LOOP_DECODE,
        HopperPlan, FP8_F16_CODES_DECODE, FP8_F16_CODES_PREFILL, FP8_DECODE_MAXNREG, DECODE_KEY_ROWS,
        None if kv_quant is None or key_scale is None or value_scale is None
        else (kv_quant, caches_key(key_scale, value_scale)),
    )  # fmt: skip
    try:
        plan, slot = _PLANS.take(key)
    except TypeError:  # an unhashable argument: no memo
        key = plan = slot = None
    if plan is None:
        plan = AttentionPlan(
            key_cache, value_cache, q, scale=scale, headwise=headwise, window_left=window_left,
            sliding_heads=sliding_heads, sink_kind=sink_kind, sinks=sinks, prefill_config=prefill_config,
            decode_config=decode_config, prefill_impl=prefill_impl, logits_soft_cap=logits_soft_cap,
            kv_quant=kv_quant, key_scale=key_scale, value_scale=value_scale,
        )  # fmt: skip
    else:
        plan.bind(key_cache, value_cache, key_scale, value_scale)
    try:
        t = qsh[0]
        if out is not None:
            osh = out.shape
            if osh[0] != t or osh[1] != plan.hq or osh[2] != plan.dv:
                raise ValueError(f"out must be [{t}, {plan.hq}, {plan.dv}], got {list(osh)}")
        vals = step_values(cu_seqlens_q, seq_lens_decoder, block_tables, None, errors)
        num_reqs, n_blk, stride_tbl, ptrs, _, sig, direct_ok = vals
        cache = plan.kernels
        if (
            new_kv is None
            and cache.direct
            and t
            and num_reqs > 0
            and direct_ok
            and plan.static_aligned
            and q.is_cuda
            and (out is None or out.is_cuda)
        ):
            # the kept lane: the kernels launched from the step's values, as _launch_step launches them
            # when they are kept (no LaunchStep); any other call takes the path below
            if out is None:
                out, ost = plan._new_out(q, t, False), plan.out_strides
            qp = q.data_ptr()
            op = out.data_ptr()
            if not (qp | op) & 15:
                if plan.launch_kept(
                    q, qp, qs, t, op, ost, num_reqs, max_q_len, max_context_len, n_blk, stride_tbl, ptrs, sig,
                    num_splits, cache.stream(),
                ):  # fmt: skip
                    return out
        step = fill_step(
            new_step(), cu_seqlens_q, seq_lens_decoder, block_tables, None, max_q_len, max_context_len,
            errors, vals,
        )  # fmt: skip
        # q's dtype is the plan's (in the key), its strides and out's are checked above
        fused = None if new_kv is None else plan._check_new_kv(new_kv, t, step)
        return plan._launch_step(q, qs, t, step, out, ost, False, num_splits, None, fused)
    finally:
        # portable TMA descriptors (a tuning config) are built over views of the caches: not kept
        if key is not None and plan.memo_ok:
            plan.bind(None, None)  # the memo keeps no cache alive
            _PLANS.give(key, plan, sinks, slot)


#: one-shot plans of :func:`paged_attention` (``kernels/launch/direct.py`` :class:`PlanMemo`)
_PLANS = PlanMemo()


class AttentionPlan:
    """Everything about one layer's attention launches that does not change between steps, checked and
    derived once: the caches' geometry and strides, the kernels' compile-time constants, the tile
    shapes, the prefill kernel choice, the Hopper kernel's TMA descriptors. :meth:`run` (or
    :meth:`run_step` on a step's :class:`~.launch.direct.LaunchStep`) then only reads the step's sizes and
    launches (``cached=True``: compiled kernels launched directly after their first call, pointers
    passed as addresses, ``kernels/launch/direct.py``).

    ``q_like``: any query tensor of the layer (``[T, Hq, Dqk]``: heads, dims, dtype, device); the other
    arguments as in :func:`paged_attention`."""

    def __init__(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        q_like: torch.Tensor,
        *,
        scale: float,
        headwise: bool = False,
        window_left: int | None = None,
        sliding_heads: tuple[int, int] | None = None,
        sink_kind: str = "vanilla",
        sinks: torch.Tensor | None = None,
        prefill_config: TileConfig | None = None,
        decode_config: TileConfig | None = None,
        prefill_impl: str | None = None,
        logits_soft_cap: float | None = None,
        cached: bool = True,
        kv_quant: KVCacheQuant | str | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        q = q_like
        if q.dim() != 3:
            raise ValueError(f"q must be [T, Hq, Dqk], got shape {list(q.shape)}")
        _, hq, dqk = q.shape
        hkv, bs, dv = key_cache.shape[1], key_cache.shape[2], value_cache.shape[3]
        page_h = _check_cache("key_cache", key_cache, hkv, dqk)
        if _check_cache("value_cache", value_cache, hkv, dv) != page_h:
            raise ValueError(
                f"key_cache and value_cache must have the same heads per block, got strides "
                f"{key_cache.stride()} and {value_cache.stride()}"
            )
        if hkv <= 0 or hq % hkv:
            raise ValueError(f"q heads {hq} must be a multiple of the cache's kv heads {hkv}")
        quant = kv_cache_quant(kv_quant) if not isinstance(kv_quant, KVCacheQuant) else kv_quant
        scales = _check_quant(quant, key_cache, value_cache, key_scale, value_scale, q, page_h)
        for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
            # named here: Triton's own message ("cpu tensor?") names neither the tensor nor the devices
            if getattr(c, "device", None) != getattr(q, "device", None):
                raise ValueError(f"{name} is on {c.device} but q is on {q.device}: one device for all")
        if window_left is not None and window_left < 0:
            raise ValueError(f"window_left must be >= 0 or None, got {window_left}")
        if sink_kind not in SINK_MODES:
            raise ValueError(f"sink_kind must be one of {sorted(SINK_MODES)}, got {sink_kind!r}")
        sink_mode = SINK_MODES[sink_kind]
        if sink_mode == 1:
            if sinks is None or sinks.numel() != hq:
                raise ValueError(f"sink_kind='learnable' needs sinks of shape [{hq}], got {sinks!r}")
            sinks = to_float32(sinks, q)
        else:
            sinks = None
        g = hq // hkv
        has_window = window_left is not None
        win_h0, win_h1 = sliding_heads if (has_window and sliding_heads is not None) else (0, hkv)
        window = int(window_left) if has_window else 0
        qk_scale = float(scale) * LOG2E
        softcap = 0.0
        if logits_soft_cap is not None:  # qk_scale becomes scale / cap; cap * log2(e) a compile-time constant
            cap = float(logits_soft_cap)
            if not (math.isfinite(cap) and cap > 0):
                raise ValueError(
                    f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}"
                )
            qk_scale, softcap = float(scale) / cap, cap * LOG2E
        self.hq, self.hkv, self.dqk, self.dv, self.bs, self.g = hq, hkv, dqk, dv, bs, g
        self.dtype, self.device = q.dtype, q.device
        self.key_cache, self.value_cache, self.sinks, self.sink_mode = (
            key_cache,
            value_cache,
            sinks,
            sink_mode,
        )
        self.headwise, self.has_window, self.window = bool(headwise), has_window, window
        self.win_h0, self.win_h1, self.qk_scale = win_h0, win_h1, qk_scale
        # table entries must lie in [0, n_pages): blocks, or head-wise pages (block * Hkv + head)
        self.n_pages = min(key_cache.shape[0], value_cache.shape[0]) * (hkv if headwise else 1)
        self.common = (key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2))
        # e4m3 codes under a bf16 model: read as fp16 (attention_kernels._q_for_codes); an fp16 model's
        # decode takes modes 2 / 3 too (its V codes then convert where loaded)
        fp8 = quant is not None and quant.code == "fp8"
        model = str(q.dtype).rsplit(".", 1)[-1]
        auto_codes = FP8_F16_CODES_DECODE is None  # fp8_decode_setup, once the decode tile is known
        decode_mode = 1 if auto_codes else FP8_F16_CODES_DECODE
        prefill_codes = FP8_F16_CODES_PREFILL if fp8 and model == "bfloat16" else 0
        decode_codes = decode_mode if fp8 and model == "bfloat16" else 0
        if fp8 and model == "float16" and decode_mode >= 2:
            decode_codes = decode_mode
        self.consts = dict(
            HKV=hkv, DQK=dqk, DV=dv, BLOCK_DQK=next_pow2(max(dqk, 16)), BLOCK_DV=next_pow2(max(dv, 16)),
            BS=bs, HEADWISE=bool(headwise), HAS_WINDOW=has_window, PAGE_H=page_h, SOFTCAP=softcap,
            KV_CODE=KV_CODES[quant.code] if quant is not None else 0, SCALE_MODE=scales[0],
        )  # fmt: skip
        self.kv_quant = quant
        #: the scales as the kernels take them (the key cache where unused: any pointer), their strides
        self.key_scale, self.value_scale = scales[1], scales[2]
        self.scale_strides = scales[3]
        elem = q.element_size()
        self.prefill = "portable"
        self.hopper = None
        self._hopper_args = None
        #: a quantized cache's Hopper prefill: the dequantizing gather into the shared scratch
        #: (kernels/kv_dequant_gather.py), and the scratch generation :attr:`hopper` was built over
        self.gather = None
        self._hopper_gen = -1
        if choose_prefill_impl(prefill_impl, prefill_config, q, key_cache, value_cache, quant) == "hopper":
            self.prefill = "hopper"
            # built on the first prefill (its TMA descriptors cost ~20 us: a decode-only plan skips them)
            self._hopper_args = dict(
                qk_scale=qk_scale, sink_mode=sink_mode, headwise=bool(headwise), has_window=has_window,
                window=window, win_h0=win_h0, win_h1=win_h1, softcap=softcap,
            )  # fmt: skip
            if quant is not None:
                self.gather = DequantGather(
                    hkv=hkv, block_size=bs, dqk=dqk, dv=dv, dtype=q.dtype, device=q.device,
                    kv_code=KV_CODES[quant.code], scale_mode=scales[0], page_h=page_h, common=self.common,
                    scale_strides=scales[3], n_pages=self.n_pages, headwise=bool(headwise),
                    window=window if has_window else None, win_h0=win_h0, win_h1=win_h1,
                )  # fmt: skip
        cfg = prefill_config or default_prefill_config(dqk, dv, q.device, elem, has_window)
        self.prefill_cfg = cfg
        self.gp = next_pow2(g)
        self.block_q = max(1, cfg.block_m // self.gp)
        self.prefill_desc = (  # a quantized cache loads through pointers
            _tma_descriptors(key_cache, value_cache, cfg.block_n, dqk, dv)
            if cfg.use_tma and quant is None
            else None
        )
        self.exp_bf16 = cfg.exp_bf16 and str(q.dtype).endswith("bfloat16") and q.is_cuda
        self.all_slide = has_window and win_h0 <= 0 and win_h1 >= hkv
        self.decode_cfg = decode_config or default_decode_config(dqk, dv, q.device, elem, self.all_slide)
        #: decode's key tiles as the dots' rows (attention_kernels._tile_key_rows)
        self.key_rows = decode_takes_key_rows(None if quant is None else quant.name, bool(headwise), dqk, dv)
        if decode_config is None and fp8:  # the default decode tile of an fp8 cache: mode and register cap
            cap = FP8_DECODE_MAXNREG
            setup = None
            if auto_codes and self.key_rows and model in ("bfloat16", "float16"):  # both read fp16 codes
                setup = key_rows_decode_setup(self.decode_cfg, dqk, dv)
            elif auto_codes and decode_codes:
                setup = fp8_decode_setup(self.decode_cfg, dqk, dv, bool(headwise), has_window)
            if setup is not None:
                decode_codes, auto_cap = setup
                cap = auto_cap if cap is None else cap
            if cap is not None:
                self.decode_cfg = replace(self.decode_cfg, maxnreg=cap)
        #: ``F16_CODES`` of the (prefill, decode) launches; 3 is inline PTX: the interpreter takes 2
        self.f16_codes = tuple(2 if m == 3 and not q.is_cuda else m for m in (prefill_codes, decode_codes))
        self.decode_desc = (
            _tma_descriptors(key_cache, value_cache, self.decode_cfg.block_n, dqk, dv)
            if self.decode_cfg.use_tma and quant is None
            else None
        )
        self.sms = _num_sms(q.device)
        on_gpu = getattr(q.device, "type", None) == "cuda" and is_torch(q)
        index = (q.device.index if q.device.index is not None else 0) if on_gpu else None
        self.kernels = KernelCache(index if cached else None)
        self._consts: dict = {}  # per (kernel, has_err[, splits]): the launch's constexprs and options
        self._splits: dict = {}  # (requests, max_context_len, table width) -> split count
        self.torch_out = is_torch(q)  # outputs by q.new_empty, else _framework.empty
        #: a server's decode-only steps write their K/V in the decode launch (``FDFLEET_FUSED_DECODE_WRITE``)
        self.fuse_write = envs.fused_decode_write() and quant is None
        self.hqdv = hq * dv
        #: the kernels' trailing scalars, and their TMA descriptor arguments (None: no TMA)
        self.scalars = (self.qk_scale, self.window, self.win_h0, self.win_h1)
        pd, dd = self.prefill_desc, self.decode_desc
        #: a one-shot memo may keep the plan: no portable TMA descriptors (a tuning config) over the caches
        self.memo_ok = pd is None and dd is None
        self.descs = (pd[0], pd[1]) if pd is not None else (None, None)
        self.ddescs = (dd[0], dd[1]) if dd is not None else (None, None)
        # the caches' and sinks' addresses: what a direct launch passes (kernels/launch/direct.py)
        self.ptrs = (
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            sinks.data_ptr() if sinks is not None else 0,
        )
        #: the scales' addresses (the key cache's where unused)
        self.scale_ptrs = (self.key_scale.data_ptr(), self.value_scale.data_ptr())
        self.static_aligned = not (
            (self.ptrs[0] | self.ptrs[1] | self.ptrs[2] | self.scale_ptrs[0] | self.scale_ptrs[1]) & 15
        )
        self.out_strides = (hq * dv, dv)  # of an output the plan allocates ([T, Hq, Dv] or [T, Hq * Dv])

    def bind(
        self,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        """Point the plan at ``key_cache`` / ``value_cache`` (and a quantized cache's ``key_scale`` /
        ``value_scale``): tensors equal to the ones it was built for in :func:`~.launch.direct.tensor_key`
        (same memory, same layout), or ``None`` to hold none between calls (a memoised one-shot plan)."""
        self.key_cache, self.value_cache = key_cache, value_cache
        if self.kv_quant is None:  # the unused scale arguments are the key cache
            key_scale = value_scale = key_cache
        elif self.consts["SCALE_MODE"] != SCALE_TOKEN and key_scale is not None:  # static: flat views
            key_scale, value_scale = key_scale.reshape(-1), value_scale.reshape(-1)
        self.key_scale, self.value_scale = key_scale, value_scale
        hop = self.hopper
        # its TMA descriptors read the caches' addresses at each launch (a gather's: the scratch's)
        if hop is not None and self.gather is None:
            try:
                hop.value_cache = value_cache
                hop.k_desc.base, hop.v_desc.base = key_cache, value_cache
            except AttributeError:  # a HopperPlan laid out otherwise: built again on the next prefill
                self.hopper = None

    def _tensor_args(self, q: torch.Tensor, out: torch.Tensor, step: LaunchStep) -> tuple:
        """The kernels' pointer arguments as tensors (Triton's path): q, the caches, out, the sinks (q
        when unused), cu_seqlens_q, seq_lens_decoder, the table, the error flag (the table when none)."""
        sink_arg = self.sinks if self.sink_mode == 1 else q
        return (
            q,
            self.key_cache,
            self.value_cache,
            out,
            sink_arg,
            step.cu,
            step.dec,
            step.table,
            step.err_arg,
        )

    def run(
        self,
        q: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens_decoder: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        max_q_len: int | None = None,
        max_context_len: int | None = None,
        out: torch.Tensor | None = None,
        num_splits: int | None = None,
        errors: torch.Tensor | None = None,
        stream: int | None = None,
    ) -> torch.Tensor:
        """Attention of ``q [T, Hq, Dqk]`` (this plan's heads, dims and dtype) over the plan's caches
        for one step's metadata (as in :func:`paged_attention`); returns ``out [T, Hq, Dv]``.
        ``stream``: the current CUDA stream when the caller read it already."""
        step = fill_step(
            new_step(), cu_seqlens_q, seq_lens_decoder, block_tables, None, max_q_len, max_context_len, errors
        )
        return self.run_step(q, step, out=out, num_splits=num_splits, stream=stream)

    def run_step(
        self,
        q: torch.Tensor,
        step: LaunchStep,
        *,
        out: torch.Tensor | None = None,
        flat: bool = False,
        num_splits: int | None = None,
        stream: int | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`run` on a step's :class:`~.launch.direct.LaunchStep` (derived once per step, shared by every
        layer). ``q [T, Hq, Dqk]`` in the plan's dtype (``ValueError`` otherwise: kept kernels are keyed
        without it). ``flat``: a new output is ``[T, Hq * Dv]`` (the backend's shape; no view per call),
        else ``[T, Hq, Dv]``; a given ``out`` is ``[T, Hq, Dv]``. ``new_kv``: :func:`paged_attention`'s."""
        qs = q.stride()
        if qs[2] != 1:
            raise ValueError(f"q needs a contiguous last dim, got strides {qs}")
        if q.dtype != self.dtype:  # the kept kernels are this dtype's (not in their key)
            raise ValueError(f"q is {q.dtype}, but this plan was built for {self.dtype}")
        t = q.shape[0]
        return self._launch_step(
            q, qs, t, step, out, None if out is None else out.stride(), flat, num_splits, stream,
            None if new_kv is None else self._check_new_kv(new_kv, t, step),
        )  # fmt: skip

    def _check_new_kv(self, new_kv: tuple, t: int, step: LaunchStep) -> tuple:
        """``(k, v, k strides, v strides)`` of a fused write's ``new_kv``, checked: a decode-only step,
        ``k [>= T, Hkv, Dqk]`` / ``v [>= T, Hkv, Dv]`` with contiguous last dims, in the caches' dtype
        or one the kernel converts (float)."""
        if self.kv_quant is not None:
            raise ValueError(
                f"new_kv (the cache write fused into the decode) is not available for a quantized cache "
                f"(kv_quant={self.kv_quant.name!r}): write it first (kernels/cache_write.py), then attend"
            )
        if step.max_q_len != 1:
            raise ValueError(
                f"new_kv (the cache write fused into the decode) needs a step where every request decodes "
                f"one token (max_q_len=1), got max_q_len={step.max_q_len}"
            )
        k, v = new_kv
        ks, vs = k.stride(), v.stride()
        if (
            len(ks) != 3
            or len(vs) != 3
            or ks[2] != 1
            or vs[2] != 1
            or k.shape[0] < t
            or v.shape[0] < t
            or k.shape[1] != self.hkv
            or v.shape[1] != self.hkv
            or k.shape[2] != self.dqk
            or v.shape[2] != self.dv
        ):
            raise ValueError(
                f"new_kv must be k [>= {t}, {self.hkv}, {self.dqk}] and v [>= {t}, {self.hkv}, {self.dv}] "
                f"with contiguous last dims, got {list(k.shape)} / {list(v.shape)} (strides {ks} / {vs})"
            )
        return k, v, ks, vs

    def _launch_step(
        self,
        q: torch.Tensor,
        qs: tuple,
        t: int,
        step: LaunchStep,
        out: torch.Tensor | None,
        ost: tuple | None,
        flat: bool,
        num_splits: int | None,
        stream: int | None,
        new_kv: tuple | None = None,
    ) -> torch.Tensor:
        """:meth:`run_step` with ``q``'s strides ``qs`` and rows ``t``, a given ``out``'s strides ``ost``
        and ``new_kv`` as ``(k, v, k strides, v strides)`` read (and checked) by the caller."""
        given = out is not None
        if not given:
            out = self._new_out(q, t, flat)
            ost = self.out_strides  # a fresh allocation: contiguous
        if t == 0 or step.num_reqs <= 0:
            return out
        cache = self.kernels
        key = None
        if (
            cache.direct
            and step.direct_ok
            and self.static_aligned
            and q.is_cuda
            and (not given or out.is_cuda)
        ):
            qp, op = q.data_ptr(), out.data_ptr()
            align, new = qp | op, None
            if new_kv is not None:
                k, v, ks, vs = new_kv
                new = (k.data_ptr(), v.data_ptr(), ks, vs, k.dtype, v.dtype)
                align |= new[0] | new[1]
            if not align & 15:  # else Triton's path: it specialises on alignment
                if stream is None:
                    stream = cache.stream()
                if self.launch_kept(
                    q, qp, qs, t, op, ost, step.num_reqs, step.max_q_len, step.max_context_len, step.n_blk,
                    step.stride_tbl, step.ptrs, step.sig, num_splits, stream, new,
                ):  # fmt: skip
                    return out
                key = (qs[0], qs[1], ost[0], ost[1], step.sig)  # compiled and kept below
        self._launch_triton(q, qs, t, step, out, ost, num_splits, stream, key, new_kv)
        return out

    def _new_out(self, q: Any, t: int, flat: bool) -> Any:
        """A new output for ``t`` rows of ``q``'s framework and device: ``[T, Hq * Dv]`` if ``flat``, else
        ``[T, Hq, Dv]`` (contiguous: :attr:`out_strides`)."""
        if self.torch_out:  # new_empty with int sizes: the cheapest allocation torch has (~1 us)
            return q.new_empty(t, self.hqdv) if flat else q.new_empty(t, self.hq, self.dv)
        return empty((t, self.hqdv) if flat else (t, self.hq, self.dv), self.dtype, q)

    @staticmethod
    def _runs(mq: int | None, num_reqs: int, t: int) -> tuple[bool, bool]:
        """Which kernels a step of ``t`` rows over ``num_reqs`` requests with ``max_q_len`` ``mq``
        needs: (prefill, decode). Prefill: requests with >= 2 tokens (unknown without ``max_q_len``);
        decode: requests with exactly 1 (none when every request has ``max_q_len > 1`` tokens)."""
        if mq is None:
            return True, True
        return mq > 1, not (mq > 1 and t >= num_reqs * mq)

    def _num_splits(self, num_reqs: int, mc: int | None, n_blk: int, num_splits: int | None) -> int:
        """The decode's split count for a step of ``num_reqs`` requests, ``max_context_len`` ``mc`` and
        table width ``n_blk`` (given, else chosen per (requests, key span), kept by the values the span
        comes from)."""
        if num_splits is not None:
            return num_splits
        splits = self._splits.get((num_reqs, mc, n_blk))
        if splits is None:
            span = n_blk * self.bs if mc is None else mc
            if self.all_slide and span > self.window + 1:
                span = self.window + 1
            if len(self._splits) > 4096:
                self._splits.clear()
            splits = choose_num_splits(num_reqs, self.hkv, span, self.decode_cfg.block_n, self.sms)
            self._splits[(num_reqs, mc, n_blk)] = splits
        return splits

    def launch_kept(
        self,
        like: Any,
        qp: int,
        qs: Sequence[int],
        t: int,
        op: int,
        ost: Sequence[int],
        num_reqs: int,
        mq: int | None,
        mc: int | None,
        n_blk: int,
        stride_tbl: int,
        ptrs: tuple,
        sig: tuple,
        num_splits: int | None,
        stream: int | None,
        new: tuple | None = None,
    ) -> bool:
        """Launch this step's kernels by addresses if every one it needs is compiled and kept (a kernel
        cache hit for each); else launch nothing and return ``False``.

        ``qp`` / ``op``: addresses of ``q [T, Hq, Dqk]`` and ``out [T, Hq, Dv]`` (16-byte aligned, on
        the plan's GPU: the caller checked), ``qs`` / ``ost`` their strides (the first two read), ``t``
        q's rows. The step as a direct-launch :class:`~.launch.direct.LaunchStep` (``direct_ok``) gives it:
        ``num_reqs``, ``max_q_len`` (``mq``), ``max_context_len`` (``mc``), ``n_blk``, ``stride_tbl``,
        ``ptrs``, ``sig`` (the one-shot wrapper reads them from its tensors, without a ``LaunchStep``).
        ``like``: a tensor of the caller's framework, for the split decode's partial buffers. Nothing
        else is read from a tensor, so paddle tensors launch here as torch tensors do (the backend's
        paddle lane). ``new``: the fused cache write's ``(k address, v address, k strides, v strides, k
        dtype, v dtype)`` (16-byte aligned; a decode-only step, :meth:`_check_new_kv`), or ``None``."""
        cache = self.kernels
        if not cache.addresses:
            return False
        key = (qs[0], qs[1], ost[0], ost[1], sig)
        run_prefill, run_decode = self._runs(mq, num_reqs, t)
        if new is not None and run_prefill:
            return False  # a fused write is for decode-only steps (run_step refuses others)
        hopper = pre = dec = red = None
        if run_prefill:
            if self.gather is not None:  # the gather's scratch and table: _launch_triton's (tensors)
                return False
            pkey = ("hopper", key) if self._hopper_args is not None else ("prefill", key)
            if self._hopper_args is not None:
                hopper = self.hopper
                if hopper is None:
                    return False
            pre, pre_safe = cache.kernel(pkey), cache.kernel(safe_key(pkey))  # the fast and safe launches
            if pre is None or pre_safe is None:
                return False
        splits = 1
        if run_decode:
            splits = self._num_splits(num_reqs, mc, n_blk, num_splits)
            dec = cache.kernel(self._decode_key(splits, key, new))
            if dec is None:
                return False
            if splits > 1:
                red = cache.kernel(("reduce", splits, key))
                if red is None:
                    return False
        kp, vp, sp = self.ptrs
        ksp, vsp = self.scale_ptrs
        g0, g1, g2, g3 = self.scale_strides
        if self.sink_mode != 1:
            sp = qp  # unused: any pointer
        p0, p1, p2, p3 = ptrs
        if hopper is not None:
            hopper.run_kept(
                (pre, pre_safe), qp, vp, op, sp, p0, p1, p2, p3, qs, ost, t, num_reqs, stride_tbl, n_blk,
                stream,
            )  # fmt: skip
        elif pre is not None:  # one flat tuple (a starred one costs ~0.3 us per star here)
            c0, c1, c2, c3 = self.common
            s0, s1, s2, s3 = self.scalars
            d0, d1 = self.descs
            grid = ((t // self.block_q + num_reqs) * self.hkv,)
            redo = empty(grid, "int32", like)  # stays queued on this stream's allocator after return
            pargs = (
                qp, kp, vp, op, d0, d1, sp, p0, p1, p2, p3, redo.data_ptr(), qs[0], qs[1], ost[0], ost[1],
                c0, c1, c2, c3, stride_tbl, n_blk, self.n_pages, t, num_reqs, 2, s0, s1, s2, s3, ksp, vsp,
                g0, g1, g2, g3,
            )  # fmt: skip
            pre(grid, pargs, stream)
            pre_safe((min(grid[0], SAFE_GRID),), pargs, stream)
        if dec is None:
            return True
        c0, c1, c2, c3 = self.common
        s0, s1, s2, s3 = self.scalars
        d0, d1 = self.ddescs
        if red is not None:
            mid_o = empty((num_reqs, self.hq, splits, self.dv), "float32", like)
            mid_l = empty((num_reqs, self.hq, splits), "float32", like)
            pmo, pml = mid_o.data_ptr(), mid_l.data_ptr()
        else:
            pmo = pml = qp  # unused: any pointer
        if new is None:
            knp = vnp = qp  # unused: any pointer
            ks0 = ks1 = vs0 = vs1 = 0
        else:
            knp, vnp, (ks0, ks1, _), (vs0, vs1, _), _, _ = new
        dec(
            (num_reqs, self.hkv, splits),
            (
                qp, kp, vp, op, d0, d1, pmo, pml, sp, p0, p1, p2, p3, qs[0], qs[1], ost[0], ost[1],
                c0, c1, c2, c3, stride_tbl, n_blk, self.n_pages, t, s0, s1, s2, s3,
                knp, vnp, ks0, ks1, vs0, vs1, ksp, vsp, g0, g1, g2, g3,
            ),
            stream,
        )  # fmt: skip
        if red is not None:  # the partial buffers stay queued on this stream's allocator after return
            reduce_kept(
                red,
                pmo,
                pml,
                op,
                sp if self.sinks is not None else pmo,
                p0,
                ost,
                t,
                num_reqs,
                self.hq,
                stream,
            )
        return True

    def _launch_triton(
        self,
        q: torch.Tensor,
        qs: tuple,
        t: int,
        step: LaunchStep,
        out: torch.Tensor,
        ost: tuple,
        num_splits: int | None,
        stream: int | None,
        key: tuple | None,
        new_kv: tuple | None = None,
    ) -> None:
        """The step's launches with tensors, through Triton (compiling on first use and keeping the
        kernel when ``key`` is given; a kernel kept already launches by addresses) or, with
        :data:`~.launch.direct.ADDRESS_ARGS` off, through kept kernels given tensors. ``new_kv``: the fused
        cache write's ``(k, v, k strides, v strides)``."""
        hq, dv, cache = self.hq, self.dv, self.kernels
        num_reqs = step.num_reqs
        sizes = self._sizes(qs, ost, step, t)
        pq, pk, pv, po, ps, pcu, pdec, ptbl, perr = self._tensor_args(q, out, step)
        run_prefill, run_decode = self._runs(step.max_q_len, step.num_reqs, t)
        out3 = None
        gather = run_prefill and self.gather is not None
        if gather:  # within FDFLEET_DEQUANT_SCRATCH_MB, else the portable prefill over the codes
            self.gather.reserve()  # the whole budget at the first prefill, as FastDeploy's profile run
            gather = self.gather.fits(
                num_reqs, t, step.table.shape[0], step.table.shape[1], max_q_len=step.max_q_len,
                max_context_len=step.max_context_len,
            )  # fmt: skip
        if gather:
            out3 = out if out.dim() == 3 else out.view(t, hq, dv)
            self._gather_prefill(q, out3, t, step, stream, key)
        elif run_prefill and self._hopper_args is not None and self.gather is None:
            if self.hopper is None:
                self.hopper = HopperPlan(
                    self.key_cache, self.value_cache, self.hq, self.sinks, **self._hopper_args
                )
            out3 = out if out.dim() == 3 else out.view(t, hq, dv)
            hkey = direct = None
            if key is not None:
                kp, vp, sp = self.ptrs
                hkey = ("hopper", key)
                direct = (
                    q.data_ptr(),
                    kp,
                    vp,
                    out.data_ptr(),
                    sp if self.sink_mode == 1 else q.data_ptr(),
                    *step.ptrs,
                )
            self.hopper.run(q, out3, step.cu, step.dec, step.table, step.errors, cache, hkey, stream, direct)
        elif run_prefill:
            pkey = None if key is None else ("prefill", key)
            grid = ((t // self.block_q + num_reqs) * self.hkv,)
            redo = empty(grid, "int32", q)  # per program: a row of the fast launch came out non-finite
            args = (
                pq,
                pk,
                pv,
                po,
                *self.descs,
                ps,
                pcu,
                pdec,
                ptbl,
                perr,
                redo,
                *sizes,
                num_reqs,
                2,
                *self.scalars,
                self.key_scale,
                self.value_scale,
                *self.scale_strides,
            )
            # the fast launch, then the safe one on a few programs (attention_kernels._prefill_kernel)
            fast = (pkey, grid, self._prefill_consts(step.errors is not None))
            safe = (safe_key(pkey), (min(grid[0], SAFE_GRID),), self._prefill_consts("safe"))
            for k, g, consts in (fast, safe):
                hit = cache.kernel(k)
                if hit is not None and not cache.addresses:
                    hit(g, args, stream)
                else:
                    cache.launch(_prefill_kernel, k, g, args, consts, stream)
        if not run_decode:
            return
        splits = self._num_splits(num_reqs, step.max_context_len, step.n_blk, num_splits)
        new = None
        if new_kv is not None:
            k, v, ks, vs = new_kv
            new = (k, v, ks, vs, k.dtype, v.dtype)
        dkey = None if key is None else self._decode_key(splits, key, new)
        hit = cache.kernel(dkey)
        mid_o = mid_l = None
        if splits > 1:
            mid_o = empty((num_reqs, hq, splits, dv), "float32", q)
            mid_l = empty((num_reqs, hq, splits), "float32", q)
        pmo, pml = (mid_o, mid_l) if splits > 1 else (pq, pq)
        fused = (new[0], new[1], new[2][0], new[2][1], new[3][0], new[3][1]) if new else (pq, pq, 0, 0, 0, 0)
        args = (
            pq, pk, pv, po, *self.ddescs, pmo, pml, ps, pcu, pdec, ptbl, perr, *sizes, *self.scalars, *fused,
            self.key_scale, self.value_scale, *self.scale_strides,
        )  # fmt: skip
        grid = (num_reqs, self.hkv, splits)
        if hit is not None and not cache.addresses:
            hit(grid, args, stream)
        else:
            consts = self._decode_consts(step.errors is not None, splits, new is not None)
            cache.launch(_decode_kernel, dkey, grid, args, consts, stream)
        if splits > 1:
            if out3 is None:
                out3 = out if out.dim() == 3 else out.view(t, hq, dv)
            split_kv_reduce(
                mid_o, mid_l, out3, step.cu, self.sinks, self.sink_mode, kernels=cache,
                key=None if key is None else ("reduce", splits, key), stream=stream,
            )  # fmt: skip

    def _gather_prefill(
        self, q: torch.Tensor, out3: torch.Tensor, t: int, step: LaunchStep, stream: int | None, key: Any
    ) -> None:
        """A quantized cache's Hopper prefill: the dequantizing gather of the pages this step's prefill
        requests read into the shared scratch, then the bf16 :class:`HopperPlan` over the scratch and the
        remapped table (built again when the scratch was reallocated). ``key``: the direct launches'
        (``None``: Triton's path)."""
        cache = self.kernels
        sk, sv, tbl = self.gather.run(
            self.key_cache, self.value_cache, self.key_scale, self.value_scale, step.cu, step.dec, step.table,
            t, max_q_len=step.max_q_len, max_context_len=step.max_context_len, errors=step.errors,
            kernels=cache, key=None if key is None else ("gather", step.sig), stream=stream,
        )  # fmt: skip
        gen = self.gather.scratch.generation
        if self.hopper is None or self._hopper_gen != gen:
            self.hopper = None  # the old descriptors hold the old scratch: let it go first
            self.hopper = HopperPlan(sk, sv, self.hq, self.sinks, **self._hopper_args)
            self._hopper_gen = gen
        hkey = direct = None
        if key is not None:
            p0, p1, _, p3 = step.ptrs
            sp = self.ptrs[2] if self.sink_mode == 1 else q.data_ptr()
            hkey = ("hopper-gather", key)
            qp, op = q.data_ptr(), out3.data_ptr()
            direct = (qp, sk.data_ptr(), sv.data_ptr(), op, sp, p0, p1, tbl.data_ptr(), p3)
        self.hopper.run(q, out3, step.cu, step.dec, tbl, step.errors, cache, hkey, stream, direct)

    def _sizes(self, qs: tuple, ost: tuple, step: LaunchStep, t: int) -> tuple:
        """The kernels' arguments after the pointers, up to the scalars: q's and out's strides, the
        caches' strides, the table's stride and width, the pages, the tokens."""
        return (qs[0], qs[1], ost[0], ost[1], *self.common, step.stride_tbl, step.n_blk, self.n_pages, t)

    def _prefill_consts(self, has_err: bool | str) -> dict:
        """The portable prefill launch's constexprs and options (Triton's path): the fast launch with or
        without the error flag, or ``"safe"``: the safe launch (no errors: the fast one recorded them)."""
        consts = self._consts.get(("prefill", has_err))
        if consts is None:
            cfg = self.prefill_cfg
            consts = self._consts[("prefill", has_err)] = dict(
                G=self.g, GP=self.gp, BLOCK_Q=self.block_q, BLOCK_N=cfg.block_n, BLOCK_NM=masked_block_n(cfg),
                SINK_MODE=self.sink_mode, SAFE=has_err == "safe",
                USE_TMA=self.prefill_desc is not None, EXP_BF16=self.exp_bf16, PROFILE=cfg.profile,
                HAS_ERR=has_err is True, ERR_LOOP=ERR_LOOP_PREFILL, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, F16_CODES=self.f16_codes[0], **self.consts, **_reg_cap(cfg),
            )  # fmt: skip
        return consts

    @staticmethod
    def _decode_key(splits: int, key: tuple, new: tuple | None) -> tuple:
        """A decode kernel's key: the split count is compiled in; a fused write adds the new K/V's
        strides and dtypes (Triton specialises on them)."""
        if new is None:
            return ("decode", splits, key)
        return ("decode-fused", splits, key, new[2][0], new[2][1], new[3][0], new[3][1], new[4], new[5])

    def _decode_consts(self, has_err: bool, num_splits: int, fused: bool = False) -> dict:
        """The decode launch's constexprs and options (Triton's path)."""
        consts = self._consts.get(("decode", has_err, num_splits, fused))
        if consts is None:
            cfg = self.decode_cfg
            key_rows = self.key_rows and not fused  # the fused write keeps the query-rows layout
            consts = self._consts[("decode", has_err, num_splits, fused)] = dict(
                G=self.g, BLOCK_H=max(8 if key_rows else 16, next_pow2(self.g)), BLOCK_N=cfg.block_n,
                SINK_MODE=self.sink_mode, NUM_SPLITS=num_splits, USE_TMA=self.decode_desc is not None,
                HAS_ERR=has_err, ERR_LOOP=ERR_LOOP_DECODE, FUSE_WRITE=fused, KEY_ROWS=key_rows,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, F16_CODES=self.f16_codes[1], **self.consts, **_reg_cap(cfg),
            )  # fmt: skip
        return consts


__all__ = [
    "AttentionPlan",
    "SINK_MODES",
    "TileConfig",
    "choose_num_splits",
    "default_decode_config",
    "default_prefill_config",
    "paged_attention",
]
