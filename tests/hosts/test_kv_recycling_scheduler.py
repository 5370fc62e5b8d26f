"""Window recycling inside FastDeploy's REAL ``ResourceManagerV1`` (engine side of issue 18).

Every scenario runs in a fresh child process (``_fastdeploy_host.run_scenario``) with
``FD_PLUGINS=paddlefleet``: FastDeploy loads the plugin's early hook, which patches
``ResourceManagerV1`` when FastDeploy imports it; the scenarios only build FastDeploy's own config
(``EngineArgs.create_engine_config``) and ``ResourceManagerV1`` (``_scheduler_sim.py``).

* hook: installed by the plugin's own code; recycler present for a windowed plan, absent with
  ``FDFLEET_KV_RECYCLE=off``; prefix caching stays on (window-aware, no warning; see
  ``test_prefix_caching_scheduler.py``);
  refused settings named.
* traces: seeded request traces (mixed lengths, chunked prefill, aborts, preemption from small
  pools) through ``schedule()``, a worker lagging 0, 1 and 3 steps applying pickled tasks' deltas;
  every step: no unit owned twice, held + free = pool, the free count FastDeploy reads
  (``available_block_num``) can be allocated, every promised allocation succeeds (the hook raises
  otherwise), every key a query of the running batch can
  see is mapped in its own rows and nobody else's, the worker's tables equal the manager's; at
  the end everything is free. >= 10,000 steps in all.
* capacity: at equal KV bytes, the peak of concurrently running requests against FastDeploy's
  own accounting (same trace, ``FDFLEET_KV_RECYCLE=off``) is never lower, at every request length
  from 128 tokens to ``max_model_len`` (8192 and 32768), and at ``max_model_len``-long requests
  >= 0.9 x the plan's ratio (all-layer bytes per request / bytes actually needed, ``kv_budget``),
  for gpt-oss-20b, Gemma-3-27B, MiMo-V2-Flash-like and the head-wise ERNIE preset.
"""

from __future__ import annotations

import json

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}
CAPACITY_PRESETS = ["gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise"]


@pytest.fixture(scope="module")
def host():
    return host_or_skip()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny preset (full, sliding and head-wise layer groups) as a FastDeploy model directory."""
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return str(write_model_dir("tiny", tmp_path_factory.mktemp("fdtiny"), dtype="float32", seed=5))


def _prelude(tiny: str) -> str:
    return f"TINY = {tiny!r}\nimport fastdeploy\nfrom _scheduler_sim import *\n"


HOOK = """
import logging
import os
from fastdeploy.engine.sched import resource_manager_v1 as rmv1
from fastdeploy_paddlefleet.serving.kv_recycling import scheduler as hook

