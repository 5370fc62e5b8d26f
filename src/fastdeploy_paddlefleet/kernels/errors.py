"""Device-side error flag of the kernels: the first bad block-table entry, recorded without a host sync.

Every kernel that reads a block / page table bounds-checks each entry it would dereference: an entry
``>= `` the cache's block (page) count, a negative entry (``-1`` = released or never allocated)
inside the keys a query can see, or a logical block past the table's width is never dereferenced
(the load is masked; that request's output may be garbage or zeros, memory stays safe). When the
launch is given an error flag, the first such entry (the first program to reach one wins an atomic
compare-and-swap on ``flag[0]``) is written into it::

    flag : int32 [8] = [code, request, logical_block, value, kv_head, kernel, limit, 0]

* ``code``: 0 clear; 1 page id past the cache (``value >= limit``); 2 negative page id inside the
  visible range; 3 logical block past the table's width (``value`` = the width);
* ``request``: index into ``cu_seqlens_q`` / ``block_tables``; ``kv_head``: -1 for a per-request
  block table, the kv head of a head-wise page table (row ``request * Hkv + kv_head``);
* ``kernel``: 1 cache write, 2 prefill (portable), 3 decode, 4 prefill (Hopper), 5 the dequantizing
  gather ahead of the Hopper prefill of a quantized cache (``kernels/kv_dequant_gather.py``);
* ``limit``: the cache's block count (per-request tables) or page count (head-wise tables).

The flag is an ordinary preallocated device tensor passed as a kernel argument, so launches stay
graph-capturable (nothing is read on the host during launch). :func:`check_kernel_errors` reads it
(one device-to-host copy: call it where the step is synchronised anyway, or every N steps through
:class:`KernelErrorMonitor`) and raises a ``ValueError`` naming the entry; :func:`reset_kernel_errors`
clears it.
"""

from __future__ import annotations

import logging
from typing import Any

import triton
import triton.language as tl

logger = logging.getLogger(__name__)

FLAG_SIZE = 8
#: ``flag[5]`` values
KERNEL_NAMES = {
    1: "cache write",
    2: "prefill attention",
    3: "decode attention",
    4: "Hopper prefill attention",
    5: "dequantizing gather (Hopper prefill of a quantized cache)",
}
KERNEL_CACHE_WRITE = tl.constexpr(1)  # kernel ids as kernels pass them (compile-time constants)
KERNEL_PREFILL = tl.constexpr(2)
KERNEL_DECODE = tl.constexpr(3)
KERNEL_HOPPER_PREFILL = tl.constexpr(4)
KERNEL_DEQUANT_GATHER = tl.constexpr(5)
#: ``flag[0]`` values
CODE_PAST_CACHE, CODE_NEGATIVE, CODE_PAST_TABLE = 1, 2, 3


@triton.jit
def record_bad_entry(Err, code, order, blk, val, head, req, limit, KERNEL: tl.constexpr):
    """Record the entry with the smallest ``order`` among those whose ``code`` is set (``code``,
    ``order``, ``blk``, ``val``, ``head``: vectors of one shape; 0 = fine), unless a bad entry was
    recorded already: the first compare-and-swap on ``Err[0]`` wins."""
    if tl.max(code, 0) > 0:
        first = tl.min(tl.where(code > 0, order, 2147483647), 0)
        sel = (code > 0) & (order == first)
        c = tl.max(tl.where(sel, code, 0), 0)
        if tl.atomic_cas(Err, 0, c) == 0:  # stores cast to the flag's int32
            tl.store(Err + 1, req)
            tl.store(Err + 2, tl.max(tl.where(sel, blk, -2147483648), 0))
            tl.store(Err + 3, tl.max(tl.where(sel, val, -2147483648), 0))
            tl.store(Err + 4, tl.max(tl.where(sel, head, -2147483648), 0))
            tl.store(Err + 5, KERNEL)
            tl.store(Err + 6, limit)


