"""The kernels' device error flags read one step late: no host sync in the serving loop.

The triton backend's kernels record the first bad block-table entry of a step in a device flag
(``kernels/errors.py``: ``int32 [8]``, one per framework and device). Reading it is a device-to-host
copy, and a copy made while the step runs waits for the step's kernels. :class:`DeferredErrorCheck`
splits the read in two:

* :meth:`~DeferredErrorCheck.snapshot`, right after a step's launches (outside any CUDA graph
  capture): each flag is copied asynchronously into a host buffer allocated once (pinned on a GPU),
  queued on the launch stream behind the step's kernels. Nothing waits;
* :meth:`~DeferredErrorCheck.check`, one step later (``PaddleFleetForCausalLM.compute_logits`` of step
  N + 1): FastDeploy has by then synchronised step N's sampled tokens, which were queued after the
  copy, so the buffer holds step N's flag and reading it is a plain host read. Only when it shows an
  error is the device flag itself read (a sync, on the error path only) and a ``ValueError`` raised
  naming the request, logical block and value; the flag is cleared so serving may go on.

An error in the very last step before a server stops is reported only by an explicit
``backend.check_errors()``. Backends without error flags (``reference``: it checks every table on
the host before any read) make both calls no-ops.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

logger = logging.getLogger(__name__)


def _flags(backend: Any) -> list[Any]:
    """The backend's device error flags (``TritonBackend.error_flags``); none for other backends."""
    flags = getattr(backend, "error_flags", None)
    return list(flags()) if callable(flags) else []


def _capturing() -> bool:
    """Whether paddle is capturing a CUDA graph (a copy queued then would be replayed, never read)."""
    try:
        from paddle.base import core

        return bool(core.is_cuda_graph_capturing())
    except (ImportError, AttributeError):
        return False


class _HostCopy:
    """Two host buffers for one device flag, filled alternately by asynchronous copies."""

    def __init__(self, flag: Any) -> None:
        from ..kernels._framework import is_torch

        self.flag = flag
        self.torch = is_torch(flag)
        self.buffers: list[Any] = []
        if self.torch:
            import torch

            pin = bool(flag.is_cuda)
            self.buffers = [torch.zeros(flag.shape, dtype=flag.dtype, pin_memory=pin) for _ in range(2)]
        self.turn = 0

    def start(self) -> Any:
        """Queue a copy of the flag's current value; return the host tensor it lands in."""
        if not self.torch:  # paddle: an async copy to pinned memory (paddle's pinned allocator caches)
            import paddle

            if self.flag.place.is_gpu_place():
                return self.flag._copy_to(paddle.CUDAPinnedPlace(), False)
            return self.flag.clone()
        from ..kernels._framework import paddle_stream

        host = self.buffers[self.turn]
        self.turn ^= 1
        stream = paddle_stream(self.flag.device) if self.flag.is_cuda else contextlib.nullcontext()
        with stream:  # the stream the kernels ran on: the copy waits for them, the host does not
            host.copy_(self.flag, non_blocking=True)
        return host

    @staticmethod
    def values(host: Any) -> list[int]:
        """The host copy's ``[code, request, logical_block, value, kv_head, kernel, limit, 0]``."""
        return [int(x) for x in host.tolist()]


class DeferredErrorCheck:
    """Report a step's bad block-table entries at the next step's :meth:`check` (see module doc)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._copies: dict[int, _HostCopy] = {}  # id(flag) -> its host buffers
        self._latest: list[tuple[_HostCopy, Any]] = []  # snapshots of the last step
        self._previous: list[tuple[_HostCopy, Any]] = []  # of the step before: readable now

    def snapshot(self) -> None:
        """Queue an asynchronous host copy of every error flag (call after a step's launches)."""
        flags = _flags(self.backend)
        if not flags or _capturing():
            return
        taken = []
        for flag in flags:
            copy = self._copies.get(id(flag))
            if copy is None:
                copy = self._copies[id(flag)] = _HostCopy(flag)
            taken.append((copy, copy.start()))
        self._previous, self._latest = self._latest, taken

    def check(self) -> None:
        """Read the copies of the step before the last (landed: FastDeploy synchronised that step's
        output since). On an error, read the device flag itself and raise ``ValueError`` naming the
        first bad entry (request, logical block, value), clearing it; otherwise no sync at all."""
        from ..kernels.errors import check_kernel_errors, describe_kernel_error

        for copy, host in self._previous:
            values = copy.values(host)
            if values[0] == 0:
                continue
            self._previous, self._latest = [], []  # the same error is in the later copy too
            check_kernel_errors(copy.flag, reset=True)  # the device's current record, if still set
            raise ValueError(describe_kernel_error(values))
