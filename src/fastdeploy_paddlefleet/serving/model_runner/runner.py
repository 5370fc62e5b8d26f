"""``PaddleFleetModelRunner``: FastDeploy's ``GPUModelRunner`` with per-layer caches and page tables.

Built lazily (:func:`runner_class`) as a subclass of FastDeploy's own
``fastdeploy.worker.gpu_model_runner.GPUModelRunner``. When the model is not the plugin's
(``model_config.architectures[0] != "PaddleFleetForCausalLM"``) every overridden method calls
FastDeploy's own at once: the runner IS FastDeploy's. For the plugin's model:

* ``cal_theortical_kvcache``: the price of one block from the real per-layer shapes
  (:func:`sizing.block_bytes`, the cache dtype's bytes), so FastDeploy's
  ``num_gpu_blocks = available // price`` is right;
* ``initialize_kv_cache``: each layer's K ``[num_gpu_blocks, Hkv_l, bs, qk_l]`` and V
  ``[num_gpu_blocks, Hkv_l, bs, v_l]`` (no uniform inflation), passed flat ``[k0, v0, k1, v1, ...]``
  as FastDeploy does; with window recycling (``kv_recycling.scheduler.decide``, the engine hook's
  own decision) the ONE pool of ``kvcache/pools.py`` instead: ``slots`` key and value tensors
  whose pages any group can take, each layer's K and V a view of its slot
  (``sizing.pool_caches``), ``layout.num_pages(num_gpu_blocks)`` pages as the engine's hook counts;
* with recycling, per-group page tables (``page_tables.DevicePageTables``, fixed addresses) are
  updated in ``insert_tasks_v1`` from the ``KVDelta`` each task carries, and
  ``initialize_forward_meta`` hands them to the model as ``forward_meta.block_tables_headwise``
  (``{layer: [bsz * Hkv, max_blocks]}``, read by ``serving/forward_meta.py`` into ``BatchMeta``).

With ``kv_cache_quant_type`` (a quantization config with nothing else, ``serving/checks.py``) the
codes are ``uint8`` and ``block_wise_fp8`` adds per layer a key and a value scale tensor
``[num_blocks, Hkv_l, block_size]`` (per slot with recycling) in the model dtype, passed as
FastDeploy does, ``[k, v, k_scales, v_scales]`` per layer; the price of a block counts the scales
(FastDeploy's own ``cal_theortical_kvcache`` does not: its block count would over-commit them).

Where FastDeploy already prices every layer by its own shape (a runner newer than c1b7c083d that
derives per-layer kv heads itself) and no recycling is asked for, the runner defers to FastDeploy's
sizing (:meth:`FleetKV.defers`). FastDeploy's single shape is also kept, with one WARNING naming the
setting, where another FastDeploy process creates, attaches or swaps the caches by name
(``splitwise_role`` other than ``mixed``, ``kvcache_storage_backend``, ``num_cpu_blocks > 0``),
under speculative decoding and under ``ENABLE_V1_KVCACHE_MANAGER``; the engine's ``decide`` refuses
those settings by name when recycling is on.
"""

from __future__ import annotations

import logging
from typing import Any

from ...backends.base import host_int
from .._fields import field as _get
from ..names import ARCHITECTURE

logger = logging.getLogger(__name__)

#: FastDeploy's ``RequestType`` values that free a batch slot
_FREED_SLOT_TYPES = ("PREEMPTED", "ABORT")

_RUNNER_CLASS: Any = None


def is_paddlefleet_model(fd_config: Any) -> bool:
    """Whether ``fd_config`` serves the plugin's model (its routing puts our class first)."""
    archs = _get(_get(fd_config, "model_config"), "architectures")
    archs = [archs] if isinstance(archs, str) else list(archs or [])
    return bool(archs) and archs[0] == ARCHITECTURE


