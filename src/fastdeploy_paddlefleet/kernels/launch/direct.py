"""Launching compiled Triton kernels without Triton's per-call argument binding (issue 20).

``kernel[grid](*args, **constexprs)`` costs ~20 us of host time on an H200's host for a kernel of 40
arguments (benchmarks/NOTES.md): Triton binds every argument, derives its specialisation (dtype,
16-byte alignment, ``== 1`` / divisible by 16), hashes the key and looks the kernel up. The compiled
kernel's own launcher (``CompiledKernel.run``) takes ~6 us for the same call.

:class:`KernelCache` keeps the compiled kernels of *one* launch plan (one layer's static setup:
caches, dims, tile shapes) under a key the plan computes from what can change between its calls:
tensor dtypes are fixed by the plan or in the key; the strides it reads per call are in the key; every
integer that changes per step (token and request counts, table widths) is ``do_not_specialize`` in
the kernels; and a call whose pointers are not all 16-byte aligned gets no key (Triton's path). The
first call with a key goes through Triton's normal path (compiling if needed) and keeps the returned
kernel; later calls launch it directly. On by default (``FDFLEET_DIRECT_LAUNCH``, or
:data:`DIRECT_LAUNCH` set by tests and benchmarks): on the H200 the direct launches ran bitwise equal
to Triton's own path (decode, mixed batches, head-wise windows; tests/test_launch_cost.py). The normal
path is always taken under the interpreter, off torch, and while Triton's launch hooks (profilers)
are set when the plan is built.

A kept kernel launches through our own launcher (:mod:`.own_launcher`: one struct pack, one
``cuLaunchKernel``, descriptors encoded once) where it reproduces Triton's launch exactly, else through
the compiled kernel's own launcher; ``FDFLEET_OWN_LAUNCHER`` (default on) or :data:`OWN_LAUNCHER`.

:class:`LaunchStep`: one step's metadata as every launch of the step takes it (request and table
sizes, dtypes, alignment), derived once and shared by the layers that read the same table.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from typing import Any

from ... import envs
from .. import _framework
from .._framework import is_torch

logger = logging.getLogger(__name__)


#: ``None``: ``FDFLEET_DIRECT_LAUNCH`` decides (default on). ``True`` / ``False`` override it (tests,
#: ``benchmarks/attention.py --no-direct-launch``). Read when a plan is built.
DIRECT_LAUNCH: bool | None = None

#: direct launches pass pointers as addresses (a kept kernel, :meth:`KernelCache.kernel`); False: the tensors
#: (``benchmarks/attention.py --tensor-args``: an A/B of the launcher's per-pointer cost). Read when a
#: plan is built.
ADDRESS_ARGS = True


#: ``None``: ``FDFLEET_OWN_LAUNCHER`` decides (default on; the benchmark's A/B sets it off). ``True`` /
#: ``False`` override it (tests). Read when a plan is built.
OWN_LAUNCHER: bool | None = None


def own_wanted() -> bool:
    """Whether kept kernels launch through :mod:`.own_launcher`: :data:`OWN_LAUNCHER`, else
    ``FDFLEET_OWN_LAUNCHER``."""
    if OWN_LAUNCHER is not None:
        return bool(OWN_LAUNCHER)
    return envs.own_launcher()


def direct_wanted() -> bool:
    """Whether direct launches are asked for: :data:`DIRECT_LAUNCH`, else ``FDFLEET_DIRECT_LAUNCH``."""
    if DIRECT_LAUNCH is not None:
        return bool(DIRECT_LAUNCH)
    return envs.direct_launch()


def _no_hooks(hook: Any) -> bool:
    """Whether a launch hook is unset: ``None``, or (Triton 3.6) an empty ``HookChain``."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _direct_ok() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not direct_wanted():
        return False
    try:
        from triton import knobs

        return _no_hooks(knobs.runtime.launch_enter_hook) and _no_hooks(knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):  # an older triton: no direct launches
        return False


