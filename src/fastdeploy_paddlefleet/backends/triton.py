"""The Triton backend: this step's K/V into the paged cache, then paged attention (``kernels/``).

Same contract as the reference backend (``backends/base.py``); the caches may be strided views of
FastDeploy's one cache shape (``serving/cache_views.py``), read in place. Tensors meet the kernels
the way FastDeploy runs Triton on paddle tensors (``kernels/_framework.py``):

* torch tensors go straight to the kernels;
* paddle tensors with torch installed cross by DLPack (zero-copy, so cache writes land in the
  caller's cache) and the kernels launch on *Paddle's* current CUDA stream (ordered with Paddle's
  work, recorded by a CUDA graph Paddle captures); the output goes back to paddle. That crossing
  costs ~40-50 us of host per layer (three ``torch.from_dlpack`` and one ``paddle`` import of the
  output), so once a layer's kernels are compiled and kept for a step's shapes, the *paddle lane*
  (:meth:`TritonBackend._run_kept`) launches them by addresses read from the paddle tensors
  themselves, into an output Paddle allocates, on Paddle's stream: the same kernels with the same
  arguments, no crossing (:data:`KEPT_LANE`; torch tensors take the same lane, without the plans'
  per-call frames);
* paddle tensors without torch (a FastDeploy deployment) go straight to the kernels, with Triton
  on Paddle's torch proxy (``paddle.enable_compat(scope={"triton"})``).

Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (tests, torch tensors).

Host synchronisation: ``validate=True`` checks every call's shapes (served, without ``host_checks``: in
full on a step's first call per table and on a layer setup not seen before, else in O(1) against
those) and, with ``host_checks``, the metadata's contents through a host copy (once per step). The
host copy is skipped while a CUDA graph is being captured, and ``host_checks=False`` (set by the
model under FastDeploy) skips it always: the launch bounds then come from
``meta.max_seq_len_this_time`` when known and from the tensors' shapes otherwise, never from the
step's values.

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

Quantized caches (a :class:`~.base.QuantizedKVCache` for ``kv_cache``: uint8 codes plus dequant
scales, ``kvcache/quant.py``): the write goes through ``kernels/cache_write.py`` with the cache whole
(:func:`_write_plan`), never fused into the decode; the decode and portable prefill kernels read the
codes and scales, the Hopper prefill (sm_90, bf16 / fp16 models, ``auto`` or ``hopper``) reads a bf16 /
fp16 scratch the step's pages are dequantized into first (``kernels/kv_dequant_gather.py``).

Create the flag before capturing a CUDA graph (``backend.error_flag(tensor_on_device)``, or any eager
call such as the warm-up run): a flag first allocated inside a capture would be cleared by every
replay.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..kernels import _framework as fw
from ..kernels._framework import is_torch
from ..kernels.launch.direct import LaunchStep, tensor_version
from ..plan.layer import LayerAttention
from .base import AttentionBackend, BatchMeta, QuantizedKVCache

logger = logging.getLogger(__name__)

_DTYPES = ("float16", "bfloat16", "float32")
_Tensor = fw.torch.Tensor if fw.torch is not None else None  # the exact type (is_torch without a call)

#: calls whose kernels are compiled and kept launch them by addresses at once
#: (:meth:`TritonBackend._run_kept`; paddle tensors with torch installed: without DLPack views);
#: ``False``: always through ``_run`` (tests compare the two). Read per call.
KEPT_LANE = True


def _to_torch(x: Any, device: Any = None, int32: bool = False) -> Any:
    """Torch view of a paddle / torch tensor (DLPack, zero-copy); numpy or lists are copied."""
    import torch

    if x is None:
        return None
    if not is_torch(x):
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
    if is_torch(x):
        import torch

        return bool(torch.cuda.is_current_stream_capturing())
    try:
        from paddle.base import core

        return bool(core.is_cuda_graph_capturing())
    except (ImportError, AttributeError):
        return False


class _PaddleDtypes(dict):
    """Paddle dtype -> the torch dtype of the same name (the lane's plan and kernel keys are torch's);
    filled for the backend's dtypes on the first lookup (paddle and torch imported then), ``None``
    for any other."""

    def __missing__(self, key: Any) -> Any:
        if not self:
            import paddle

            for name in _DTYPES:
                self[getattr(paddle, name)] = getattr(fw.torch, name)
            if key in self:
                return self[key]
        return None


_MAX_PLANS = 4096
_STEP_ATTR = "_fdfleet_triton_step"


class _LayerPlan:
    """One layer's launch plans for one pair of caches (and sinks tensor).
    ``kernels``: the attention plan's :class:`~..kernels.launch.direct.KernelCache` (its stream is read once
    per layer for both launches), ``direct`` whether it launches directly. Stale (``_run`` builds a new
    one) when the caches moved (same objects, other storage: ``ptrs``), another sinks tensor came, or
    the sinks were written in place (``sinks_version``: the attention plan holds their float32 copy)."""

    __slots__ = (
        "attend",
        "direct",
        "kernels",
        "kv_cache",
        "layer",
        "ptrs",
        "scale_ptrs",
        "sinks",
        "sinks_version",
        "write",
    )

    def __init__(self, layer, kv_cache, sinks, write, attend) -> None:
        self.layer, self.kv_cache, self.sinks = layer, kv_cache, sinks  # kept: ids stay unique
        self.write, self.attend = write, attend
        self.kernels = attend.kernels
        self.direct = attend.kernels.direct
        self.ptrs = (kv_cache[0].data_ptr(), kv_cache[1].data_ptr())
        self.scale_ptrs = _scale_ptrs(kv_cache)
        self.sinks_version = tensor_version(sinks)

    def current(self, kc: Any, vc: Any, sinks: Any, kv_cache: Any = None) -> bool:
        """Whether the plan still serves caches ``kc`` / ``vc`` (of ``kv_cache``: a quantized cache's
        scales too) and ``sinks``: the same memory, the same sinks tensor, not written in place since."""
        return (
            sinks is self.sinks
            and (sinks is None or tensor_version(sinks) == self.sinks_version)
            and kc.data_ptr() == self.ptrs[0]
            and vc.data_ptr() == self.ptrs[1]
            and (self.scale_ptrs is None or _scale_ptrs(kv_cache) == self.scale_ptrs)
        )


def _scale_ptrs(kv_cache: Any) -> tuple[int, ...] | None:
    """The scales' addresses of a :class:`~.base.QuantizedKVCache`, a static format's quant multipliers'
    too when it carries them (``None`` for a plain pair)."""
    if type(kv_cache) is not QuantizedKVCache:
        return None
    ptrs = (kv_cache.key_scale.data_ptr(), kv_cache.value_scale.data_ptr())
    if kv_cache.key_quant_scale is None:
        return ptrs
    return (*ptrs, kv_cache.key_quant_scale.data_ptr(), kv_cache.value_quant_scale.data_ptr())


def _write_plan(cache: Any, headwise: bool) -> Any:
    """The cache-write plan of one layer's ``cache`` (the kernels' framework), taken whole: a
    ``(key, value)`` pair, or a :class:`~.base.QuantizedKVCache` (codes, scales, format), whose write
    quantizes by FastDeploy's rule (``kernels/cache_write.py``, ``kernels/kv_quant.py``)."""
    from ..kernels.cache_write import CacheWritePlan

    if type(cache) is not QuantizedKVCache:
        return CacheWritePlan(cache[0], cache[1], headwise=headwise)
    return CacheWritePlan(
        cache.key, cache.value, headwise=headwise, quant=cache.quant, key_scale=cache.key_scale,
        value_scale=cache.value_scale, key_quant_scale=cache.key_quant_scale,
        value_quant_scale=cache.value_quant_scale,
    )  # fmt: skip


