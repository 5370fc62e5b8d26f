"""One rank of the two-process expert-parallel test (run by ``test_ep_idle_rank.py``).

``python _ep_idle_worker.py SPEC_JSON``; the spec gives ``rank``, ``endpoints``,
``out`` (a directory), ``config`` (a minifleet config with MoE layers and
``expert_model_parallel_size`` 2), ``seed``, ``steps`` (this rank's new tokens
per step; empty = idle) and ``early_return``.

Like a FastDeploy worker, the rank runs its steps and then stays up waiting
for the next one (here: until ``out/stop`` appears), so a peer stuck in a
collective waits instead of seeing a closed connection. It writes
``out/rank<r>.npz`` (logits of its tokens, MoE exchange counts) when done.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _gloo import set_gloo_env  # tests/ is the script's folder


def main(spec: dict) -> None:
    rank, endpoints = spec["rank"], spec["endpoints"]
    set_gloo_env(rank, endpoints)
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.patch import cache_plan
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    paddle.set_device("cpu")
    dist.init_parallel_env()
    model = build_minifleet(spec["config"], seed=spec["seed"])
    group = dist.new_group(ranks=list(range(len(endpoints))))  # handed to every MoE layer
    wrapper = PaddleFleetForCausalLM.from_model(
        model, plan_from_config(model.config), backend="reference", ep_group=group
    )
    wrapper.idle_early_return = bool(spec["early_return"])
    block, num_blocks = 4, 16
    caches = []
    for layer in cache_plan(wrapper.plan, wrapper.backend):
        shape = [num_blocks, layer.num_kv_heads, block]
        caches += [paddle.zeros(shape + [layer.qk_head_dim]), paddle.zeros(shape + [layer.v_head_dim])]

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
            "is_zero_size": n == 0,
        }
        hidden = wrapper({"ids_remove_padding": paddle.to_tensor(new, dtype="int64")}, forward_meta)
        logits.append(wrapper.compute_logits(hidden).numpy())
        cached += n
    moe_calls = [m.dispatch_calls for m in wrapper.model.sublayers() if hasattr(m, "dispatch_calls")]
    out = os.path.join(spec["out"], f"rank{rank}")
    np.savez(out + ".tmp.npz", logits=np.concatenate(logits, axis=0), moe_calls=np.array(moe_calls))
    os.replace(out + ".tmp.npz", out + ".npz")
    deadline = time.time() + 600
    while not os.path.exists(os.path.join(spec["out"], "stop")) and time.time() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