class TritonHit:
    """A kept kernel launched through its compiled Triton launcher: ``hit(grid, args, stream)`` passes
    the grid padded to 3-D, the stream, the function handle, the packed metadata, no launch metadata or
    hooks, then ``args`` and the kernel's trailing parameters (``tail``: constexprs included)."""

    __slots__ = ("function", "packed", "run", "tail")

    def __init__(self, run: Any, function: Any, packed: Any, tail: tuple) -> None:
        self.run, self.function, self.packed, self.tail = run, function, packed, tail

    def __call__(self, grid: tuple, args: tuple, stream: int | None) -> None:
        n = len(grid)
        run, function, packed, tail = self.run, self.function, self.packed, self.tail
        if n == 1:
            run(grid[0], 1, 1, stream, function, packed, None, None, None, *args, *tail)
        elif n == 2:
            run(grid[0], grid[1], 1, stream, function, packed, None, None, None, *args, *tail)
        else:
            run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *args, *tail)


class KernelCache:
    """Compiled kernels of one launch plan, launched directly after their first call.

    ``launch(fn, key, grid, args, consts, stream)``: ``args`` are ``fn``'s leading (runtime)
    arguments in order, ``consts`` its remaining parameters by name (constexprs and launch options
    ``num_warps`` / ``num_stages``), ``key`` everything about this call that can change the compiled
    kernel beyond ``fn`` and the plan's static setup (``None``: Triton's path, nothing kept). A plan
    that builds its arguments itself asks :meth:`kernel` first and, on a hit, calls it with addresses
    (no constexprs needed): a tensor costs the compiled launcher a ``data_ptr()`` call and a driver query
    (``cuPointerGetAttribute``) per pointer, and our launcher takes pointers as ints only. A hit is a
    callable ``hit(grid, args, stream)``: an :class:`.own_launcher.OwnLauncher` (:attr:`own`) or a
    :class:`TritonHit` (the compiled kernel's own launcher)."""

    __slots__ = ("_get_stream", "_kernels", "addresses", "device_index", "direct", "own")

    def __init__(self, device_index: int | None) -> None:
        self.device_index = device_index
        self.direct = device_index is not None and _direct_ok()
        #: direct launches pass pointers as addresses (:data:`ADDRESS_ARGS` when built)
        self.addresses = ADDRESS_ARGS
        #: kept kernels launch through :mod:`.own_launcher` where it reproduces them (:func:`own_wanted`).
        #: Only with addresses: its one-struct pack would take a one-element integer tensor passed for a
        #: pointer as its *value* (``__index__``), where Triton's launcher asks for its ``data_ptr()``
        self.own = self.direct and self.addresses and own_wanted()
        self._kernels: dict[Any, Any] = {}  # key -> OwnLauncher or TritonHit
        self._get_stream = None

    def stream(self) -> int:
        """The current CUDA stream of the plan's device, as Triton's launcher takes it."""
        if self._get_stream is None:  # the active driver's method, resolved once (a lazy proxy)
            from triton.runtime import driver

            self._get_stream = driver.active.get_current_stream
        return self._get_stream(self.device_index)

    def kernel(self, key: Any) -> tuple | None:
        """The kernel kept for ``key`` (``None``: none yet, or no key): ``hit(grid, args, stream)``."""
        return None if key is None else self._kernels.get(key)

    def launch(self, fn: Any, key: Any, grid: tuple, args: tuple, consts: dict, stream: int | None) -> None:
        """Launch ``fn``: directly if a kernel is kept for ``key``, else through Triton (compiling if
        needed), keeping the kernel when there is a key. ``args`` are tensors here (Triton specialises
        on them on its path); a kept kernel gets their addresses (our launcher reads a one-element
        integer tensor through ``__index__`` as its value)."""
        hit = self._kernels.get(key) if key is not None and self.direct else None
        if hit is not None:
            hit(grid, tuple(a.data_ptr() if hasattr(a, "data_ptr") else a for a in args), stream)
            return
        kernel = fn[grid](*args, **consts)
        if key is not None and self.direct and kernel is not None and hasattr(kernel, "packed_metadata"):
            names = fn.arg_names[len(args) :]
            tail = tuple(consts.get(n, p.default) for n, p in zip(names, fn.params[len(args) :], strict=True))
            run = kernel.run  # (loads the kernel if needed: its function handle is set after)
            hit = None
            if self.own:
                from .own_launcher import own_launcher

                try:
                    hit = own_launcher(kernel, len(args), tail, self.device_index)
                except (AttributeError, TypeError, ValueError, OSError) as e:  # keep serving: Triton's
                    logger.warning("own launcher failed to build for %s: %r", getattr(kernel, "name", fn), e)
            self._kernels[key] = hit or TritonHit(run, kernel.function, kernel.packed_metadata, tail)

    def __len__(self) -> int:
        return len(self._kernels)