class _StepState:
    """One step's metadata as the kernels take it (int32, on q's device; torch views or paddle), shared
    by every layer of the step: derived once, kept on the ``BatchMeta``. ``layers``: layer index ->
    (its table's :class:`~..kernels.launch.direct.LaunchStep`, head-wise)."""

    __slots__ = ("backend", "bid", "cu", "dec", "fields", "flag", "layers", "plain", "tables", "torch_views")

    def __init__(self, meta: BatchMeta, q: Any, torch_views: bool, fields: tuple, backend: Any) -> None:
        self.fields, self.torch_views = fields, torch_views
        self.backend, self.flag = backend, backend.error_flag(q)  # the device error flag of every launch
        self.cu = self._int32(meta.cu_seqlens_q, q)
        self.dec = self._int32(meta.seq_lens_decoder, q)
        self.bid = self._int32(meta.batch_id_per_token, q)
        self.tables: dict[int, tuple[Any, Any]] = {}  # id(raw table) -> (raw table, LaunchStep)
        self.layers: dict[int, tuple[Any, bool]] = {}
        #: without head-wise tables every layer reads ``block_tables``: its entry, shared (set on first use)
        self.plain: tuple[Any, bool] | None = None

    def _int32(self, x: Any, q: Any) -> Any:
        return _to_torch(x, q.device, int32=True) if self.torch_views else _paddle_int32(x)

    def layer(self, meta: BatchMeta, layer_index: int) -> tuple[Any, bool]:
        """:meth:`table` for layer ``layer_index``, kept for the step's other calls of that layer; the
        one entry of every layer when the step has no head-wise tables (:attr:`plain`)."""
        lt = self.layers.get(layer_index)
        if lt is None:
            lt = self.layers[layer_index] = self.table(meta, layer_index)
            if self.fields[4] is None:  # no head-wise tables this step: every layer's is this one
                self.plain = lt
        return lt

    def table(self, meta: BatchMeta, layer_index: int) -> tuple[Any, bool]:
        """The :class:`~..kernels.launch.direct.LaunchStep` over the table layer ``layer_index`` reads (int32)
        and whether that table is head-wise (runs on each layer's first call of a step)."""
        raw = None if meta.block_tables_headwise is None else meta.headwise_table(layer_index)
        headwise = raw is not None
        if not headwise:
            raw = meta.block_tables
        hit = self.tables.get(id(raw))
        if hit is None or hit[0] is not raw:
            dev = self.cu.device if self.torch_views else None
            conv = _to_torch(raw, dev, int32=True) if self.torch_views else _paddle_int32(raw)
            launch = LaunchStep(
                self.cu, self.dec, conv, self.bid, max_q_len=self.fields[5], max_context_len=self.fields[6],
                errors=self.flag,
            )  # fmt: skip
            hit = self.tables[id(raw)] = (raw, launch)
        return hit[1], headwise


