"""Expert parallelism for real: two CPU processes, ``paddle.distributed`` on gloo, ep = 2.

Rank 0 serves a request (a prefill chunk, then decode steps); rank 1 has no
tokens at all. Every MoE layer runs collectives, so rank 1 must still join
each layer's exchange: ``PaddleFleetForCausalLM`` runs one fake token through
the layers. Both ranks must finish, and rank 0's logits must equal a
single-process (ep = 1, no collectives) dense forward of the same model.

Then the same run with the idle path switched off (``idle_early_return``):
rank 1 returns at once and waits for its next step, as a worker does; rank 0
must be stuck in its first MoE exchange. The test bounds that wait with a
short timeout, asserts that it expired, and kills both process groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _gloo import free_endpoints

from fastdeploy_paddlefleet.presets import load_preset

WORKER = Path(__file__).with_name("_ep_idle_worker.py")
FINISH_TIMEOUT = 120.0  # both ranks of the healthy run
HANG_WINDOW = 15.0  # how long rank 0 gets after the early-returning rank 1 is done
SEED = 7
PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5]
DECODES = [[77], [123]]


def moe_config(ep: int) -> dict:
    cfg = load_preset("tiny")
    cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, expert_model_parallel_size=ep)
    return cfg


def launch(out: Path, early_return: bool) -> list[subprocess.Popen]:
    endpoints = free_endpoints(2)
    steps = {0: [PROMPT, *DECODES], 1: [[]] * (1 + len(DECODES))}
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    procs = []
    for rank in (0, 1):
        spec = {
            "rank": rank,
            "endpoints": endpoints,
            "out": str(out),
            "config": moe_config(2),
            "seed": SEED,
            "steps": steps[rank],
            "early_return": early_return,
        }
        log = open(out / f"rank{rank}.log", "w")  # the child keeps its own handle
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed as a whole
            )
        )
        log.close()
    return procs


def wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> bool:
    """Until every path exists (True), a process dies early, or the timeout (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if any(proc.poll() not in (None, 0) for proc in procs):
            return False
        time.sleep(0.2)
    return False


def stop(procs: list[subprocess.Popen], out: Path) -> None:
    (out / "stop").touch()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("rank*.log")))


def single_process_reference() -> np.ndarray:
    """ep = 1, same seed: the model's own dense forward over the whole sequence."""
    import paddle

    from fastdeploy_paddlefleet.minifleet import build_minifleet

    model = build_minifleet(moe_config(1), seed=SEED)
    tokens = PROMPT + [t for d in DECODES for t in d]
    with paddle.no_grad():
        return model(paddle.to_tensor([tokens], dtype="int64"))[0].numpy()


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path


def test_idle_rank_joins_every_moe_exchange(run_dir):
    procs = launch(run_dir, early_return=False)
    try:
        done = wait_for([run_dir / "rank0.npz", run_dir / "rank1.npz"], procs, FINISH_TIMEOUT)
    finally:
        stop(procs, run_dir)
    assert done, "a rank did not finish:\n" + logs(run_dir)
    assert [p.returncode for p in procs] == [0, 0], logs(run_dir)

    rank0, rank1 = np.load(run_dir / "rank0.npz"), np.load(run_dir / "rank1.npz")
    steps = 1 + len(DECODES)
    # every MoE layer (5) exchanged once per step on both ranks; rank 1 produced no rows
    assert rank0["moe_calls"].tolist() == [steps] * 5
    assert rank1["moe_calls"].tolist() == [steps] * 5
    assert rank1["logits"].shape == (0, 256)
    ref = single_process_reference()
    assert rank0["logits"].shape == ref.shape
    assert np.abs(rank0["logits"] - ref).max() <= 1e-4


def test_early_return_on_the_idle_rank_hangs_the_other(run_dir):
    procs = launch(run_dir, early_return=True)
    try:
        idle_done = wait_for([run_dir / "rank1.npz"], procs, FINISH_TIMEOUT)
        assert idle_done, "the early-returning rank should finish at once:\n" + logs(run_dir)
        busy_done = wait_for([run_dir / "rank0.npz"], procs, HANG_WINDOW)
        hung = not busy_done and procs[0].poll() is None
    finally:
        for proc in procs:  # rank 0 is stuck in a collective: no graceful stop
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stop(procs, run_dir)
    assert hung, "rank 0 should have been stuck in its MoE exchange:\n" + logs(run_dir)
    assert not (run_dir / "rank0.npz").exists()
    assert np.load(run_dir / "rank1.npz")["moe_calls"].tolist() == [0] * 5