records = []
class Grab(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("fastdeploy_paddlefleet").addHandler(Grab())

cfg = make_config(TINY, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
                  num_blocks=64)
cfg.cache_config.enable_prefix_caching = True
rm = make_manager(cfg)
rec = recycler_of(rm)
warnings = [m for lvl, m in records if lvl == "WARNING"]
report(
    patched=bool(getattr(rmv1.ResourceManagerV1, "_fdfleet_kv_recycling_patched", False)),
    has_recycler=rec is not None,
    layout=rec.layout.to_dict() if rec else None,
    prefix_after=cfg.cache_config.enable_prefix_caching,
    warnings=warnings,
    can_allocate_is_ours=rm.cache_manager.can_allocate_gpu_blocks == rec.can_allocate,
)
os.environ["FDFLEET_KV_RECYCLE"] = "off"
report(off_recycler=recycler_of(make_manager(cfg)) is not None)
os.environ["FDFLEET_KV_RECYCLE"] = "auto"

refused = {}
def attempt(name, mutate, env=None):
    c = make_config(TINY, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
                    num_blocks=64)
    mutate(c)
    try:
        hook.decide(c, env if env is not None else {})
        refused[name] = None
    except ValueError as e:
        refused[name] = str(e)
attempt("splitwise", lambda c: setattr(c.scheduler_config, "splitwise_role", "prefill"))
attempt("swap", lambda c: setattr(c.cache_config, "num_cpu_blocks", 16))
attempt("storage", lambda c: setattr(c.cache_config, "kvcache_storage_backend", "mooncake"))
attempt("mtp", lambda c: setattr(c.speculative_config, "method", "mtp"))
attempt("reorder", lambda c: None, {"FD_PD_REORDER": 1})
attempt("v1_manager", lambda c: None, {"ENABLE_V1_KVCACHE_MANAGER": 1})
attempt("v0_scheduler", lambda c: None, {"ENABLE_V1_KVCACHE_SCHEDULER": 0})
attempt("mixed", lambda c: None)
report(refused=refused)
"""


def test_hook_installed_by_the_plugin_and_interactions_named(host, tiny_dir):
    result = run_scenario(_prelude(tiny_dir) + HOOK, host=host, env=PLUGIN_ENV).check()
    d = result.data
    assert d["patched"] and d["has_recycler"] and d["can_allocate_is_ours"]
    kinds = [g["kind"] for g in d["layout"]["groups"]]
    # tiny: full layers 0, 3; sliding 1, 4; head-wise 2: one layer per group (gcd of 2, 2, 1), one pool
    assert kinds == ["full", "full", "sliding", "sliding", "headwise"]
    assert d["layout"]["slots"] == 1 and d["layout"]["heads_per_page"] == 1
    # window-aware prefix caching (issue 32): FastDeploy's switch stays on, no WARNING
    assert d["prefix_after"] is True
    prefix_warnings = [w for w in d["warnings"] if "enable_prefix_caching" in w]
    assert not prefix_warnings, d["warnings"]
    assert d["off_recycler"] is False
    refused = d["refused"]
    assert refused["mixed"] is None
    for name, needle in {
        "splitwise": "splitwise_role='prefill'",
        "swap": "num_cpu_blocks=16",
        "storage": "kvcache_storage_backend='mooncake'",
        "mtp": "speculative_config.method='mtp'",
        "reorder": "FD_PD_REORDER='1'",
        "v1_manager": "ENABLE_V1_KVCACHE_MANAGER='1'",
        "v0_scheduler": "ENABLE_V1_KVCACHE_SCHEDULER=0",
    }.items():
        assert refused[name] and needle in refused[name], (name, refused[name])
        assert "FDFLEET_KV_RECYCLE=off" in refused[name]


TRACES = """
import time
runs = []
# (FastDeploy blocks, max_num_seqs, tp, mixed): small pools force preemption; tp=2 merges the ranks'
# lanes; mixed: mostly short requests (4-24 tokens) with a quarter long ones (300-400), in pools of
# FastDeploy's own minimum (34 blocks: max_model_len // block_size + 2) and a little more
for nb, seqs, tp, mixed in ((60, 16, 1, False), (40, 24, 1, False), (30, 32, 1, False), (40, 16, 2, False),
                            (34, 32, 1, True), (48, 48, 1, True)):
    cfg = make_config(TINY, max_model_len=512, max_num_seqs=seqs, max_num_batched_tokens=128,
                      block_size=16, num_blocks=nb)
    cfg.parallel_config.tensor_parallel_size = tp
    for lag in (0, 1, 3):
        rm = make_manager(cfg)
        sim = Sim(rm, lag)
        if mixed:
            trace = make_trace(100 * nb + lag, 80, (4, 24), (20, 100), 1, aborts=0.1, long=((300, 400), 0.25))
        else:
            trace = make_trace(100 * nb + lag, 50, (4, 300), (1, 200), 2, aborts=0.15)
        t = time.time()
        st = sim.run(trace, 30000)
        runs.append(dict(
            blocks=nb, tp=tp, lag=lag, mixed=mixed, requests=len(trace.arrivals), steps=st.steps,
            checks=st.checks, queries=sim.worker._checks,
            tokens=st.tokens, finished=st.finished, preempted=st.preempted, aborted=st.aborted,
            all_free=sim.all_free(), left=len(rm.requests), seconds=round(time.time() - t, 2),
            released=sim.worker.released,
            groups=[g.kind for g in recycler_of(rm).layout.groups],
        ))
report(runs=runs)
"""


def test_real_scheduler_traces_with_a_lagging_worker(host, tiny_dir):
    result = run_scenario(_prelude(tiny_dir) + TRACES, host=host, env=PLUGIN_ENV, timeout=600).check()
    runs = result.data["runs"]
    print(json.dumps(runs, indent=1))
    assert sum(r["steps"] for r in runs) >= 10_000
    assert sum(r["checks"] for r in runs) == sum(r["steps"] for r in runs)  # every step checked
    for r in runs:
        assert r["all_free"] and r["left"] == 0, r
        assert r["finished"] + r["aborted"] == r["requests"], r
        assert r["queries"] > 0 and r["released"] > 0
    assert {r["lag"] for r in runs} == {0, 1, 3}
    assert sum(r["preempted"] for r in runs) > 0 and sum(r["aborted"] for r in runs) > 0
    assert sum(r["preempted"] for r in runs if r["mixed"]) > 0  # short and long mixed, from a small pool
    assert {"headwise"} <= {k for r in runs for k in r["groups"]}
    # TP=2: each rank holds one kv head per layer; the head-wise layer's is sliding on both ranks
    assert [r["groups"] for r in runs if r["tp"] == 2][0] == ["full", "full", "sliding", "sliding", "sliding"]


PREEMPT_IN_BATCH = """
import json, os
from fastdeploy_paddlefleet.presets import load_preset

runs = []
for preset in ("tiny", "tiny-mimo"):
    d = os.path.join(WORK, preset)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(load_preset(preset), f)
    for lag in (1, 7):
        for nb in (22, 30):
            for seed in (0, 1, 2):
                cfg = make_config(TINY, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=128,
                                  block_size=16, num_blocks=nb)
                rm = make_manager(cfg, d)
                sim = Sim(rm, lag)
                trace = make_trace(seed * 31 + nb, 60, (4, 60), (20, 200), 1)
                st = sim.run(trace, 4000)
                runs.append(dict(preset=preset, lag=lag, blocks=nb, steps=st.steps, checks=st.checks,
                                 preempted=st.preempted, emptied=sim.worker.emptied, finished=st.finished,
                                 all_free=sim.all_free(), requests=len(trace.arrivals)))
report(runs=runs)
"""


def test_preempted_in_the_batch_that_decodes_it(host, tiny_dir, tmp_path):
    """FastDeploy with no decode reserve (``FD_USE_NEW_TOKEN_RATIO_RESERVE=0``, reserve blocks 0), small
    pools and a worker 1 or 7 steps behind preempts every few steps; a request whose status still reads
    prefill (its first token not back yet) can take the blocks of one that already got its decode task
    in the same ``schedule()``, so one batch holds that request's DECODE task and then its PREEMPTED task.
    The DECODE task must carry a delta (a reset to nothing): the worker never runs a task without one.
    Every step checked as in the suite above."""
    env = dict(
        PLUGIN_ENV,
        FD_USE_NEW_TOKEN_RATIO_RESERVE="0",
        FD_RESERVE_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_PREFILL="0",
    )
    script = f"WORK = {str(tmp_path)!r}\n" + PREEMPT_IN_BATCH
    result = run_scenario(_prelude(tiny_dir) + script, host=host, env=env, timeout=600).check()
    runs = result.data["runs"]
    print(json.dumps(runs, indent=1))
    assert {r["lag"] for r in runs} == {1, 7}
    for r in runs:
        assert r["checks"] == r["steps"] and r["all_free"] and r["finished"] == r["requests"], r
        assert r["preempted"] > 0, r
    assert sum(r["emptied"] for r in runs) > 0  # the case happened, and every such task carried its reset


CAPACITY = """
import json, os
from fastdeploy_paddlefleet.presets import load_preset
from fastdeploy_paddlefleet.plan import plan_from_config
from fastdeploy_paddlefleet.kvcache.layout import kv_budget

d = os.path.join(WORK, NAME)
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(load_preset(NAME), f)
rows = []
for mml in MAX_MODEL_LENS:
    for length in sorted({*LENGTHS, mml}):
        # the same KV bytes in both modes: 24 requests' worth of FastDeploy blocks at this length (never
        # below FastDeploy's own minimum for max_model_len); every request arrives at once
        out = min(512, length // 2)
        blocks = max(mml // 64 + 2, 24 * -(-(length + 140) // 64))
        batched = length if length == mml else max(2048, min(length, 8192))
        cfg = make_config(TINY, max_model_len=mml, max_num_seqs=512, max_num_batched_tokens=batched,
                          block_size=64, num_blocks=blocks)
        row = {"max_model_len": mml, "length": length, "blocks": blocks}
        for mode in ("off", "auto"):
            os.environ["FDFLEET_KV_RECYCLE"] = mode
            rm = make_manager(cfg, d, fastdeploy_check=True)
            row[mode + "_recycler"] = recycler_of(rm) is not None
            trace = make_trace(7, 300, (length - out, length - out), (out, out), 0)
            st = Sim(rm, 1, check=False).run(trace, 900)
            row[mode] = st.peak_running
            row[mode + "_preempted"] = st.preempted
        if length == mml:
            b = kv_budget(plan_from_config(d), 64, "bf16", 40.0, mml)
            row["plan_ratio"] = b.bytes_per_request / b.bytes_per_request_recycled
        rows.append(row)
report(rows=rows)
"""

#: request lengths of the capacity rows (each max_model_len is added)
CAPACITY_LENGTHS = [128, 256, 1024, 2048, 4096]


@pytest.mark.parametrize("preset", CAPACITY_PRESETS)
def test_capacity_at_equal_kv_bytes(host, tiny_dir, tmp_path, preset):
    """Recycling never serves fewer concurrent requests than FastDeploy's own accounting, at any
    request length (128 tokens to max_model_len 8192 and 32768), and at max_model_len-long requests
    at least 0.9 of the plan's ratio (all-layer bytes per request / bytes actually needed)."""
    script = (
        f"NAME = {preset!r}\nWORK = {str(tmp_path)!r}\nLENGTHS = {CAPACITY_LENGTHS!r}\n"
        "MAX_MODEL_LENS = [8192, 32768]\n" + CAPACITY
    )
    result = run_scenario(_prelude(tiny_dir) + script, host=host, env=PLUGIN_ENV, timeout=900).check()
    rows = result.data["rows"]
    print(json.dumps(rows, indent=1))
    assert len(rows) == 12
    for row in rows:
        assert row["off_recycler"] is False and row["auto_recycler"] is True, row
        assert row["auto"] >= row["off"], (preset, row)
        if row["length"] == row["max_model_len"]:
            assert row["auto"] / row["off"] >= 0.9 * row["plan_ratio"], (preset, row)


def test_serving_benchmark_smoke(host, tmp_path):
    """``benchmarks/serving_sim.py --smoke`` end to end (tiny workload, temporary output)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FDFLEET_") and k != "FD_PLUGINS"}
    if host.path:
        env["FDFLEET_HOST_FASTDEPLOY"] = host.path
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "serving_sim.py"), "--smoke", "--out", str(out), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and (tmp_path / "smoke.png").stat().st_size > 0
    rows = {(r["workload"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {
        (w, m) for w in ("prefill-heavy", "short", "mixed") for m in ("fastdeploy", "recycling")
    }
    for r in rows.values():
        assert r["output_tokens"] == r["requested_output_tokens"] and r["tokens_per_s"] > 0
        if r["workload"] != "mixed":  # one length: every request generates `output` tokens
            assert r["output_tokens"] == r["requests"] * r["output"]
        assert r["seqs"] == "512" and r["max_num_seqs"] == 512 and r["beyond_fastdeploy_limit"] is False
        assert r["cap_reached"] == (r["peak_running"] >= 512)
        assert r["kv_bytes"] == 1 << 30 and 0 < r["kv_usage_peak"] <= 1
    for w in ("prefill-heavy", "short", "mixed"):  # the same requests in both modes, the same KV bytes
        fd, rc = rows[(w, "fastdeploy")], rows[(w, "recycling")]
        assert (
            fd["prompt_tokens"] == rc["prompt_tokens"]
            and fd["requested_output_tokens"] == rc["requested_output_tokens"]
        )
        assert rc["pools"]["pages"] == rc["pools"]["pages_per_block"] * fd["pools"]["blocks"]
        assert rc["peak_running"] >= fd["peak_running"]
    assert (
        rows[("prefill-heavy", "recycling")]["peak_running"]
        > rows[("prefill-heavy", "fastdeploy")]["peak_running"]
    )
    with pytest.raises(subprocess.CalledProcessError):  # a smoke run never writes the committed results
        subprocess.run(
            [
                sys.executable,
                str(repo / "benchmarks" / "serving_sim.py"),
                "--smoke",
                "--out",
                str(repo / "benchmarks" / "results" / "serving_sim.json"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            cwd=tmp_path,
        )


SEQS_LIMIT = """
def refused(n):
    try:
        make_config(TINY, max_model_len=512, max_num_seqs=n, max_num_batched_tokens=1024, block_size=16,
                    num_blocks=64)
    except AssertionError as exc:
        return str(exc)
    return None
report(at_limit=refused(512), above=refused(513))
"""


def test_fastdeploy_refuses_more_sequences_than_the_benchmarks_limit(host, tiny_dir):
    """benchmarks/serving_sim.py calls rows above FD_MAX_SEQS_LIMIT a what-if because FastDeploy's own
    config check refuses them: checked against the host's real ``FDConfig``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import serving_sim

    data = run_scenario(_prelude(tiny_dir) + SEQS_LIMIT, host=host, env=PLUGIN_ENV, timeout=300).check().data
    assert serving_sim.FD_MAX_SEQS_LIMIT == 512
    assert data["at_limit"] is None
    assert data["above"] is not None and "max_num_seqs" in data["above"] and "513" in data["above"]