def _meta_fields(meta: BatchMeta) -> tuple:
    """What the kernels and the served checks read from ``meta``: its tensors (by identity; FastDeploy
    hands every step new ones) and host values."""
    return (
        meta.cu_seqlens_q,
        meta.seq_lens_decoder,
        meta.batch_id_per_token,
        meta.block_tables,
        meta.block_tables_headwise,
        meta.max_seq_len_this_time,
        meta.max_context_len,
        meta.seq_lens_this_time,
        meta.seq_lens_encoder,
        meta.block_size,
    )


def _same_step(f: tuple, meta: BatchMeta) -> bool:
    """Whether ``meta`` still holds the fields ``f`` (:func:`_meta_fields`) were read from."""
    return (
        f[0] is meta.cu_seqlens_q
        and f[1] is meta.seq_lens_decoder
        and f[2] is meta.batch_id_per_token
        and f[3] is meta.block_tables
        and f[4] is meta.block_tables_headwise
        and f[5] == meta.max_seq_len_this_time
        and f[6] == meta.max_context_len
        and f[7] is meta.seq_lens_this_time
        and f[8] is meta.seq_lens_encoder
        and f[9] == meta.block_size
    )


def _live_step(meta: BatchMeta, backend: Any, torch_views: bool, fields: tuple | None) -> _StepState | None:
    """The :class:`_StepState` kept on ``meta`` if it is this backend's, in this framework and current:
    derived from the fields the served checks just found current (``fields``, by identity), else
    checked field by field. ``None`` otherwise (runs once per layer)."""
    st = meta.__dict__.get(_STEP_ATTR)
    if (
        st is None
        or st.backend is not backend
        or st.torch_views != torch_views
        or (st.fields is not fields and not _same_step(st.fields, meta))
    ):
        return None
    return st


def _step_state(
    meta: BatchMeta, q: Any, torch_views: bool, backend: Any, fields: tuple | None = None
) -> _StepState:
    """The step's :class:`_StepState`, derived on the first layer (again if a field was replaced or
    another backend runs the step). ``fields``: :func:`_meta_fields` of ``meta`` read this call, if
    any."""
    st = _live_step(meta, backend, torch_views, fields)
    if st is None:
        st = _StepState(meta, q, torch_views, fields if fields is not None else _meta_fields(meta), backend)
        meta.__dict__[_STEP_ATTR] = st
    return st


_CHECKED_ATTR = "_fdfleet_triton_checked"
_MAX_CHECKED = 4096