class LaunchStep:
    """One step's metadata as the kernels take it: ``cu_seqlens_q [bsz + 1]``, ``seq_lens_decoder
    [bsz]``, ``block_tables [rows, width]`` and (cache writes) ``batch_id_per_token [T]``, integer
    tensors on the kernels' device, the host maxima ``max_q_len`` / ``max_context_len`` (or ``None``),
    and the device error flag ``errors`` (``int32 [8]``, ``kernels/errors.py``; ``None``: no flag).
    Derived once per step (sizes, strides, dtypes for a direct launch's key, addresses, whether every
    tensor is on a GPU and 16-byte aligned) and shared by every launch that reads the same table."""

    __slots__ = (
        "bid",
        "bid_ptr",
        "cu",
        "dec",
        "direct_ok",
        "err_arg",
        "errors",
        "max_context_len",
        "max_q_len",
        "n_blk",
        "num_reqs",
        "ptrs",
        "sig",
        "stride_tbl",
        "table",
    )

    def __init__(
        self,
        cu_seqlens_q: Any,
        seq_lens_decoder: Any,
        block_tables: Any,
        batch_id_per_token: Any = None,
        *,
        max_q_len: int | None = None,
        max_context_len: int | None = None,
        errors: Any = None,
    ) -> None:
        args = (cu_seqlens_q, seq_lens_decoder, block_tables, batch_id_per_token, max_q_len, max_context_len)
        fill_step(self, *args, errors)


def step_values(
    cu_seqlens_q: Any, seq_lens_decoder: Any, block_tables: Any, batch_id_per_token: Any, errors: Any
) -> tuple:
    """What a direct launch takes from a step's tensors: ``(num_reqs, n_blk, stride_tbl, ptrs, bid_ptr,
    sig, direct_ok)`` (:class:`LaunchStep`'s fields of those names). The one-shot wrappers' kept lanes
    launch from these values without building a :class:`LaunchStep`; :func:`fill_step` stores them."""
    st = block_tables.stride()
    if len(st) != 2:
        raise ValueError(f"block_tables must be 2-D, got shape {list(block_tables.shape)}")
    err = errors if errors is not None else block_tables  # any pointer when there is no flag
    p0 = cu_seqlens_q.data_ptr()
    p1 = seq_lens_decoder.data_ptr()
    p2 = block_tables.data_ptr()
    p3 = err.data_ptr()
    if batch_id_per_token is None:
        bp = 0
        bid_dtype = None
    else:
        bp = batch_id_per_token.data_ptr()
        bid_dtype = batch_id_per_token.dtype
    # every tensor on a GPU; an AttributeError: a tensor without ``is_cuda`` (paddle tensors, never
    # launched directly, may lack it), not on a GPU (``getattr(x, "is_cuda", False)`` costs more)
    try:
        on_gpu = (
            cu_seqlens_q.is_cuda is True
            and seq_lens_decoder.is_cuda is True
            and block_tables.is_cuda is True
            and err.is_cuda is True
            and (batch_id_per_token is None or batch_id_per_token.is_cuda is True)
        )
    except AttributeError:
        on_gpu = False
    # sig: the metadata's part of a direct launch's key (Triton compiles per pointer dtype; the flag
    # switches the error recording on); direct_ok: every tensor on a GPU and 16-byte aligned
    sig = (cu_seqlens_q.dtype, seq_lens_decoder.dtype, block_tables.dtype, bid_dtype, errors is not None)
    direct_ok = on_gpu and not (p0 | p1 | p2 | p3 | bp) & 15
    return cu_seqlens_q.shape[0] - 1, block_tables.shape[1], st[0], (p0, p1, p2, p3), bp, sig, direct_ok


