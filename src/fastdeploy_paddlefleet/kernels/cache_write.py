"""Cache write: scatter this step's K/V rows into their slots of FastDeploy's paged cache.

Token ``t`` of request ``b`` sits at position ``pos = seq_lens_decoder[b] + t - cu_seqlens_q[b]``:
logical block ``pos // block_size``, slot ``pos % block_size``. The page of kv head ``h`` is
``block_tables[b, blk] * Hkv + h`` or, head-wise, ``page_table[b * Hkv + h, blk]``. A token with a
negative request id (or one past its request's rows, or a request id past the batch: padding) is
skipped. A table entry that is negative, past the cache, or past the table's width (a position the
table does not cover) is never written through, and is recorded in the error flag when one is given
(``kernels/errors.py``): a token being written is always visible to itself, so its page must exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

from ._framework import is_torch, torch
from .errors import KERNEL_CACHE_WRITE, check_entries
from .kv_quant import FMT_IDS, quant_dynamic, quant_static
from .launch.direct import (
    KernelCache,
    LaunchStep,
    PlanMemo,
    caches_key,
    fill_step,
    new_step,
    step_values,
    switches_key,
)


@triton.jit(do_not_specialize=["stride_tbl", "n_blk", "n_pages", "num_reqs"])
def _write_kv_kernel(
    K, V, KC, VC, Bid, CuQ, Ctx, Tbl, Err,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kr, stride_vp, stride_vr, stride_tbl, n_blk, n_pages, num_reqs,
    KS, VS, stride_ksp, stride_ksr, stride_vsp, stride_vsr,
    HKV: tl.constexpr, BLOCK_HKV: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BS: tl.constexpr, HEADWISE: tl.constexpr,
    PAGE_H: tl.constexpr, HAS_ERR: tl.constexpr = False, QFMT: tl.constexpr = -1,
    PER_CHANNEL: tl.constexpr = False, STATIC_MULT: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0)
    b = tl.load(Bid + t)
    if (b < 0) | (b >= num_reqs):
        return
    if t >= tl.load(CuQ + b + 1):  # a padding token (a CUDA graph's batch is padded): not this request's
        return
    pos = tl.load(Ctx + b) + t - tl.load(CuQ + b)
    if pos < 0:
        return
    blk = pos // BS
    slot = pos % BS
    offs_h = tl.arange(0, BLOCK_HKV)
    h_in = offs_h < HKV
    blk_v = blk + offs_h * 0  # vector compares only (interpreter splat bug)
    h_ok = h_in & (blk_v < n_blk)
    if HEADWISE:  # row b * HKV + h of the page table per kv head
        raw = tl.load(Tbl + (b * HKV + offs_h) * stride_tbl + blk, mask=h_ok, other=-1)
        good = check_entries(
            Err, raw, blk_v, n_blk, h_in, n_pages, b, offs_h, offs_h, KERNEL_CACHE_WRITE, HAS_ERR
        )
        page = tl.where(good, raw, -1).to(tl.int64)
        if PAGE_H != HKV:  # pages are numbered in the layer's view: block * HKV + head
            page = tl.where(page >= 0, page // HKV * PAGE_H + page % HKV, -1)
    else:
        raw = tl.load(Tbl + b * stride_tbl + blk_v, mask=h_ok, other=-1)
        head = offs_h * 0 - 1
        good = check_entries(
            Err, raw, blk_v, n_blk, h_in, n_pages, b, head, offs_h, KERNEL_CACHE_WRITE, HAS_ERR
        )
        page = tl.where(good, raw.to(tl.int64) * PAGE_H + offs_h, -1)
    ok = h_ok & (page >= 0)
    t64 = t.to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mk = ok[:, None] & (offs_dk[None, :] < DQK)
    mv = ok[:, None] & (offs_dv[None, :] < DV)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_dk[None, :], mask=mk)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mv)
    k_dst = KC + page[:, None] * stride_kp + slot * stride_kr + offs_dk[None, :]
    v_dst = VC + page[:, None] * stride_vp + slot * stride_vr + offs_dv[None, :]
    if QFMT < 0:
        tl.store(k_dst, k.to(KC.dtype.element_ty), mask=mk)
        tl.store(v_dst, v.to(VC.dtype.element_ty), mask=mv)
    else:  # codes (uint8) at FastDeploy's rule (kernels/kv_quant.py), with the model dtype's roundings
        T: tl.constexpr = K.dtype.element_ty
        kf, vf = k.to(tl.float32), v.to(tl.float32)
        if QFMT == 0:  # block_wise_fp8: one scale per token and kv head, written beside the codes
            kq, k_scale = quant_dynamic(kf, T)
            vq, v_scale = quant_dynamic(vf, T)
            tl.store(KS + page * stride_ksp + slot * stride_ksr, k_scale.to(KS.dtype.element_ty), mask=ok)
            tl.store(VS + page * stride_vsp + slot * stride_vsr, v_scale.to(VS.dtype.element_ty), mask=ok)
        else:  # static: the checkpoint's scales (quant multipliers if STATIC_MULT), per kv head or channel
            if PER_CHANNEL:
                ks = tl.load(KS + offs_h[:, None] * DQK + offs_dk[None, :], mask=mk, other=1.0)
                vs = tl.load(VS + offs_h[:, None] * DV + offs_dv[None, :], mask=mv, other=1.0)
            else:
                ks = tl.load(KS + offs_h, mask=h_in, other=1.0)[:, None]
                vs = tl.load(VS + offs_h, mask=h_in, other=1.0)[:, None]
            kq = quant_static(kf, ks.to(tl.float32), QFMT == 1, T, STATIC_MULT)
            vq = quant_static(vf, vs.to(tl.float32), QFMT == 1, T, STATIC_MULT)
        tl.store(k_dst, kq, mask=mk)
        tl.store(v_dst, vq, mask=mv)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch_id_per_token: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_decoder: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    headwise: bool = False,
    errors: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    quant: Any = None,
    key_quant_scale: torch.Tensor | None = None,
    value_quant_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k [T, Hkv, Dqk]`` / ``v [T, Hkv, Dv]`` into ``key_cache [NB, Hkv, BS, Dqk]`` /
    ``value_cache [NB, Hkv, BS, Dv]`` in place. ``block_tables [bsz, max_blocks]`` or, with
    ``headwise=True``, ``[bsz * Hkv, max_pages]`` page tables.

    The caches may be strided views of the leading heads and channels of wider tensors (FastDeploy's
    one cache shape for every layer): blocks are addressed through ``stride(0)``, nothing is copied.

    ``errors``: an ``int32 [8]`` device error flag (``kernels/errors.py``) recording the first table
    entry a written token needs that is negative, past the cache or past the table's width; such
    entries are never written through, with or without a flag.

    Repeated calls with the same caches reuse one :class:`CacheWritePlan` (a memo of the last 16, keyed
    by the caches' address, shape, strides, dtype and device, ``headwise`` and the environment
    switches); the memo holds no cache between calls.

    A quantized cache (``quant``: a :class:`~fastdeploy_paddlefleet.kvcache.quant.KVCacheQuant`):
    ``key_cache`` / ``value_cache`` are ``uint8`` codes and ``key_scale`` / ``value_scale`` the dequant
    multipliers (``x ~= code * scale``): ``[num_blocks, Hkv, block_size]`` in the model dtype (k's),
    written here, for ``block_wise_fp8``; ``[Hkv]`` or ``[Hkv * D]``, read, for static formats. The codes
    follow FastDeploy's rule (``docs/kv_quant.md``, ``kernels/kv_quant.py``). A static format's
    ``key_quant_scale`` / ``value_quant_scale`` (both or neither, shaped like the scales, in the model
    dtype): FastDeploy's quant multipliers ``cache_k_scale`` / ``cache_v_scale``, multiplied by as they
    are; without them the write takes ``T(1 / scale)``, which can be one ulp off FastDeploy's."""
    ks, vs = k.stride(), v.stride()
    if len(ks) != 3 or len(vs) != 3:
        raise ValueError(f"k and v must be [T, Hkv, D], got shapes {list(k.shape)} and {list(v.shape)}")
    t = k.shape[0]
    if t == 0:
        return
    # the plan of an earlier call with the same caches (_PLANS), else a new one; its key: what the plan
    # derives from the caches (caches_key), headwise, the switches
    key = (caches_key(key_cache, value_cache), headwise, switches_key())
    key_scale, value_scale, mult = write_scales(
        quant, key_scale, value_scale, key_quant_scale, value_quant_scale
    )
    if quant is not None:
        key += (quant, caches_key(key_scale, value_scale), mult)
    try:
        plan, slot = _PLANS.take(key)
    except TypeError:  # an unhashable argument: no memo
        key = plan = slot = None
    if plan is None:
        scales = dict(key_scale=key_scale, value_scale=value_scale, quant=quant)
        if mult:  # the scales resolved above are the quant multipliers
            scales = dict(scales, key_quant_scale=key_scale, value_quant_scale=value_scale)
        plan = CacheWritePlan(key_cache, value_cache, headwise=headwise, **scales)
    else:
        plan.bind(key_cache, value_cache, key_scale, value_scale)
    try:
        vals = step_values(cu_seqlens_q, seq_lens_decoder, block_tables, batch_id_per_token, errors)
        num_reqs, n_blk, stride_tbl, ptrs, bid_ptr, sig, direct_ok = vals
        cache = plan.kernels
        if (
            cache.direct
            and batch_id_per_token is not None
            and ks[2] == 1
            and vs[2] == 1
            and direct_ok
            and plan.static_aligned
            and k.is_cuda
            and v.is_cuda
        ):
            # the kept lane: the kernel launched from the step's values, as _launch_step launches it when
            # kept (no LaunchStep); any other call takes the path below
            kp = k.data_ptr()
            vp = v.data_ptr()
            if not (kp | vp) & 15:
                if plan.launch_kept(
                    kp, vp, ks, vs, k.dtype, v.dtype, t, num_reqs, stride_tbl, n_blk, ptrs, bid_ptr, sig,
                    cache.stream(),
                ):  # fmt: skip
                    return
        step = fill_step(
            new_step(), cu_seqlens_q, seq_lens_decoder, block_tables, batch_id_per_token, None, None, errors,
            vals,
        )  # fmt: skip
        plan._launch_step(k, v, ks, vs, t, step, None)
    finally:
        if key is not None:
            plan.bind(None, None)  # the memo keeps no cache alive
            _PLANS.give(key, plan, None, slot)


