"""Tensor / expert parallelism 2 for real: two CPU processes, ``paddle.distributed`` on gloo.

Each rank builds ``PaddleFleetForCausalLM`` from an ``fd_config`` carrying FastDeploy's TP
group (``parallel_config.tp_group``, size and rank), loads the FULL checkpoint through
``load_weights`` (the class keeps its shard: heads, MLP units), serves a prefill chunk and
decode steps on per-rank caches of FastDeploy's single shape, and must produce the logits of
a single-process dense eager forward of the same weights (no paged cache, no sharding).
The config is ``tiny`` (sliding + full layers, sinks, GQA, output gate) without the head-wise
layer: PaddleFleet applies ``head_wise_swa_ratio`` per rank's kv heads, so that layer is not
the same model under TP. Expert parallelism 2: the same with four experts (two per rank), the
group handed as FastDeploy's ``parallel_config.ep_group``, the full checkpoint (every expert) streamed
to both ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from _gloo import free_endpoints, run_to_completion  # noqa: E402

from fastdeploy_paddlefleet.presets import load_preset  # noqa: E402
from fastdeploy_paddlefleet.serving.modeldir import write_model_dir  # noqa: E402

WORKER = Path(__file__).with_name("_tp_worker.py")
SEED = 11
PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5]
DECODES = [[77], [123]]
TIMEOUT = 180.0


def tp_config() -> dict:
    cfg = load_preset("tiny")
    cfg["head_wise_swa_ratio"] = [0.0] * cfg["num_hidden_layers"]
    return cfg


def ep_config() -> dict:
    cfg = tp_config()
    cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return cfg


def run_ranks(out: Path, model_dir: Path, tp: int, ep: int = 1) -> list[dict]:
    world = max(tp, ep)
    endpoints = free_endpoints(world)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", FDFLEET_BACKEND="reference")
    specs = [
        {
            "rank": rank,
            "endpoints": endpoints,
            "out": str(out),
            "model_dir": str(model_dir),
            "steps": [PROMPT, *DECODES],
            "tp": tp,
            "ep": ep,
        }
        for rank in range(world)
    ]
    run_to_completion(WORKER, specs, [out / f"rank{r}.log" for r in range(world)], env, TIMEOUT)
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]


def dense_reference(config: dict) -> np.ndarray:
    from fastdeploy_paddlefleet.minifleet import build_minifleet

    model = build_minifleet(config, seed=SEED)
    tokens = PROMPT + [t for d in DECODES for t in d]
    with paddle.no_grad():
        return model(paddle.to_tensor([tokens], dtype="int64"))[0].numpy()


def test_tensor_parallel_2_matches_a_single_process(tmp_path):
    model_dir = write_model_dir(tp_config(), tmp_path / "model", seed=SEED)
    ranks = run_ranks(tmp_path, model_dir, tp=2)
    ref = dense_reference(tp_config())
    for r, rank in enumerate(ranks):
        assert rank["kv_heads"].tolist() == [1] * 5  # 2 kv heads per layer, one per rank
        assert rank["logits"].shape == ref.shape
        err = np.abs(rank["logits"] - ref).max()
        assert err <= 1e-4, f"rank {r}: max |logits - dense| = {err}"


def test_expert_parallel_2_from_fastdeploy_ep_group_matches_a_single_process(tmp_path):
    model_dir = write_model_dir(ep_config(), tmp_path / "model", seed=SEED)
    ranks = run_ranks(tmp_path, model_dir, tp=1, ep=2)
    ref = dense_reference(ep_config())
    for r, rank in enumerate(ranks):
        assert rank["experts"].tolist() == [2] * 5  # 4 experts per MoE layer, two on each rank
        assert rank["logits"].shape == ref.shape
        err = np.abs(rank["logits"] - ref).max()
        assert err <= 1e-4, f"rank {r}: max |logits - dense| = {err}"


STAND_IN_PARALLEL_STATE = """
# stand-in for paddlefleet.parallel_state (paddlefleet is not installable here)
_TENSOR_MODEL_PARALLEL_GROUP = None
INIT_CALLS = 0


def initialize_model_parallel(hcg):
    global _TENSOR_MODEL_PARALLEL_GROUP, INIT_CALLS
    INIT_CALLS += 1
    _TENSOR_MODEL_PARALLEL_GROUP = hcg.get_model_parallel_group()
"""


def test_paddlefleet_parallel_state_gets_fastdeploy_tp_ranks(tmp_path):
    """``init_paddlefleet_parallel_state`` after FastDeploy's own fleet init, two gloo ranks.

    Stand-in module used (listed here): ``paddlefleet`` (empty package) and
    ``paddlefleet.parallel_state`` (``STAND_IN_PARALLEL_STATE``).
    """
    pkg = tmp_path / "standins" / "paddlefleet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel_state.py").write_text(STAND_IN_PARALLEL_STATE)
    print("stand-in modules: paddlefleet, paddlefleet.parallel_state")
    worker = Path(__file__).with_name("_fleet_state_worker.py")
    endpoints = free_endpoints(2)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "standins"), env.get("PYTHONPATH", "")])
    specs = [{"rank": rank, "endpoints": endpoints, "out": str(tmp_path)} for rank in range(2)]
    run_to_completion(worker, specs, [tmp_path / f"state{r}.log" for r in range(2)], env, TIMEOUT)
    for rank in range(2):
        got = json.loads((tmp_path / f"state{rank}.json").read_text())
        assert got["ranks"] == [0, 1] and got["nranks"] == 2  # FastDeploy's tp_group ranks
        assert got["sum"] == 3.0  # 1 + 2 reduced over PaddleFleet's TP group
        assert (got["mp_world"], got["mp_rank"]) == (2, rank)
        assert got["init_calls"] == 1
