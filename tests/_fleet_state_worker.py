"""One rank of the PaddleFleet parallel-state test (run by ``test_tp_fastdeploy.py``).

``python _fleet_state_worker.py SPEC_JSON`` (``rank``, ``endpoints``, ``out``). Like FastDeploy's
worker it first runs its own fleet init (model parallel = world size, ``init_distributed_environment``)
and creates ``parallel_config.tp_group``; then ``init_paddlefleet_parallel_state`` must give PaddleFleet a
tensor-parallel group with FastDeploy's ranks. ``paddlefleet`` is not installable here: a stand-in
``paddlefleet.parallel_state`` (written by the test, listed in its docstring) keeps what
``initialize_model_parallel(hcg)`` is given, the way PaddleFleet stores its groups.
"""

from __future__ import annotations

import json
import os
import sys

from _gloo import set_gloo_env  # tests/ is the script's folder


def main(spec: dict) -> None:
    rank, endpoints = spec["rank"], spec["endpoints"]
    set_gloo_env(rank, endpoints)
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from fastdeploy_paddlefleet.serving.parallel import ParallelSetup, init_paddlefleet_parallel_state

    paddle.set_device("cpu")
    world = len(endpoints)
    strategy = fleet.DistributedStrategy()  # FastDeploy's worker: mp over every rank
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    tp_group = dist.new_group(ranks=list(range(world)))  # ParallelConfig.set_communicate_group
    setup = ParallelSetup(tp_size=world, tp_rank=rank, tp_group=tp_group)
    line = init_paddlefleet_parallel_state(setup)

    from paddlefleet import parallel_state

    group = parallel_state._TENSOR_MODEL_PARALLEL_GROUP
    x = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(x, group=group)  # the group PaddleFleet's parallel linears would reduce over
    hcg = fleet.get_hybrid_communicate_group()
    result = {
        "line": line,
        "ranks": list(group.ranks),
        "nranks": int(group.nranks),
        "sum": float(x.numpy()[0]),
        "mp_world": int(hcg.get_model_parallel_world_size()),
        "mp_rank": int(hcg.get_model_parallel_rank()),
        "init_calls": parallel_state.INIT_CALLS,
    }
    with open(os.path.join(spec["out"], f"state{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
