"""One rank of the two-process tensor-parallel test (run by ``test_tp_fastdeploy.py``).

``python _tp_worker.py SPEC_JSON``; the spec gives ``rank``, ``endpoints``, ``out`` (a
directory), ``model_dir`` (a minifleet model directory: config.json + model.safetensors),
``steps`` (new tokens per step), ``tp`` (the TP size) and ``ep`` (the expert-parallel size; the
world is the larger of the two, one group over all ranks serves as FastDeploy's tp/ep group).

Like FastDeploy's worker it creates its TP group first (``dist.new_group`` over the ranks,
as ``ParallelConfig.set_communicate_group`` does), hands it in ``fd_config.parallel_config``,
builds ``PaddleFleetForCausalLM(fd_config)``, streams the FULL checkpoint through
``load_weights`` (the class cuts its part), allocates the per-rank caches in FastDeploy's
single shape and runs the steps. Writes ``out/rank<r>.npz`` (logits of every token).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from _gloo import set_gloo_env  # tests/ is the script's folder


def main(spec: dict) -> None:
    rank, endpoints, tp, ep = spec["rank"], spec["endpoints"], spec["tp"], spec.get("ep", 1)
    world = max(tp, ep)
    if world > 1:
        set_gloo_env(rank, endpoints)
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from safetensors.numpy import load_file

    from fastdeploy_paddlefleet.serving.cache_views import uniform_cache
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    paddle.set_device("cpu")
    group = None
    if world > 1:
        dist.init_parallel_env()
        group = dist.new_group(ranks=list(range(world)))
    block, num_blocks = 4, 8
    fd_config = SimpleNamespace(
        model_config=SimpleNamespace(model=spec["model_dir"], dtype="float32", seed=99, ori_vocab_size=None),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            tensor_parallel_rank=rank % tp,
            tp_group=group if tp > 1 else None,
            expert_parallel_size=ep,
            expert_parallel_rank=rank % ep,
            ep_group=group if ep > 1 else None,
            data_parallel_size=1,
        ),
        cache_config=SimpleNamespace(block_size=block),
        load_config=SimpleNamespace(load_choices="default_v1", dynamic_load_weight=False),
        quant_config=None,
    )
    wrapper = PaddleFleetForCausalLM(fd_config)
    wrapper.load_weights(load_file(os.path.join(spec["model_dir"], "model.safetensors")).items())
    shape = uniform_cache(wrapper.plan)
    caches = []
    for _ in range(len(wrapper.plan)):
        dims = [num_blocks, shape.num_kv_heads, block, shape.head_dim]
        caches += [paddle.zeros(dims), paddle.zeros(dims)]
    cached, logits = 0, []
    for new in spec["steps"]:
        n = len(new)
        forward_meta = {
            "seq_lens_encoder": paddle.to_tensor([[n if cached == 0 else 0]], dtype="int32"),
            "seq_lens_decoder": paddle.to_tensor([[cached]], dtype="int32"),
            "seq_lens_this_time": paddle.to_tensor([n], dtype="int32"),
            "cu_seqlens_q": paddle.to_tensor([0, n], dtype="int32"),
            "batch_id_per_token": paddle.zeros([n], dtype="int32"),
            "block_tables": paddle.arange(num_blocks, dtype="int32").reshape([1, num_blocks]),
            "caches": caches,
        }
        hidden = wrapper({"ids_remove_padding": paddle.to_tensor(new, dtype="int64")}, forward_meta)
        logits.append(wrapper.compute_logits(hidden).numpy())
        cached += n
    heads = [layer.num_kv_heads for layer in wrapper.plan]
    experts = [len(m.local_expert_ids) for m in wrapper.model.sublayers() if hasattr(m, "local_expert_ids")]
    out = os.path.join(spec["out"], f"rank{rank}")
    arrays = {"logits": np.concatenate(logits, axis=0), "kv_heads": np.array(heads)}
    arrays["experts"] = np.array(experts)
    np.savez(out + ".tmp.npz", **arrays)
    os.replace(out + ".tmp.npz", out + ".npz")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
