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
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle

from fastdeploy_paddlefleet.fastdeploy_modeldir import write_model_dir
from fastdeploy_paddlefleet.presets import load_preset

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


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(out: Path, model_dir: Path, tp: int, ep: int = 1) -> list[dict]:
    world = max(tp, ep)
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", FDFLEET_BACKEND="reference")
    procs = []
    for rank in range(world):
        spec = {
            "rank": rank,
            "endpoints": endpoints,
            "out": str(out),
            "model_dir": str(model_dir),
            "steps": [PROMPT, *DECODES],
            "tp": tp,
            "ep": ep,
        }
        log = open(out / f"rank{rank}.log", "w")
        procs.append(
            subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdout=log, stderr=log, env=env)
        )
        log.close()
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("rank*.log")))
    assert [p.returncode for p in procs] == [0] * world, text
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
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "standins"), env.get("PYTHONPATH", "")])
    procs = []
    for rank in range(2):
        spec = {"rank": rank, "endpoints": endpoints, "out": str(tmp_path)}
        log = open(tmp_path / f"state{rank}.log", "w")
        procs.append(
            subprocess.Popen([sys.executable, str(worker), json.dumps(spec)], stdout=log, stderr=log, env=env)
        )
        log.close()
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("state*.log")))
    assert [p.returncode for p in procs] == [0, 0], text
    for rank in range(2):
        got = json.loads((tmp_path / f"state{rank}.json").read_text())
        assert got["ranks"] == [0, 1] and got["nranks"] == 2  # FastDeploy's tp_group ranks
        assert got["sum"] == 3.0  # 1 + 2 reduced over PaddleFleet's TP group
        assert (got["mp_world"], got["mp_rank"]) == (2, rank)
        assert got["init_calls"] == 1