class FleetKV:
    """The plugin's cache state inside one runner: plan, layout, sizes and page tables."""

    def __init__(self, runner: Any) -> None:
        from ...patch import cache_plan
        from ..kv_recycling.scheduler import decide
        from .sizing import check_layout_matches

        fd_config = runner.fd_config
        model = runner.model
        self.layers = list(cache_plan(model.plan, model.backend))  # V padded where the backend needs it
        mc = _get(fd_config, "model_config")
        cc = _get(fd_config, "cache_config")
        self.dtype = str(_get(mc, "dtype") or "bfloat16")
        from ..checks import kv_cache_quant_of

        #: the KV cache format (``kvcache.quant.KVCacheQuant``; None: ``dtype`` caches)
        self.quant = kv_cache_quant_of(fd_config)
        self.block_size = host_int("cache_config.block_size", _get(cc, "block_size"), 1)  # 4.7 refused
        #: the engine hook's decision, made by the same function on the same config (None: no recycling)
        self.setup = decide(fd_config, warn=False)  # the prefix-caching WARNING is the engine's line
        self.layout = None if self.setup is None else self.setup.layout
        self.tables = None
        #: pages of the pool allocated now (None before a non-profile allocation)
        self.num_pages: int | None = None
        #: the pool's tensors and views (``sizing.PoolCaches``) once allocated
        self.pool = None
        if self.layout is not None:
            from .page_tables import DevicePageTables

            check_layout_matches(self.layers, self.layout)
            share = runner.share_inputs
            max_num_seqs = int(share["block_tables"].shape[0])
            max_blocks = int(share["block_tables"].shape[1])
            self.tables = DevicePageTables(self.layout, max_num_seqs, max_blocks)
            logger.info(
                "paddlefleet runner: window recycling on, layout %s, %d groups, page tables "
                "[%d slots, %d blocks]",
                self.layout.layout_id,
                len(self.layout.groups),
                max_num_seqs,
                max_blocks,
            )

    def price(self) -> int:
        """Bytes of one FastDeploy block in the cache dtype: every layer at its own shape, or with
        recycling what it costs in the pool (``sizing.pool_block_bytes``)."""
        from .sizing import block_bytes, pool_block_bytes

        if self.layout is not None:
            return pool_block_bytes(self.layout.pool, self.layers, self.dtype, self.quant)
        return block_bytes(self.layers, self.block_size, self.dtype, self.quant)

    def defers(self, fastdeploy_price: int) -> bool:
        """No recycling and FastDeploy's own price already equals the per-layer sum (at FastDeploy's
        2 bytes per element; quantized, the honest price with codes and scales): FastDeploy sizes
        every layer by its shape itself, or all layers are alike. FastDeploy's own sizing is kept
        then. A ``block_wise_fp8`` cache is never deferred: FastDeploy's price leaves its scales out."""
        from .sizing import block_bytes

        if self.quant is not None:
            per_layer = block_bytes(self.layers, self.block_size, self.dtype, self.quant)
        else:
            per_layer = block_bytes(self.layers, self.block_size, "bf16")
        return self.layout is None and int(fastdeploy_price) == per_layer

    @property
    def code_dtype(self) -> str:
        """The K / V tensors' dtype: ``uint8`` codes when quantized, else the model dtype."""
        return self.dtype if self.quant is None else "uint8"


def _shared_cache_setting(fd_config: Any) -> str | None:
    """The setting, if any, under which another FastDeploy process creates, attaches or swaps the
    caches by name with FastDeploy's single shape (cache messenger, storage, CPU swap)."""
    cc = _get(fd_config, "cache_config")
    sc = _get(fd_config, "scheduler_config")
    role = _get(sc, "splitwise_role") or "mixed"
    if role != "mixed":
        return f"splitwise_role={role!r}"
    if _get(cc, "kvcache_storage_backend"):
        return f"kvcache_storage_backend={_get(cc, 'kvcache_storage_backend')!r}"
    cpu_blocks = int(_get(cc, "num_cpu_blocks") or 0)
    if cpu_blocks > 0:
        return f"num_cpu_blocks={cpu_blocks} (swap_space)"
    return None


