"""The Triton backend: this step's K/V into the paged cache, then paged attention (``kernels/``).

Same contract as the reference backend (``backends/base.py``); the caches may be strided views of
FastDeploy's one cache shape (``serving/cache_views.py``), read in place. Tensors meet the kernels
the way FastDeploy runs Triton on paddle tensors (``kernels/_framework.py``):

* torch tensors go straight to the kernels;
* paddle tensors with torch installed cross by DLPack (zero-copy, so cache writes land in the
  caller's cache) and the kernels launch on *Paddle's* current CUDA stream (ordered with Paddle's
  work, recorded by a CUDA graph Paddle captures); the output goes back to paddle;
* paddle tensors without torch (a FastDeploy deployment) go straight to the kernels, with Triton
  on Paddle's torch proxy (``paddle.enable_compat(scope={"triton"})``).

Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (tests, torch tensors).

Host synchronisation: ``validate=True`` checks every call's shapes and, with ``host_checks``, the
metadata's contents through a host copy (once per step). The host copy is skipped while a CUDA
graph is being captured, and ``host_checks=False`` (set by the model under FastDeploy) skips it
always: the launch bounds then come from ``meta.max_seq_len_this_time`` when known and from the
tensors' shapes otherwise, never from the step's values.

Bad tables (served mode): whatever the metadata, the kernels never read or write outside the caches
they are given. A block-table entry that is negative inside the keys a query sees, past the cache, or
a table narrower than a request's context is never dereferenced; the first such entry is recorded in
a device-side error flag (``kernels/errors.py``; one ``int32 [8]`` tensor per device, owned by the
backend, passed to every launch; no host sync, CUDA-graph capturable). The serving path reads it
where the step is synchronised anyway:

* ``backend.step_done()`` once per step after the step's output has been synchronised (e.g. after
  the sampled tokens are copied to the host): it counts steps and, every ``check_every`` steps
  (default 1; 0 = never on its own), reads the flag (one small device-to-host copy) and raises a
  ``ValueError`` naming the request, logical block and bad value, clearing the flag;
* ``backend.check_errors()`` reads and raises at once (e.g. at the end of a request, in tests);
* ``PaddleFleetForCausalLM`` (under FastDeploy) reads ``backend.error_flags()`` one step late, through
  an asynchronous host copy (``backends/deferred_errors.py``): no sync in the serving loop.

Create the flag before capturing a CUDA graph (``backend.error_flag(tensor_on_device)``, or any eager
call such as the warm-up run): a flag first allocated inside a capture would be cleared by every
replay.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from ..plan.layer import LayerAttention
from .base import AttentionBackend, BatchMeta

logger = logging.getLogger(__name__)

_DTYPES = ("float16", "bfloat16", "float32")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _to_torch(x: Any, device: Any = None, int32: bool = False) -> Any:
    """Torch view of a paddle / torch tensor (DLPack, zero-copy); numpy or lists are copied."""
    import torch

    if x is None:
        return None
    if not _is_torch(x):
        if hasattr(x, "__dlpack__") and type(x).__module__.startswith("paddle"):
            x = torch.from_dlpack(x)
        else:
            x = torch.as_tensor(x)
    if device is not None and x.device != device:
        x = x.to(device)
    if int32 and x.dtype != torch.int32:
        x = x.to(torch.int32)
    return x


def _to_paddle(x: Any) -> Any:
    import paddle

    return paddle.utils.dlpack.from_dlpack(x)


def _paddle_int32(x: Any) -> Any:
    """A paddle int32 tensor (a no-op when it is one)."""
    import paddle

    if x is None:
        return None
    if not isinstance(x, paddle.Tensor):
        x = paddle.to_tensor(x)
    return x if str(x.dtype).endswith("int32") else x.astype("int32")


def _capturing(x: Any) -> bool:
    """Whether a CUDA graph is being captured on the stream ``x``'s framework launches on."""
    if getattr(getattr(x, "device", None), "type", None) != "cuda" and not getattr(x, "is_cuda", False):
        return False
    if _is_torch(x):
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
    try:
        from paddle.base import core

        return bool(core.is_cuda_graph_capturing())
    except (ImportError, AttributeError):
        return False


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of :mod:`fastdeploy_paddlefleet.kernels`.

    ``validate=True`` runs :func:`backends.checks.validate_inputs` on every call; its host copy of the
    metadata (once per step, shared by every layer) only with ``host_checks`` and outside CUDA
    graph capture.
    """

    name = "triton"
    supports_unequal_v_dim = True

    def __init__(self, validate: bool = True, host_checks: bool = True, check_every: int = 1) -> None:
        self.validate = validate
        #: copy the metadata to the host to check its contents (off under FastDeploy: no host sync)
        self.host_checks = host_checks
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0, got {check_every!r}")
        #: :meth:`step_done` reads the device error flags every this many steps (0: never)
        self.check_every = check_every
        self._monitors: dict[Any, Any] = {}  # (framework, device) -> KernelErrorMonitor

    def error_flag(self, like: Any) -> Any:
        """The device error flag (``int32 [8]``, ``kernels/errors.py``) for ``like``'s framework and
        device, created on first use: call once before capturing a CUDA graph."""
        key = (type(like).__module__.split(".", 1)[0], str(getattr(like, "device", None)))
        mon = self._monitors.get(key)
        if mon is None:
            from ..kernels.errors import KernelErrorMonitor, new_error_flag

            mon = self._monitors[key] = KernelErrorMonitor(new_error_flag(like), every=self.check_every)
        return mon.flag

    def step_done(self) -> None:
        """Count a step; every ``check_every`` steps read the error flags (one small device-to-host copy
        each: call it where the step's output is synchronised anyway) and raise ``ValueError`` naming
        the first bad block-table entry (request, logical block, value), clearing the flag."""
        for mon in self._monitors.values():
            mon.step()

    def check_errors(self) -> None:
        """Read every error flag now (a sync) and raise ``ValueError`` naming the first bad block-table
        entry recorded since the last check, clearing the flag."""
        for mon in self._monitors.values():
            mon.check()

    def reset_errors(self) -> None:
        """Clear every error flag (asynchronously)."""
        for mon in self._monitors.values():
            mon.reset()

    def error_flags(self) -> list[Any]:
        """Every error flag created so far (one per framework and device), e.g. to copy them to the host
        asynchronously (``backends/deferred_errors.py``)."""
        return [mon.flag for mon in self._monitors.values()]

    def check_layer(self, layer: LayerAttention) -> None:
        if layer.num_kv_heads <= 0 or layer.num_q_heads % layer.num_kv_heads:
            raise ValueError(
                f"layer {layer.index}: num_q_heads={layer.num_q_heads} is not a multiple of "
                f"num_kv_heads={layer.num_kv_heads}"
            )
        if layer.window_left is not None and layer.window_left < 0:
            raise ValueError(f"layer {layer.index}: window_left must be >= 0, got {layer.window_left}")

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        layer: LayerAttention,
        meta: BatchMeta,
        kv_cache: tuple[Any, Any],
        sinks: Any = None,
    ) -> Any:
        """Write K/V into ``kv_cache`` then attend: ``q [T, Hq, Dqk]`` -> ``[T, Hq * Dv]`` (q's dtype
        and framework)."""
        from ..kernels import _framework as fw

        if self.validate:
            self._validate(q, k, v, layer, meta, kv_cache, sinks)
        self.check_layer(layer)
        table = meta.headwise_table(layer.index)
        headwise = table is not None
        if _is_torch(q) or fw.torch is not None:
            return_paddle = not _is_torch(q)
            tq = _to_torch(q)
            dev = tq.device
            args = (
                tq,
                _to_torch(k, dev),
                _to_torch(v, dev),
                _to_torch(kv_cache[0]),
                _to_torch(kv_cache[1]),
                _to_torch(meta.cu_seqlens_q, dev, int32=True),
                _to_torch(meta.seq_lens_decoder, dev, int32=True),
                _to_torch(meta.batch_id_per_token, dev, int32=True),
                _to_torch(table if headwise else meta.block_tables, dev, int32=True),
                _to_torch(sinks, dev) if layer.sink == "learnable" else None,
            )
            stream = fw.paddle_stream(dev) if return_paddle else contextlib.nullcontext()
            with stream:
                out = self._launch(*args, layer, meta, headwise, self.error_flag(tq))
            out = out.view(out.shape[0], -1)
            return _to_paddle(out) if return_paddle else out
        # paddle tensors, no torch: FastDeploy's way (Triton on Paddle's torch proxy)
        fw.ensure_paddle_compat()
        out = self._launch(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            _paddle_int32(meta.cu_seqlens_q),
            _paddle_int32(meta.seq_lens_decoder),
            _paddle_int32(meta.batch_id_per_token),
            _paddle_int32(table if headwise else meta.block_tables),
            sinks if layer.sink == "learnable" else None,
            layer,
            meta,
            headwise,
            self.error_flag(q),
        )
        return out.reshape([int(out.shape[0]), -1])

    @staticmethod
    def _launch(q, k, v, kc, vc, cu, dec, bid, table, sinks, layer, meta, headwise, errors=None) -> Any:
        """The cache write and the attention launch on tensors of one framework; ``out [T, Hq, Dv]``.
        ``errors``: the device error flag both kernels record bad table entries in."""
        from ..kernels.cache_write import write_kv_cache
        from ..kernels.paged_attention import paged_attention

        dtype = str(q.dtype).rsplit(".", 1)[-1]
        if dtype not in _DTYPES:
            raise TypeError(f"the triton backend runs {_DTYPES}, got q.dtype={q.dtype}")
        if kc.dtype != q.dtype or vc.dtype != q.dtype:
            raise TypeError(f"kv_cache dtype must match q ({q.dtype}), got {kc.dtype} / {vc.dtype}")
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got q on "
                f"{q.device}"
            )
        write_kv_cache(k, v, kc, vc, bid, cu, dec, table, headwise=headwise, errors=errors)
        slides = layer.sliding_kv_heads is not None and layer.window_left is not None
        return paged_attention(
            q,
            kc,
            vc,
            cu,
            dec,
            table,
            scale=layer.softmax_scale,
            headwise=headwise,
            window_left=layer.window_left if slides else None,
            sliding_heads=layer.sliding_kv_heads if slides else None,
            sink_kind=layer.sink,
            sinks=sinks,
            max_q_len=meta.max_seq_len_this_time,
            max_context_len=meta.max_context_len,
            logits_soft_cap=layer.logits_soft_cap,
            errors=errors,
        )

    def _validate(self, q, k, v, layer, meta, kv_cache, sinks) -> None:
        # also checks the host maxima the kernels size their launches from
        from .checks import validate_inputs, validate_shapes

        if self.host_checks and not _capturing(q):
            validate_inputs(q, k, v, layer, meta, kv_cache, sinks)
        else:
            validate_shapes(q, k, v, layer, meta, kv_cache, sinks)
