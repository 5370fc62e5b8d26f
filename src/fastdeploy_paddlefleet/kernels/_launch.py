"""Launching compiled Triton kernels without Triton's per-call argument binding (issue 20).

``kernel[grid](*args, **constexprs)`` costs ~20 us of host time on an H200's host for a kernel of 40
arguments (benchmarks/NOTES.md): Triton binds every argument, derives its specialisation (dtype,
16-byte alignment, ``== 1`` / divisible by 16), hashes the key and looks the kernel up. The compiled
kernel's own launcher (``CompiledKernel.run``) takes 6.5 us for the same call.

:class:`KernelCache` keeps the compiled kernels of *one* launch plan (one layer's static setup:
caches, dims, tile shapes) under a key the plan computes from what can change between its calls:
tensor dtypes are fixed by the plan; the strides it reads per call are in the key; every integer that
changes per step (token and request counts, table widths) is ``do_not_specialize`` in the kernels;
and the key holds one bit for "every pointer 16-byte aligned". The first call with a key goes through
Triton's normal path (compiling if needed) and keeps the returned kernel; later calls launch it
directly. The normal path is always taken under the interpreter, off torch, while Triton's launch
hooks (profilers) are set, and unless :data:`DIRECT_LAUNCH` is set.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


#: Off by default: direct launches are exercised on CPU with fakes (tests/test_launch_cost.py) but were
#: not yet run on a GPU (the session's device time ran out; benchmarks/NOTES.md). Set True to opt in:
#: the ``gpu`` tests of tests/test_launch_cost.py do, and check them bitwise against Triton's path.
DIRECT_LAUNCH = False


def _no_hooks(hook: Any) -> bool:
    """Whether a launch hook is unset: ``None``, or (Triton 3.6) an empty ``HookChain``."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _direct_ok() -> bool:
    if not DIRECT_LAUNCH or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton import knobs

        return _no_hooks(knobs.runtime.launch_enter_hook) and _no_hooks(knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):  # an older triton: no direct launches
        return False


class KernelCache:
    """Compiled kernels of one launch plan, launched directly after their first call.

    ``launch(fn, key, grid, args, consts, stream)``: ``args`` are ``fn``'s leading (runtime)
    arguments in order, ``consts`` its remaining parameters by name (constexprs and launch options
    ``num_warps`` / ``num_stages``), ``key`` everything about this call that can change the compiled
    kernel beyond ``fn`` and the plan's static setup."""

    def __init__(self, device_index: int | None) -> None:
        self.device_index = device_index
        self.direct = device_index is not None and _direct_ok()
        self._kernels: dict[Any, tuple[Any, tuple]] = {}
        self._get_stream = None

    def stream(self) -> int:
        """The current CUDA stream of the plan's device, as Triton's launcher takes it."""
        if self._get_stream is None:  # the active driver's method, resolved once (a lazy proxy)
            from triton.runtime import driver

            self._get_stream = driver.active.get_current_stream
        return self._get_stream(self.device_index)

    def launch(self, fn: Any, key: Any, grid: tuple, args: tuple, consts: dict, stream: int | None) -> None:
        direct = self.direct and key is not None
        hit = self._kernels.get(key) if direct else None
        if hit is None:
            kernel = fn[grid](*args, **consts)
            if direct and kernel is not None and hasattr(kernel, "packed_metadata"):
                names = fn.arg_names[len(args) :]
                tail = tuple(
                    consts.get(n, p.default) for n, p in zip(names, fn.params[len(args) :], strict=True)
                )
                self._kernels[key] = (kernel, tail)
            return
        kernel, tail = hit
        g = grid + (1, 1)
        kernel.run(
            g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail
        )

    def __len__(self) -> int:
        return len(self._kernels)


__all__ = ["KernelCache"]