def fill_step(
    s: LaunchStep,
    cu_seqlens_q: Any,
    seq_lens_decoder: Any,
    block_tables: Any,
    batch_id_per_token: Any,
    max_q_len: int | None,
    max_context_len: int | None,
    errors: Any,
    values: tuple | None = None,
) -> LaunchStep:
    """Derive :class:`LaunchStep` ``s``'s fields (its constructor's arguments, by position) and return it;
    ``values``: :func:`step_values` of the same tensors when the caller has them already. The one-shot
    wrappers build their step per call as ``fill_step(new_step(), ...)``: a class call with keywords
    costs ~0.3 us more (its keyword binding and ``__init__``'s frame)."""
    if values is None:
        values = step_values(cu_seqlens_q, seq_lens_decoder, block_tables, batch_id_per_token, errors)
    s.num_reqs, s.n_blk, s.stride_tbl, s.ptrs, s.bid_ptr, s.sig, s.direct_ok = values
    s.cu = cu_seqlens_q
    s.dec = seq_lens_decoder
    s.table = block_tables
    s.bid = batch_id_per_token
    s.errors = errors
    s.err_arg = errors if errors is not None else block_tables  # any pointer when there is no flag
    s.max_q_len = max_q_len
    s.max_context_len = max_context_len
    return s


#: ``new_step()``: an empty :class:`LaunchStep` for :func:`fill_step` (no ``__init__``; a C call)
new_step = functools.partial(object.__new__, LaunchStep)


def tensor_version(x: Any) -> int:
    """In-place modification counter of a torch / paddle tensor (-1 for None or unknown)."""
    if x is None:
        return -1
    v = getattr(x, "_version", None)
    if isinstance(v, int):
        return v
    f = getattr(x, "_inplace_version", None)
    return int(f()) if callable(f) else -1


def tensor_key(x: Any) -> tuple:
    """What a launch plan may derive from tensor ``x`` (not its contents): address, shape, strides,
    dtype and device. Two live tensors with equal keys are the same memory read the same way."""
    if is_torch(x):
        return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, str(getattr(x, "place", None)))


_read_switches = envs.raw_reader(
    "FDFLEET_PREFILL_KERNEL", "FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER", "FDFLEET_DECODE_KEY_ROWS"
)


_TORCH_TENSOR = _framework.torch.Tensor if _framework.torch is not None else None  # exact type, inline keys


def caches_key(kc: Any, vc: Any) -> tuple:
    """:func:`tensor_key` of both caches of a one-shot call, read inline for plain torch tensors (the
    wrappers' memo keys: a call per field costs more than the rest of the key)."""
    if type(kc) is _TORCH_TENSOR and type(vc) is _TORCH_TENSOR:
        return (
            kc.data_ptr(), kc.shape, kc.stride(), kc.dtype, kc.device,
            vc.data_ptr(), vc.shape, vc.stride(), vc.dtype, vc.device,
        )  # fmt: skip
    return (tensor_key(kc), tensor_key(vc))  # paddle (list shapes), torch subclasses