def write_quantized_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: Any,
    batch_id_per_token: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_decoder: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    headwise: bool = False,
    errors: torch.Tensor | None = None,
) -> None:
    """:func:`write_kv_cache` into a :class:`~fastdeploy_paddlefleet.backends.base.QuantizedKVCache`
    ``cache`` (codes ``uint8 [NB, Hkv, BS, D]``, dequant scales, format): ``k [T, Hkv, Dqk]`` /
    ``v [T, Hkv, Dv]`` in the model dtype."""
    write_kv_cache(
        k, v, cache.key, cache.value, batch_id_per_token, cu_seqlens_q, seq_lens_decoder, block_tables,
        headwise=headwise, errors=errors, key_scale=cache.key_scale, value_scale=cache.value_scale,
        quant=cache.quant, key_quant_scale=getattr(cache, "key_quant_scale", None),
        value_quant_scale=getattr(cache, "value_quant_scale", None),
    )  # fmt: skip


def write_scales(
    quant: Any, key_scale: Any, value_scale: Any, key_quant_scale: Any = None, value_quant_scale: Any = None
) -> tuple[Any, Any, bool]:
    """``(key scales, value scales, multipliers)``: the tensors the write kernel reads. A static
    format's quant multipliers (FastDeploy's ``cache_k_scale`` / ``cache_v_scale``) when given, the
    kernel multiplying by them as they are (``multipliers`` True); else the dequant multipliers.
    ``ValueError`` names a lone multiplier, one for a dynamic or unquantized cache, or one whose shape
    is not its dequant scale's."""
    given = (key_quant_scale is not None, value_quant_scale is not None)
    if not any(given):
        return key_scale, value_scale, False
    if not all(given):
        which = "key_quant_scale" if given[0] else "value_quant_scale"
        raise ValueError(f"{which} given alone: a static cache's quant multipliers come as a K and V pair")
    if quant is None or getattr(quant, "dynamic", True):
        name = getattr(quant, "name", quant)
        raise ValueError(
            f"key_quant_scale / value_quant_scale are a static format's quant multipliers; quant={name!r} "
            "takes none (block_wise_fp8 computes its own, an unquantized cache has none)"
        )
    for name, q, d in (("key", key_quant_scale, key_scale), ("value", value_quant_scale, value_scale)):
        if d is None or list(q.shape) != list(d.shape):
            got = None if d is None else list(d.shape)
            raise ValueError(
                f"{name}_quant_scale has shape {list(q.shape)}, its dequant multipliers {name}_scale {got}: "
                "one quant multiplier per dequant multiplier"
            )
    return key_quant_scale, value_quant_scale, True