class _Checked:
    """The served checks one step passed: its token count and the tables (by identity) checked."""

    __slots__ = ("backend", "fields", "t", "tables")

    def __init__(self, meta: BatchMeta, backend: Any) -> None:
        self.fields, self.backend, self.t, self.tables = _meta_fields(meta), backend, None, set()


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
        self._plans: dict[Any, _LayerPlan] = {}  # (layer, caches, headwise, dtype) -> launch plans
        self._checked: dict[tuple, tuple] = {}  # layer setups validate_shapes passed (served checks)
        # the paddle lane (_run_kept): paddle dtype -> torch dtype, stream readers per device,
        # Paddle's allocation; set up on first use
        self._paddle_dtypes: dict[Any, Any] = _PaddleDtypes()
        self._paddle_streams: dict[int | None, Any] = {}
        self._paddle_alloc: Any = None

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
        and framework).

        Host cost: what is the same for every layer of a step (the metadata's int32 device views, the
        tables) is derived once per step and kept on ``meta``; what is the same for every step of a
        layer (cache geometry, tile shapes, compile-time constants, the Hopper kernel's descriptors) is
        a :class:`~..kernels.paged_attention.AttentionPlan` / :class:`~..kernels.cache_write.CacheWritePlan`
        kept per layer and cache; compiled kernels are launched directly (``kernels/launch/direct.py``)."""
        # served checks: the metadata fields they found current (the step state below skips that check)
        fields = self._validate(q, k, v, layer, meta, kv_cache, sinks) if self.validate else None
        if type(q) is _Tensor or is_torch(q):
            if KEPT_LANE:  # the kernels this call needs compiled and kept: launched by addresses at once
                out = self._run_kept(q, k, v, layer, meta, kv_cache, sinks, fields, False)
                if out is not None:
                    return out
            return self._run(q, k, v, layer, meta, kv_cache, sinks, True, fields)
        if fw.torch is not None:  # paddle tensors, torch installed: torch views (DLPack) on paddle's stream
            if KEPT_LANE:  # the kernels this call needs compiled and kept: launched without the views
                out = self._run_kept(q, k, v, layer, meta, kv_cache, sinks, fields, True)
                if out is not None:
                    return out
            tq = _to_torch(q)
            dev = tq.device
            tk, tv = _to_torch(k, dev), _to_torch(v, dev)
            with fw.paddle_stream(dev):
                out = self._run(tq, tk, tv, layer, meta, kv_cache, sinks, True, fields)
            return _to_paddle(out)
        # paddle tensors, no torch: FastDeploy's way (Triton on Paddle's torch proxy)
        fw.ensure_paddle_compat()
        return self._run(q, k, v, layer, meta, kv_cache, sinks, False, fields)

    def _run(
        self, q, k, v, layer, meta, kv_cache, sinks, torch_views: bool, fields: tuple | None = None
    ) -> Any:
        """The cache write and the attention launch (``q``/``k``/``v`` in the kernels' framework);
        returns ``[T, Hq * Dv]``. ``fields``: :func:`_meta_fields` of ``meta`` found current this call
        (the served checks), else ``None``."""
        step = _step_state(meta, q, torch_views, self, fields)
        lt = step.plain
        if lt is None:
            lt = step.layer(meta, layer.index)
        launch, headwise = lt
        kc, vc = kv_cache[0], kv_cache[1]
        plan = self._plans.get((id(layer), id(kc), id(vc), headwise, q.dtype))
        if plan is None or not plan.current(kc, vc, sinks, kv_cache):  # moved, other sinks, written in place
            plan = self._new_plan(q, layer, kv_cache, sinks, headwise, torch_views)
        stream = plan.kernels.stream() if plan.direct else None
        if launch.max_q_len == 1 and plan.attend.fuse_write:  # decode only: the write inside the decode
            return plan.attend.run_step(q, launch, flat=True, stream=stream, new_kv=(k, v))
        plan.write.run_step(k, v, launch, stream=stream)
        return plan.attend.run_step(q, launch, flat=True, stream=stream)

    def _run_kept(self, q, k, v, layer, meta, kv_cache, sinks, fields, paddle: bool) -> Any:
        """The kept lane: ``forward`` on torch tensors, or on paddle tensors with torch installed (the
        *paddle lane*: no DLPack views), where an earlier call through :meth:`_run` built this layer's
        plans and every kernel the call needs is compiled and kept for its shapes. Reads q / k / v's
        strides and addresses, allocates the ``[T, Hq * Dv]`` output in q's framework and launches the
        kept kernels by addresses (``launch_kept``) on the current stream (paddle: Paddle's, of q's
        device), so the kernels get the arguments :meth:`_run` would give them, without its frames or
        (paddle) the views. A step's first layer derives the step's state here. Any other call (a layer's
        first, a new token count or split count, a CPU tensor, a misaligned view) returns ``None``, and
        :meth:`_run` compiles, keeps, or names what is wrong."""
        step = _live_step(meta, self, True, fields)
        if step is None:
            # a step's first layer: its state derived as _run derives it (the metadata's int32 torch
            # views, once per step); paddle: on the device of the backend's torch error flag
            if paddle:
                flags = [mon.flag for key, mon in self._monitors.items() if key[0] == "torch"]
                if (  # none yet (no call through the views), several devices, or another device than q's
                    len(flags) != 1
                    or not q.is_cuda
                    or (flags[0].device.index or 0) != q.place.gpu_device_id()
                ):
                    return None
                like = flags[0]
                # on Paddle's stream, as the views' path derives it: a conversion or copy of the
                # metadata (int64, host tensors) must run before the kernels that read it
                with fw.paddle_stream(like.device):
                    step = _step_state(meta, like, True, self, fields)
            else:
                step = _step_state(meta, q, True, self, fields)
        lt = step.plain
        if lt is None:
            lt = step.layer(meta, layer.index)
        launch, headwise = lt
        tdt = self._paddle_dtypes[q.dtype] if paddle else q.dtype
        kc, vc = kv_cache[0], kv_cache[1]
        plan = self._plans.get((id(layer), id(kc), id(vc), headwise, tdt))
        if (  # as _run: no plan yet, or a stale one; and what a direct launch needs of the step and caches
            plan is None
            or not plan.direct
            or not launch.direct_ok
            or not plan.current(kc, vc, sinks, kv_cache)
            or not (q.is_cuda and k.is_cuda and v.is_cuda)
        ):
            return None
        write, attend = plan.write, plan.attend
        if not (write.static_aligned and attend.static_aligned):
            return None
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if len(qs) != 3 or len(ks) != 3 or len(vs) != 3 or qs[2] != 1 or ks[2] != 1 or vs[2] != 1:
            return None  # the views' path names the bad shape
        t, tk = q.shape[0], k.shape[0]
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) & 15 or t == 0 or tk == 0 or launch.num_reqs <= 0:
            return None
        if paddle:
            index = attend.kernels.device_index
            read_stream = self._paddle_streams.get(index)
            if read_stream is None:
                read_stream = self._paddle_streams[index] = fw.paddle_stream_reader(index)
            stream = read_stream()
            pdt = self._paddle_dtypes
            kdt, vdt = pdt[k.dtype], pdt[v.dtype]
        else:
            stream = attend.kernels.stream()
            kdt, vdt = k.dtype, v.dtype
        new = None
        if launch.max_q_len == 1 and attend.fuse_write:  # decode only: the write inside the decode
            try:
                attend._check_new_kv((k, v), t, launch)
            except ValueError:
                return None  # _run names the bad shape
            new = (kp, vp, ks, vs, kdt, vdt)
        elif not write.launch_kept(
            kp, vp, ks, vs, kdt, vdt, tk, launch.num_reqs, launch.stride_tbl, launch.n_blk, launch.ptrs,
            launch.bid_ptr, launch.sig, stream,
        ):  # fmt: skip
            return None
        if not paddle:
            out = q.new_empty(t, attend.hqdv)
        else:
            if self._paddle_alloc is None:
                self._paddle_alloc = fw.paddle_empty()
            out = self._paddle_alloc([t, attend.hqdv], q.dtype, q.place)
        op = out.data_ptr()
        if op & 15 or not attend.launch_kept(
            q, qp, qs, t, op, attend.out_strides, launch.num_reqs, launch.max_q_len, launch.max_context_len,
            launch.n_blk, launch.stride_tbl, launch.ptrs, launch.sig, None, stream, new,
        ):  # fmt: skip
            return None  # _run launches again (a write already made stores the same values)
        return out

    def _new_plan(self, q, layer, kv_cache, sinks, headwise, torch_views) -> _LayerPlan:
        """Check the layer against the backend and the caches, and derive its launch plans (once per
        layer and cache)."""
        from ..kernels.paged_attention import AttentionPlan

        self.check_layer(layer)
        quant = kv_cache.quant if type(kv_cache) is QuantizedKVCache else None
        # the cache in the kernels' framework (torch views of paddle tensors), taken whole by the write
        cache = tuple(_to_torch(x) if torch_views else x for x in kv_cache[: 4 if quant else 2])
        if quant is not None:
            mults = (kv_cache.key_quant_scale, kv_cache.value_quant_scale)
            if mults[0] is not None or mults[1] is not None:  # a static format's quant multipliers
                mults = tuple(None if x is None else _to_torch(x) if torch_views else x for x in mults)
            cache = QuantizedKVCache(*cache, quant, *mults)
        tkc, tvc = cache[0], cache[1]
        dtype = str(q.dtype).rsplit(".", 1)[-1]
        if dtype not in _DTYPES:
            raise TypeError(f"the triton backend runs {_DTYPES}, got q.dtype={q.dtype}")
        if quant is None and (tkc.dtype != q.dtype or tvc.dtype != q.dtype):
            raise TypeError(f"kv_cache dtype must match q ({q.dtype}), got {tkc.dtype} / {tvc.dtype}")
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got q on "
                f"{q.device}"
            )
        tsinks = None
        if layer.sink == "learnable" and sinks is not None:
            tsinks = _to_torch(sinks, q.device) if torch_views else sinks
        slides = layer.sliding_kv_heads is not None and layer.window_left is not None
        attend = AttentionPlan(
            tkc, tvc, q, scale=layer.softmax_scale, headwise=headwise,
            window_left=layer.window_left if slides else None,
            sliding_heads=layer.sliding_kv_heads if slides else None, sink_kind=layer.sink, sinks=tsinks,
            logits_soft_cap=layer.logits_soft_cap, kv_quant=quant,
            key_scale=cache[2] if quant else None, value_scale=cache[3] if quant else None,
        )  # fmt: skip
        write = _write_plan(cache, headwise)
        plan = _LayerPlan(layer, kv_cache, sinks, write, attend)
        if len(self._plans) >= _MAX_PLANS:  # caches replaced many times: drop the oldest plans
            self._plans.pop(next(iter(self._plans)))
        self._plans[(id(layer), id(kv_cache[0]), id(kv_cache[1]), headwise, q.dtype)] = plan
        return plan

    def _validate(self, q, k, v, layer, meta, kv_cache, sinks) -> tuple | None:
        """Check a call (``validate``); returns :func:`_meta_fields` of ``meta`` as the served checks
        found them current this call, or ``None`` (the host checks)."""
        if self.host_checks and not _capturing(q):
            from .checks import validate_inputs  # also checks the host maxima the launches are sized from

            validate_inputs(q, k, v, layer, meta, kv_cache, sinks)
            return None
        # served (no host copy): validate_shapes reads the step's metadata and token count, the layer's
        # table, the layer, q / k / v's dtypes and shapes, the caches and the sinks. It runs on a step's
        # first call per table and on a layer setup not seen before; any other call only checks in O(1)
        # that it matches what was checked (~2 us instead of ~40 on the host)
        rec = meta.__dict__.get(_CHECKED_ATTR)
        if rec is None or rec.backend is not self or not _same_step(rec.fields, meta):
            rec = meta.__dict__[_CHECKED_ATTR] = _Checked(meta, self)
        qs, ks, vs = q.shape, k.shape, v.shape
        kc, vc = kv_cache[0], kv_cache[1]
        sig = None
        if len(qs) == 3 and len(ks) == 3 and len(vs) == 3:  # else checked in full (and refused)
            # the shapes by element: a torch.Size slice costs ~0.4 us
            sig = (
                qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], type(q), q.dtype, k.dtype, v.dtype, id(layer),
                id(kc), id(vc), kc.data_ptr(), vc.data_ptr(), id(sinks), meta.block_size,
            )  # fmt: skip
            table = None if meta.block_tables_headwise is None else meta.headwise_table(layer.index)
            if rec.t == qs[0] == ks[0] == vs[0] and id(table) in rec.tables and sig in self._checked:
                return rec.fields
        else:
            table = None if meta.block_tables_headwise is None else meta.headwise_table(layer.index)
        from .checks import validate_shapes

        validate_shapes(q, k, v, layer, meta, kv_cache, sinks)
        rec.t = qs[0]
        rec.tables.add(id(table))
        if len(self._checked) >= _MAX_CHECKED:
            self._checked.clear()
        if sig is not None:
            self._checked[sig] = (layer, kc, vc, sinks)  # kept: the ids in the key stay unique
        return rec.fields
