"""Build FastDeploy's REAL ``GPUModelRunner`` (and the plugin's subclass) on a CPU machine.

Scenario source (run by ``_fastdeploy_host.run_scenario`` in a fresh child process) that puts
stand-ins in front of the few things a CPU-only FastDeploy cannot provide, and nothing else:

* FastDeploy's compiled CUDA ops (``fastdeploy.model_executor.ops.gpu``) are absent here: a
  module ``__getattr__`` gives each missing name a function that raises ``NotImplementedError``
  naming it, except ``set_data_ipc`` (CUDA IPC registration of a cache tensor), which records the
  name and shape in ``IPC`` so a test can see what the runner registered;
* ``Sampler`` (refuses the CPU platform; nothing here samples: a stand-in whose
  ``apply_logits_processor`` does nothing), ``get_attention_backend`` (no backend for the CPU platform:
  FastDeploy's CUDA default ``AppendAttentionBackend`` is used) and ``Tensor.pin_memory`` (pinned
  host memory needs a CUDA build: the tensor itself);
* the ``cache_ready_signal`` shared memory the engine creates before its workers start;
* ``fastdeploy.envs.ENABLE_V1_KVCACHE_SCHEDULER`` back to 1 after the config is built (FastDeploy's
  GPU default; it switches V1 scheduling off on the CPU platform, and the runner's
  ``insert_tasks_v1`` is the V1 path).

Everything else (the runner's ``__init__``, ``InputBatch``, the attention backend, the model
loader, ``cal_theortical_kvcache``, ``initialize_kv_cache``, ``initialize_forward_meta``) is
FastDeploy's own code. The stand-ins are installed before ``fastdeploy.worker.gpu_worker`` is
imported, so the plugin loads through FastDeploy's own ``load_model_runner_plugins``.
"""

from __future__ import annotations

RUNNER_PRELUDE = r'''
import numpy as np
import paddle

import fastdeploy
import fastdeploy.model_executor.ops.gpu as _fd_ops

IPC = {}


def _cpu_missing_op(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "set_data_ipc":
        def set_data_ipc(tensor, key):
            IPC[key] = list(tensor.shape)
        return set_data_ipc

    def op(*args, **kwargs):
        raise NotImplementedError(f"FastDeploy CUDA op {name} has no build on this CPU machine")

    op.__name__ = name
    return op


_fd_ops.__getattr__ = _cpu_missing_op

import fastdeploy.worker.gpu_model_runner as fd_runner
from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend



class _NoSampler:
    """Where FastDeploy's sampler is reached outside sampling (``insert_tasks_v1``): nothing to do."""

    def apply_logits_processor(self, *args, **kwargs):
        return None


fd_runner.Sampler = lambda fd_config: _NoSampler()
fd_runner.get_attention_backend = lambda *args, **kwargs: AppendAttentionBackend
paddle.Tensor.pin_memory = lambda self, *args, **kwargs: self

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.inter_communicator import IPCSignal

_SIGNALS = {}


def make_config(model_dir, **kwargs):
    """FastDeploy's FDConfig for ``model_dir`` (``EngineArgs(...).create_engine_config()``), with
    FastDeploy's V1 KV-cache scheduling on as on a GPU (FastDeploy turns it off on the CPU platform)."""
    import fastdeploy.envs as fd_envs

    cfg = EngineArgs(model=model_dir, **kwargs).create_engine_config()
    fd_envs.ENABLE_V1_KVCACHE_SCHEDULER = 1
    return cfg


def make_runner(cls, fd_config):
    """``cls(fd_config, ...)`` the way ``GpuWorker.init_device`` builds it (rank 0, device 0),
    after creating the ``cache_ready_signal`` the engine creates."""
    port = fd_config.parallel_config.local_engine_worker_queue_port
    tp = fd_config.parallel_config.tensor_parallel_size
    if port not in _SIGNALS:
        _SIGNALS[port] = IPCSignal(
            name="cache_ready_signal", array=np.zeros([tp], np.int32), dtype=np.int32, suffix=port,
            create=True,
        )
    return cls(fd_config=fd_config, device="cpu", device_id=0, rank=0, local_rank=0)


def fill_step_inputs(runner, this, enc, dec, ids):
    """One packed step into the runner's ``share_inputs`` the way FastDeploy's preprocessing leaves it
    (``this``/``enc``/``dec``: per slot; ``ids``: the packed token ids); returns ``ids`` as a tensor."""
    si = runner.share_inputs
    si["seq_lens_this_time"] = paddle.to_tensor(np.array(this, "int32"))
    si["seq_lens_encoder"] = paddle.to_tensor(np.array(enc, "int32")[:, None])
    si["seq_lens_decoder"] = paddle.to_tensor(np.array(dec, "int32")[:, None])
    si["cu_seqlens_q"] = paddle.to_tensor(np.concatenate([[0], np.cumsum(this)]).astype("int32"))
    si["batch_id_per_token"] = paddle.to_tensor(np.repeat(np.arange(len(this)), this).astype("int32"))
    ids_t = paddle.to_tensor(np.array(ids, "int64"))
    si["ids_remove_padding"] = ids_t
    runner.exist_prefill_flag = any(e > 0 for e in enc)
    return ids_t


def poison_unit(runner, group, unit):
    """NaN into one released page of the one pool: row ``unit`` of the key and value tensors of every
    slot ``group`` (a layout group) reads: all its kv heads and channels, in every one of its layers."""
    rank = [name for name in runner.cache_kvs_map if name.startswith("key_caches_slot0_")][0]
    suffix = rank[len("key_caches_slot0_") :]
    for t in range(len(group.layers)):
        for role in ("key", "value"):
            runner.cache_kvs_map[f"{role}_caches_slot{t}_{suffix}"][unit] = float("nan")
'''

__all__ = ["RUNNER_PRELUDE"]