#: one-shot plans of :func:`write_kv_cache` (``kernels/launch/direct.py`` :class:`PlanMemo`)
_PLANS = PlanMemo()


class CacheWritePlan:
    """The cache-write launch for one layer's caches, checked and derived once (strides, heads per
    block, compile-time constants); :meth:`run` per step. ``cached=True``: the compiled kernel is
    launched directly after its first call (``kernels/launch/direct.py``)."""

    def __init__(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        headwise: bool = False,
        cached: bool = True,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
        quant: Any = None,
        key_quant_scale: torch.Tensor | None = None,
        value_quant_scale: torch.Tensor | None = None,
    ) -> None:
        key_scale, value_scale, mult = write_scales(
            quant, key_scale, value_scale, key_quant_scale, value_quant_scale
        )
        #: the kernel reads a static format's quant multipliers (FastDeploy's), not its dequant ones
        self.multipliers = mult
        hkv = key_cache.shape[1] if key_cache.dim() == 4 else -1
        dqk, dv = key_cache.shape[-1], value_cache.shape[-1]
        page_h = []
        for name, c, d in (("key_cache", key_cache, dqk), ("value_cache", value_cache, dv)):
            if c.dim() != 4 or c.shape[1] != hkv or c.shape[3] != d or c.stride(3) != 1:
                raise ValueError(f"{name} must be [num_blocks, {hkv}, block_size, {d}], got {list(c.shape)}")
            s0, s1 = c.stride(0), c.stride(1)
            if s1 <= 0 or s0 % s1 or s0 // s1 < hkv:
                raise ValueError(
                    f"{name} must be a view of [num_blocks, heads >= {hkv}, block_size, {d}+], got strides "
                    f"{c.stride()}"
                )
            page_h.append(s0 // s1)
        if getattr(key_cache, "device", None) != getattr(value_cache, "device", None):
            raise ValueError(f"key_cache is on {key_cache.device} but value_cache on {value_cache.device}")
        if page_h[0] != page_h[1]:
            raise ValueError(
                f"key_cache and value_cache must have the same heads per block, got strides "
                f"{key_cache.stride()} and {value_cache.stride()}"
            )
        self.hkv, self.dqk, self.dv = hkv, dqk, dv
        self.key_cache, self.value_cache = key_cache, value_cache
        self.n_pages = min(key_cache.shape[0], value_cache.shape[0]) * (hkv if headwise else 1)
        self.cache_strides = (
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(1),
            value_cache.stride(2),
        )
        self.quant = quant
        bs = key_cache.shape[2]
        self.scale_strides, qconsts = self._scales(key_scale, value_scale, quant, page_h[0], bs)
        if mult:
            qconsts["STATIC_MULT"] = True
        self.key_scale, self.value_scale = key_scale, value_scale
        self.consts = dict(
            HKV=hkv, BLOCK_HKV=triton.next_power_of_2(hkv), DQK=dqk, DV=dv,
            BLOCK_DQK=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(dv),
            BS=key_cache.shape[2], HEADWISE=bool(headwise), PAGE_H=page_h[0], num_warps=4, **qconsts,
        )  # fmt: skip
        dev = key_cache.device
        on_gpu = getattr(dev, "type", None) == "cuda" and is_torch(key_cache)
        index = (dev.index if dev.index is not None else 0) if on_gpu else None
        self.kernels = KernelCache(index if cached else None)
        self._consts = {e: dict(HAS_ERR=e, **self.consts) for e in (False, True)}
        self.ptrs = (key_cache.data_ptr(), value_cache.data_ptr())  # what a direct launch passes
        # an unquantized write reads no scale: the caches stand in for the pointers
        self.scale_ptrs = (key_scale.data_ptr(), value_scale.data_ptr()) if quant is not None else self.ptrs
        kp, vp, sk, sv = (*self.ptrs, *self.scale_ptrs)
        self.static_aligned = not ((kp | vp | sk | sv) & 15)

    @staticmethod
    def _scales(key_scale: Any, value_scale: Any, quant: Any, page_h: int, bs: int) -> tuple[tuple, dict]:
        """Scale strides ``(page, slot)`` of K and V and the format's compile-time switches. A dynamic
        format's scales ``[num_blocks, heads, block_size]`` must be numbered like the caches' pages
        (``page_h`` heads per block); static scales are contiguous ``[Hkv]`` or ``[Hkv * D]``."""
        if quant is None:
            return (0, 0, 0, 0), {}
        fmt = FMT_IDS.get(getattr(quant, "name", None))
        if fmt is None:
            raise ValueError(f"quant={quant!r}: expected one of the formats {', '.join(FMT_IDS)}")
        strides = []
        for name, sc in (("key_scale", key_scale), ("value_scale", value_scale)):
            if sc is None:
                raise ValueError(f"{name} is required for a {quant.name} cache, got None")
            st = tuple(sc.stride())
            if quant.dynamic:
                if sc.dim() != 3 or sc.shape[2] != bs or st[1] <= 0 or st[0] != page_h * st[1]:
                    raise ValueError(
                        f"{name} must be [num_blocks, heads, {bs}] with {page_h} heads per block like the "
                        f"caches, got shape {list(sc.shape)} strides {st}"
                    )
                strides += [st[1], st[2]]
            elif sc.dim() != 1 or st[0] != 1:
                raise ValueError(
                    f"{name} must be a contiguous 1-D tensor, got shape {list(sc.shape)} strides {st}"
                )
        return tuple(strides) if strides else (0, 0, 0, 0), dict(
            QFMT=fmt, PER_CHANNEL=bool(getattr(quant, "channel_wise", False))
        )

    def bind(
        self,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        """Point the plan at ``key_cache`` / ``value_cache`` (and a quantized cache's scales, the quant
        multipliers for a plan built with them): tensors equal to the ones it was built for in
        :func:`~.launch.direct.tensor_key`, or ``None`` to hold none between calls (a memoised plan)."""
        self.key_cache, self.value_cache = key_cache, value_cache
        self.key_scale, self.value_scale = key_scale, value_scale

    def run(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        batch_id_per_token: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens_decoder: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        errors: torch.Tensor | None = None,
        stream: int | None = None,
    ) -> None:
        """Write ``k [T, Hkv, Dqk]`` / ``v [T, Hkv, Dv]`` (this plan's heads and dims) for one step's
        metadata (as in :func:`write_kv_cache`). ``stream``: the current stream when the caller read
        it already (saves a lookup)."""
        step = fill_step(
            new_step(), cu_seqlens_q, seq_lens_decoder, block_tables, batch_id_per_token, None, None, errors
        )
        self.run_step(k, v, step, stream=stream)

    def run_step(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        step: LaunchStep,
        *,
        stream: int | None = None,
    ) -> None:
        """:meth:`run` on a step's :class:`~.launch.direct.LaunchStep` (with ``batch_id_per_token``), derived
        once per step and shared by every layer: ``k [T, Hkv, Dqk]`` / ``v [T, Hkv, Dv]`` with a
        contiguous last dim (``ValueError`` otherwise)."""
        ks, vs = k.stride(), v.stride()
        if len(ks) != 3 or len(vs) != 3:
            raise ValueError(f"k and v must be [T, Hkv, D], got shapes {list(k.shape)} and {list(v.shape)}")
        self._launch_step(k, v, ks, vs, k.shape[0], step, stream)

    def _launch_step(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        ks: tuple,
        vs: tuple,
        t: int,
        step: LaunchStep,
        stream: int | None,
    ) -> None:
        """:meth:`run_step` with ``k`` / ``v``'s strides ``ks`` / ``vs`` (3-D) and rows ``t`` read by the
        caller."""
        if ks[2] != 1 or vs[2] != 1:
            raise ValueError(f"k and v need a contiguous last dim, got strides {ks} and {vs}")
        if t == 0:
            return
        if step.bid is None:
            raise ValueError("a cache write's LaunchStep needs batch_id_per_token")
        cache = self.kernels
        key = None
        if cache.direct and step.direct_ok and self.static_aligned and k.is_cuda and v.is_cuda:
            kp, vp = k.data_ptr(), v.data_ptr()
            if not (kp | vp) & 15:  # else Triton's path: it specialises on alignment
                if stream is None:
                    stream = cache.stream()
                kdt, vdt = k.dtype, v.dtype
                if self.launch_kept(
                    kp, vp, ks, vs, kdt, vdt, t, step.num_reqs, step.stride_tbl, step.n_blk, step.ptrs,
                    step.bid_ptr, step.sig, stream,
                ):  # fmt: skip
                    return
                key = (ks[0], ks[1], vs[0], vs[1], kdt, vdt, step.sig)  # compiled and kept below
        hit = cache.kernel(key)
        sizes = (ks[0], ks[1], vs[0], vs[1], *self.cache_strides, step.stride_tbl, step.n_blk, self.n_pages)
        ptr_args = (
            k, v, self.key_cache, self.value_cache, step.bid, step.cu, step.dec, step.table, step.err_arg
        )  # fmt: skip
        ks_arg, vs_arg = (self.key_scale, self.value_scale)
        if self.quant is None:  # read by no branch of the kernel: any pointer
            ks_arg, vs_arg = self.key_cache, self.value_cache
        args = (*ptr_args, *sizes, step.num_reqs, ks_arg, vs_arg, *self.scale_strides)
        if hit is not None and not cache.addresses:
            hit((t,), args, stream)
        else:  # a kernel kept already launches by addresses
            cache.launch(_write_kv_kernel, key, (t,), args, self._consts[step.errors is not None], stream)

    def launch_kept(
        self, kp: int, vp: int, ks: Sequence[int], vs: Sequence[int], kdt: Any, vdt: Any, t: int,
        num_reqs: int, stride_tbl: int, n_blk: int, ptrs: tuple, bid_ptr: int, sig: tuple,
        stream: int | None,
    ) -> bool:  # fmt: skip
        """Launch the write by addresses if its kernel is compiled and kept (a kernel cache hit), else
        launch nothing and return ``False``. ``kp`` / ``vp``: addresses of ``k [T, Hkv, Dqk]`` / ``v [T,
        Hkv, Dv]`` (16-byte aligned, on the plan's GPU, contiguous last dims: the caller checked), ``ks``
        / ``vs`` their strides, ``kdt`` / ``vdt`` their dtypes as torch names them (the kernel's key),
        ``t`` their rows (> 0). The step as a direct-launch :class:`~.launch.direct.LaunchStep` with
        ``batch_id_per_token`` gives it: ``num_reqs``, ``stride_tbl``, ``n_blk``, ``ptrs``, ``bid_ptr``,
        ``sig`` (the one-shot wrapper reads them from its tensors, without a ``LaunchStep``). No tensor is
        read, so paddle tensors launch here as torch tensors do."""
        cache = self.kernels
        if not cache.addresses or sig[3] is None:  # no batch_id_per_token (its dtype)
            return False
        hit = cache.kernel((ks[0], ks[1], vs[0], vs[1], kdt, vdt, sig))
        if hit is None:
            return False
        kcp, vcp = self.ptrs
        p0, p1, p2, p3 = ptrs
        c0, c1, c2, c3 = self.cache_strides
        hit(
            (t,),
            (
                kp, vp, kcp, vcp, bid_ptr, p0, p1, p2, p3, ks[0], ks[1], vs[0], vs[1], c0, c1, c2, c3,
                stride_tbl, n_blk, self.n_pages, num_reqs, *self.scale_ptrs, *self.scale_strides,
            ),
            stream,
        )  # fmt: skip
        return True