def switches_key() -> tuple:
    """What a plan reads from the environment and this module when it is built (``FDFLEET_PREFILL_KERNEL``,
    ``FDFLEET_DECODE_KEY_ROWS``, direct launches, addresses), unparsed: part of a memoised plan's key, so
    a changed switch builds (and parses) anew."""
    return (DIRECT_LAUNCH, ADDRESS_ARGS, OWN_LAUNCHER, _read_switches())


class PlanMemo:
    """The launch plans of a one-shot wrapper (``paged_attention``, ``write_kv_cache``) for its last
    ``size`` distinct setups, by a key of everything a plan derives from (:func:`tensor_key` of the
    caches, dims, scalars, flags), so eager calls with the same caches reuse one plan and its compiled
    kernels (direct launches) instead of deriving them again.

    A plan is *taken* out for a call and *given* back after it (two threads never share one: a slot's
    idle plans are a list, taken by one atomic ``pop``), and the wrapper unbinds the caller's caches
    before giving it back: the memo keeps no cache alive. Each key has a slot ``[keep, idle plans, last
    use, in the memo]``: ``keep`` holds what must outlive the plan for its key to stay unique (e.g. a
    sinks tensor keyed by ``id``). A call like the last one is found by comparing keys, any other by
    one hash; a plan goes back to its slot without a lookup; past ``size`` keys the least recently
    taken is dropped."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._plans: dict[Any, list] = {}
        self._clock = itertools.count()
        #: ``(key, slot)`` of the last take that found a plan: a repeated call compares its key with
        #: that one (~0.3 us) before hashing it for the dict (another ~0.3 us plus the compare)
        self._last: tuple = (None, None)

    def take(self, key: Any) -> tuple[Any, Any]:
        """``(plan, slot)``: a plan kept under ``key`` (out of the memo until :meth:`give`) and its slot,
        or ``(None, None)``. ``TypeError`` if ``key`` holds an unhashable argument (the wrapper then
        builds a plan and keeps none)."""
        last_key, slot = self._last
        if last_key == key and slot[3]:  # that slot, still in the memo (_last stays: an equal key)
            try:
                plan = slot[1].pop()
            except IndexError:  # its plan is out (another thread's call)
                return None, None
            slot[2] = next(self._clock)
            return plan, slot
        slot = self._plans.get(key)
        if slot is None:
            return None, None
        try:
            plan = slot[1].pop()
        except IndexError:
            return None, None
        slot[2] = next(self._clock)
        self._last = (key, slot)
        return plan, slot

    def give(self, key: Any, plan: Any, keep: Any = None, slot: Any = None) -> None:
        """Keep ``plan`` under ``key``: back into ``slot`` (what :meth:`take` returned), or a new slot
        (dropping the least recently taken past ``size``)."""
        if slot is not None:
            slot[1].append(plan)
            return
        plans = self._plans
        old = plans.get(key)
        if old is not None:  # replaced (a plan built while this key's was out)
            old[3] = False
        plans[key] = [keep, [plan], next(self._clock), True]
        while len(plans) > self.size:
            oldest = min(plans, key=lambda k: plans[k][2])
            plans.pop(oldest)[3] = False

    def plans(self) -> list:
        """The idle plans, least recently taken first (tests)."""
        return [p for slot in sorted(self._plans.values(), key=lambda s: s[2]) for p in slot[1]]

    def clear(self) -> None:
        for slot in self._plans.values():
            slot[3] = False
        self._plans.clear()
        self._last = (None, None)

    def __len__(self) -> int:
        return len(self._plans)


__all__ = [
    "DIRECT_LAUNCH",
    "KernelCache",
    "LaunchStep",
    "PlanMemo",
    "TritonHit",
    "OWN_LAUNCHER",
    "direct_wanted",
    "fill_step",
    "new_step",
    "step_values",
    "own_wanted",
    "caches_key",
    "switches_key",
    "tensor_key",
    "tensor_version",
]