def _make_runner_class() -> type:
    from fastdeploy.worker import gpu_model_runner as fd_runner

    Base = fd_runner.GPUModelRunner

    class PaddleFleetModelRunner(Base):
        """FastDeploy's ``GPUModelRunner``; per-layer caches and page tables for PaddleFleet models."""

        def __init__(self, fd_config: Any, *args: Any, **kwargs: Any) -> None:
            self.fleet: FleetKV | None = None
            self._fleet_model = is_paddlefleet_model(fd_config)
            super().__init__(fd_config, *args, **kwargs)

        # -- model ------------------------------------------------------------------------------
        def load_model(self) -> None:
            super().load_model()
            if not self._fleet_model:
                return
            if self.spec_method is not None:
                logger.warning(
                    "paddlefleet runner: speculative decoding (%s) keeps FastDeploy's single cache shape "
                    "and no window recycling",
                    self.spec_method,
                )
                return
            if self.enable_cache_manager_v1:
                logger.warning(
                    "paddlefleet runner: ENABLE_V1_KVCACHE_MANAGER allocates FastDeploy's single cache shape "
                    "itself; per-layer caches and window recycling are off"
                )
                return
            shared = _shared_cache_setting(self.fd_config)
            if shared is not None:
                logger.warning(
                    "paddlefleet runner: %s: another FastDeploy process attaches the caches with "
                    "FastDeploy's single shape; per-layer caches and window recycling are off",
                    shared,
                )
                return
            self.fleet = FleetKV(self)

        def _fleet_sizes(self) -> bool:
            """Whether this runner, not FastDeploy, sizes the caches."""
            return self.fleet is not None and not self.fleet.defers(Base.cal_theortical_kvcache(self))

        # -- sizing -----------------------------------------------------------------------------
        def cal_theortical_kvcache(self) -> int:
            if not self._fleet_sizes():
                return super().cal_theortical_kvcache()
            return self.fleet.price()

        def initialize_kv_cache(self, profile: bool = False) -> None:
            if not self._fleet_sizes():
                return super().initialize_kv_cache(profile=profile)
            self._initialize_fleet_kv_cache(profile)

        def _initialize_fleet_kv_cache(self, profile: bool) -> None:
            import paddle

            fleet = self.fleet
            local_rank = self.local_rank % self.parallel_config.tensor_parallel_size
            suffix = f"rank{local_rank}.device{self.device_id}"
            if fleet.layout is not None and not profile:
                cache_list, nbytes, what = self._allocate_pool(fleet, suffix)
            else:  # no recycling, or the profile run: every layer its own FastDeploy-sized cache
                cache_list, nbytes, what = self._allocate_layers(fleet, suffix)
            self.share_inputs["caches"] = cache_list
            logger.info(
                "paddlefleet runner: %s kv cache, %s (%.3f GiB)",
                "profile" if profile else "serving",
                what,
                nbytes / (1 << 30),
            )
            if not profile:
                self.cache_ready_signal.value[local_rank] = 1
            if paddle.is_compiled_with_cuda():
                paddle.device.cuda.empty_cache()

        def _new_cache(self, name: str, shape: Any, dtype: str | None = None) -> Any:
            import paddle

            tensor = paddle.full(shape=list(shape), fill_value=0, dtype=dtype or self.fleet.code_dtype)
            fd_runner.set_data_ipc(tensor, name)
            self.cache_kvs_map[name] = tensor
            return tensor

        def _allocate_layers(self, fleet: FleetKV, suffix: str) -> tuple[list, int, str]:
            from .sizing import worker_caches

            caches = worker_caches(
                fleet.layers, fleet.block_size, fleet.dtype, int(self.num_gpu_blocks), fleet.quant
            )
            out = []
            for c in caches.layers:  # FastDeploy's order and names: [k, v(, k_scales, v_scales)] per layer
                out.append(self._new_cache(f"key_caches_{c.index}_{suffix}", c.key_shape))
                out.append(self._new_cache(f"value_caches_{c.index}_{suffix}", c.value_shape))
                if c.scale_shape is not None:
                    for kind in ("key", "value"):
                        name = f"{kind}_cache_scales_{c.index}_{suffix}"
                        out.append(self._new_cache(name, c.scale_shape, fleet.dtype))
            quant = "" if fleet.quant is None else f", {fleet.quant.name}"
            return out, caches.nbytes, f"{len(caches.layers)} layers sized one by one{quant}"

        def _allocate_pool(self, fleet: FleetKV, suffix: str) -> tuple[list, int, str]:
            from .sizing import pool_caches

            pool = fleet.layout.pool
            fleet.num_pages = pool.num_pages(int(self.num_gpu_blocks))
            caches = fleet.pool = pool_caches(pool, fleet.layers, fleet.num_pages, fleet.dtype, fleet.quant)
            keys = [
                self._new_cache(f"key_caches_slot{t}_{suffix}", caches.key_shape) for t in range(caches.slots)
            ]
            values = [
                self._new_cache(f"value_caches_slot{t}_{suffix}", caches.value_shape)
                for t in range(caches.slots)
            ]
            scales = None
            if caches.scale_shape is not None:  # block_wise_fp8: [rows, G, block_size] per slot, K and V
                scales = [
                    [
                        self._new_cache(
                            f"{kind}_cache_scales_slot{t}_{suffix}", caches.scale_shape, fleet.dtype
                        )
                        for t in range(caches.slots)
                    ]
                    for kind in ("key", "value")
                ]
            out = []
            for v in caches.layers:  # each layer's view of its slot: a reshape, then its leading channels
                k = keys[v.slot].reshape(
                    [v.key_shape[0], v.key_shape[1], v.key_shape[2], caches.key_shape[3]]
                )
                val = values[v.slot].reshape(
                    [v.value_shape[0], v.value_shape[1], v.value_shape[2], caches.value_shape[3]]
                )
                out.append(k if v.key_shape[3] == caches.key_shape[3] else k[..., : v.key_shape[3]])
                out.append(val if v.value_shape[3] == caches.value_shape[3] else val[..., : v.value_shape[3]])
                if scales is not None:  # the scales' view [rows * G / Hkv, Hkv, block_size]: a reshape
                    out += [scales[0][v.slot].reshape(list(v.scale_shape)),
                            scales[1][v.slot].reshape(list(v.scale_shape))]  # fmt: skip
            what = (
                f"one pool of {fleet.num_pages} pages ({caches.slots} slots, {len(pool.groups)} groups, "
                f"{pool.pages_per_block} pages per FastDeploy block)"
            )
            return out, caches.nbytes, what

        # -- page tables ------------------------------------------------------------------------
        def _serving_tables(self) -> Any:
            fleet = self.fleet
            if fleet is None or fleet.tables is None or fleet.num_pages is None:
                return None
            return fleet.tables

        def insert_tasks_v1(self, req_dicts: Any, num_running_requests: int | None = None) -> Any:
            tables = self._serving_tables()
            if tables is not None:
                self._apply_task_deltas(tables, req_dicts)
            return super().insert_tasks_v1(req_dicts, num_running_requests)

        def _apply_task_deltas(self, tables: Any, req_dicts: Any) -> None:
            from ..kv_recycling.protocol import TASK_ATTR, task_delta

            for i in range(len(req_dicts)):
                request = req_dicts[i]
                slot = self.share_inputs.get_index_by_batch_id(request.idx)
                kind = getattr(request.task_type, "name", str(request.task_type))
                if kind in _FREED_SLOT_TYPES:
                    tables.clear_slot(slot, str(request.request_id))
                    continue
                delta = task_delta(request)
                if delta is None:
                    raise ValueError(
                        f"task {request.request_id!r} ({kind}) carries no {TASK_ATTR}: the engine's window "
                        "recycling hook is not running (FD_PLUGINS=paddlefleet and the same "
                        "FDFLEET_KV_RECYCLE are needed in the engine process too)"
                    )
                tables.apply(slot, delta)

        def _dummy_prefill_inputs(
            self, input_length_list: Any, max_dec_len_list: Any, block_num: Any
        ) -> None:
            super()._dummy_prefill_inputs(input_length_list, max_dec_len_list, block_num)
            tables = self._serving_tables()
            if tables is not None:  # capture / warm-up after the pools exist: valid pages, never -1
                for slot in range(len(input_length_list)):
                    tables.fill_dummy(slot, block_num, self.fleet.num_pages)

        def initialize_forward_meta(self, is_dummy_or_profile_run: bool = False) -> None:
            super().initialize_forward_meta(is_dummy_or_profile_run=is_dummy_or_profile_run)
            tables = self._serving_tables()
            if tables is not None:
                bsz = int(self.share_inputs["seq_lens_this_time"].shape[0])
                self.forward_meta.block_tables_headwise = tables.forward_tables(bsz)

    PaddleFleetModelRunner.__module__ = __name__
    PaddleFleetModelRunner.__qualname__ = "PaddleFleetModelRunner"
    return PaddleFleetModelRunner


def runner_class() -> type:
    """The runner class (built once, on first use, from FastDeploy's ``GPUModelRunner``)."""
    global _RUNNER_CLASS
    if _RUNNER_CLASS is None:
        _RUNNER_CLASS = _make_runner_class()
    return _RUNNER_CLASS


__all__ = ["ARCHITECTURE", "FleetKV", "is_paddlefleet_model", "runner_class"]