@triton.jit
def check_entries(
    Err, raw, blk, n_blk, need, limit, req, head, order, KERNEL: tl.constexpr, HAS_ERR: tl.constexpr
):
    """Which table entries ``raw`` (of logical blocks ``blk``; vectors) may be dereferenced:
    ``0 <= raw < limit`` and ``blk < n_blk``. With ``HAS_ERR``, the one of smallest ``order`` that may
    not but is ``need``-ed (the keys some query sees) is recorded in ``Err`` with its kv ``head``
    (-1 for per-request tables)."""
    good = (raw >= 0) & (raw < limit) & (blk < n_blk)
    if HAS_ERR:
        code = tl.where(blk >= n_blk, 3, tl.where(raw < 0, 2, 1))
        code = tl.where(need & (good == 0), code, 0)
        val = tl.where(blk >= n_blk, n_blk + blk * 0, raw)
        record_bad_entry(Err, code, order, blk, val, head, req, limit, KERNEL)
    return good


def new_error_flag(like: Any) -> Any:
    """A cleared ``int32 [8]`` error flag on ``like``'s device and framework (torch or paddle). Allocate
    it once, before any CUDA graph capture, and pass it to every launch."""
    from ._framework import empty

    flag = empty((FLAG_SIZE,), "int32", like)
    reset_kernel_errors(flag)
    return flag


def _host_values(flag: Any) -> list[int]:
    from ._framework import is_torch

    if is_torch(flag):
        return [int(x) for x in flag.detach().cpu().tolist()]
    return [int(x) for x in flag.numpy().tolist()]


def describe_kernel_error(values: list[int]) -> str | None:
    """The message for a flag's host values (``None`` when clear)."""
    code, req, blk, val, head, kernel, limit = values[:7]
    if code == 0:
        return None
    where = f"request {req}" + (f" kv head {head}" if head >= 0 else "")
    table = "page table" if head >= 0 else "block table"
    what = {
        CODE_PAST_CACHE: f"entry {val} is past the cache ({limit} {'pages' if head >= 0 else 'blocks'})",
        CODE_NEGATIVE: f"entry {val} is negative (absent or released) but the block is visible",
        CODE_PAST_TABLE: f"the table has only {val} columns but the block is needed",
    }.get(code, f"unknown error code {code} (value {val})")
    name = KERNEL_NAMES.get(kernel, f"kernel {kernel}")
    return (
        f"bad {table} entry in the {name} kernel: {where}, logical block {blk}: {what}; the entry was not "
        f"dereferenced (that request's output is invalid)"
    )


def check_kernel_errors(flag: Any, *, reset: bool = False) -> None:
    """Read ``flag`` (one device-to-host copy: a sync) and raise ``ValueError`` naming the first bad
    table entry (request, logical block, value) if one was recorded. ``reset=True`` clears the flag
    before raising, so serving can go on after reporting it."""
    if flag is None:
        return
    values = _host_values(flag)
    msg = describe_kernel_error(values)
    if msg is None:
        return
    if reset:
        reset_kernel_errors(flag)
    raise ValueError(msg)


def reset_kernel_errors(flag: Any) -> None:
    """Clear ``flag`` in place (an asynchronous device memset; capturable)."""
    if hasattr(flag, "zero_"):
        flag.zero_()
    else:  # paddle builds without Tensor.zero_
        flag.fill_(0)


class KernelErrorMonitor:
    """Holds one error flag and checks it every ``every`` steps (``every=1``: each step).

    ``flag`` is passed to every launch of a step; call :meth:`step` once per step at a point where
    the host waits for the step anyway (after its output is synchronised): it costs nothing but on
    every ``every``-th step, where it reads the flag (one sync) and raises the named ``ValueError``.
    ``every=0`` never checks on its own (call :meth:`check`)."""

    def __init__(self, flag: Any, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ValueError(f"every must be an int >= 0, got {every!r}")
        self.flag = flag
        self.every = every
        self.steps = 0

    def step(self) -> None:
        """Count a step; on every ``every``-th, :meth:`check`."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad entry recorded since the last reset (and clear
        it, so the next error is reported too)."""
        check_kernel_errors(self.flag, reset=True)

    def reset(self) -> None:
        reset_kernel_errors(self.flag)


__all__ = [
    "FLAG_SIZE",
    "KERNEL_NAMES",
    "KernelErrorMonitor",
    "check_kernel_errors",
    "describe_kernel_error",
    "new_error_flag",
    "record_bad_entry",
    "reset_kernel_errors",
    "check_entries",
]
