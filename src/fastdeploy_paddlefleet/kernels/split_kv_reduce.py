"""Reduce step of split-KV (flash-decoding) decode: merge per-split partial results.

Each split ``s`` of a decode query's key range left a normalised output ``o_s`` and its base-2
log-sum-exp ``lse_s``. The merged output is ``sum_s 2^(lse_s - m) o_s / (sum_s 2^(lse_s - m) +
2^(sink - m))``: the sink (if any) joins here, once, as a logit with no value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

from ._framework import torch  # noqa: F401 - annotations (None without torch)


@triton.jit(do_not_specialize=["n_tok"])
def _split_kv_reduce_kernel(
    MidO, MidL, O, Sinks, CuQ, stride_ot, stride_oh, n_tok,
    HQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SINK_MODE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    q0 = tl.load(CuQ + b)
    if (tl.load(CuQ + b + 1) - q0 != 1) | (q0 < 0) | (q0 >= n_tok):  # not a decode row inside out
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    row = (b * HQ + h) * NUM_SPLITS + offs_s
    lse = tl.load(MidL + row, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINK_MODE == 1:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    elif SINK_MODE == 2:
        sink = 0.0
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # nothing visible and no sink: the output is 0
    wgt = tl.exp2(lse - m)
    den = tl.sum(wgt, 0)
    if SINK_MODE != 0:
        den += tl.exp2(sink - m)
    mask = (offs_s[:, None] < NUM_SPLITS) & (offs_d[None, :] < DV)
    o = tl.load(MidO + row[:, None] * DV + offs_d[None, :], mask=mask, other=0.0)
    o = tl.sum(wgt[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    o_ptr = O + q0.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=offs_d < DV)


def reduce_kept(
    hit: Any,
    mo: int,
    ml: int,
    op: int,
    sp: int,
    cp: int,
    ost: Sequence[int],
    t: int,
    bsz: int,
    hq: int,
    stream: int | None,
) -> None:
    """Launch the kept reduce kernel ``hit`` by addresses only: ``mid_o`` / ``mid_lse`` (``mo`` / ``ml``),
    out ``[T, Hq, Dv]`` (``op``, strides ``ost``, ``t`` rows), the sinks (any pointer when unused),
    cu_seqlens_q; one program per (request, q head) of ``bsz`` x ``hq``."""
    hit((bsz, hq), (mo, ml, op, sp, cp, ost[0], ost[1], t), stream)


def split_kv_reduce(
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    sinks: torch.Tensor | None,
    sink_mode: int,
    *,
    kernels: object = None,
    key: object = None,
    stream: int | None = None,
) -> None:
    """Merge ``mid_o [bsz, Hq, S, Dv]`` (fp32) / ``mid_lse [bsz, Hq, S]`` (base 2) into the rows of
    ``out [T, Hq, Dv]`` that belong to one-token requests. ``sink_mode``: 0 none, 1 ``sinks [Hq]``
    logits, 2 zero sink (off-by-one). ``kernels`` / ``key`` / ``stream``: a
    :class:`.launch.direct.KernelCache` and this call's key for a direct launch (``key`` must hold the split
    count and ``out``'s strides)."""
    bsz, hq, splits, dv = mid_o.shape
    sink_arg = sinks if sinks is not None else mid_o  # any pointer when unused
    hit = kernels.kernel(key) if kernels is not None and kernels.addresses else None
    if hit is not None:  # a kept kernel: addresses, no tensors (KernelCache.kernel)
        reduce_kept(
            hit, mid_o.data_ptr(), mid_lse.data_ptr(), out.data_ptr(), sink_arg.data_ptr(),
            cu_seqlens_q.data_ptr(), out.stride(), out.shape[0], bsz, hq, stream,
        )  # fmt: skip
        return
    args = (mid_o, mid_lse, out, sink_arg, cu_seqlens_q, out.stride(0), out.stride(1), out.shape[0])
    consts = dict(
        HQ=hq, DV=dv, BLOCK_DV=max(16, triton.next_power_of_2(dv)), NUM_SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), SINK_MODE=sink_mode, num_warps=4,
    )  # fmt: skip
    if kernels is None:
        _split_kv_reduce_kernel[(bsz, hq)](*args, **consts)
    else:
        kernels.launch(_split_kv_reduce_kernel, key, (bsz, hq), args, consts, stream)
