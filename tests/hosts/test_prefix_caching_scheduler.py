"""Window-aware prefix caching with window recycling on, inside FastDeploy's REAL ``ResourceManagerV1``
(issue 32 step 2; ``docs/prefix_caching.md``).

Every scenario runs in a fresh child process (``_fastdeploy_host.run_scenario``) with
``FD_PLUGINS=paddlefleet`` and FastDeploy's own ``enable_prefix_caching`` on (no other switch):

* traces (``_prefix_sim.shared_trace``): system prompts 0.5 to 20 windows long shared by many
  requests, multi-turn conversations re-sending their history, identical prompts arriving together,
  aborts (FastDeploy's V1 scheduler aborts a request at its next decode step: before, during or
  after the worker has run its prefill chunks, with a lagging worker), preemption from small pools,
  a worker lagging 0, 1 or 3 steps, over gpt-oss-like, Gemma-3-like, MiMo-like and head-wise presets
  (the presets' layer patterns and head-wise ratio, windows scaled down so prompts span many
  windows): every batch checked by token identity (``_prefix_sim`` module docstring), every
  ``schedule()`` checked for held + cached + free = pool, everything free or cached at the end;
  at least 10,000 ``schedule()`` steps in all, and cache hits served (FastDeploy's own hit count).
* capacity: with prefix caching on and no sharing in the trace, peak concurrency of 8k-token
  requests is at least 0.9 of what it is with prefix caching off (recycling on in both, same
  bytes).
* hook: no WARNING, prefix caching stays on, multimodal models with prefix caching refused by name.
"""

from __future__ import annotations

import json

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}


@pytest.fixture(scope="module")
def host():
    return host_or_skip()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return str(write_model_dir("tiny", tmp_path_factory.mktemp("fdtiny"), dtype="float32", seed=5))


PRESETS = """
import json, os
from fastdeploy_paddlefleet.presets import load_preset

def preset_dir(name, window):
    c = load_preset(name)
    if name == "gpt-oss-20b":
        c["num_hidden_layers"] = 4
        c["layer_types"] = c["layer_types"][:4]
    elif name == "gemma3-27b":
        c["num_hidden_layers"] = 6
    elif name == "mimo-v2-flash-like":
        c["num_hidden_layers"] = 8
        c["window_attn_skip_freq"] = c["window_attn_skip_freq"][:8]
    elif name == "ernie-4.5-21b-a3b-headwise":
        c["num_hidden_layers"] = 2
    if window is not None:
        c["sliding_window"] = window
    d = os.path.join(WORK, f"{name}-{window}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    return d
"""

TRACES = """
import time
from _prefix_sim import PrefixSim, shared_trace

runs = []
t0 = time.time()
for name, window in PRESET_WINDOWS:
    d = preset_dir(name, window)
    for lag, nb, seed, gap in RUNS:
        cfg = make_config(TINY, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=128,
                          block_size=16, num_blocks=nb)
        cfg.cache_config.enable_prefix_caching = True
        rm = make_manager(cfg, d)
        rec = recycler_of(rm)
        trace = shared_trace(seed, window, N, 1024, gap=gap)
        t = time.time()
        sim = PrefixSim(rm, lag).run(trace, 6000)
        m = rm.cache_manager.metrics
        runs.append(dict(
            preset=name, window=window, lag=lag, blocks=nb, requests=len(trace.arrivals), steps=sim.steps,
            engine_checks=sim.engine_checks, queries=sim.worker.queries, keys=sim.worker.keys_checked,
            finished=sim.finished, aborted=sim.aborted, preempted=sim.preempted, left=len(rm.requests),
            end_ok=sim.all_free_or_cached(), prompt_tokens=sim.prompt_tokens,
            served=rec.prefix.served_tokens, hit_reqs=m.hit_req_count, peak_cached=sim.peak_cached,
            groups=[g.kind for g in rec.layout.groups], seconds=round(time.time() - t, 2),
        ))
report(runs=runs, seconds=round(time.time() - t0, 1))
"""

#: (lag, FastDeploy blocks, seed, arrival gap): small pools and dense arrivals preempt (max_model_len
#: 1024 = 64 blocks of 16); a large pool keeps much cached
TRACE_RUNS = [(0, 66, 1, 2), (1, 66, 2, 3), (3, 80, 3, 2), (1, 200, 4, 5), (3, 120, 5, 4), (0, 100, 6, 3)]
TRACE_PRESETS = [
    ("gpt-oss-20b", 40),  # window 40: no multiple of the block size (block-aligned release matters)
    ("gemma3-27b", 48),
    ("mimo-v2-flash-like", 24),
    ("ernie-4.5-21b-a3b-headwise", 32),
]


@pytest.mark.parametrize("preset,window", TRACE_PRESETS)
def test_shared_prefix_traces_checked_token_by_token(host, tiny_dir, tmp_path, preset, window):
    script = (
        f"TINY = {tiny_dir!r}\nWORK = {str(tmp_path)!r}\nPRESET_WINDOWS = {[(preset, window)]!r}\n"
        f"RUNS = {TRACE_RUNS!r}\nN = 170\n"
        "import fastdeploy\nfrom _scheduler_sim import make_config, make_manager, recycler_of\n"
        + PRESETS
        + TRACES
    )
    result = run_scenario(script, host=host, env=PLUGIN_ENV, timeout=600).check()
    runs = result.data["runs"]
    print(json.dumps(runs, indent=1))
    for r in runs:
        assert r["engine_checks"] == r["steps"] and r["end_ok"] and r["left"] == 0, r
        assert r["finished"] + r["aborted"] == r["requests"], r
        assert r["served"] > 0 and r["hit_reqs"] > 0, r
    assert sum(r["preempted"] for r in runs) > 0 and sum(r["aborted"] for r in runs) > 0
    assert sum(r["steps"] for r in runs) >= 2_500  # x 4 presets: >= 10,000 schedule() steps in all


CAPACITY = """
from _prefix_sim import PrefixSim, distinct_trace

d = preset_dir(NAME, None)
length, out = 8192, 512
blocks = max(8192 // 64 + 2, 24 * -(-(length + 140) // 64))
row = {"preset": NAME, "blocks": blocks}
for prefix in (False, True):
    cfg = make_config(TINY, max_model_len=8192, max_num_seqs=512, max_num_batched_tokens=8192, block_size=64,
                      num_blocks=blocks)
    cfg.cache_config.enable_prefix_caching = prefix
    rm = make_manager(cfg, d, fastdeploy_check=True)
    rec = recycler_of(rm)
    sim = PrefixSim(rm, 1, check=False).run(distinct_trace(7, 300, length - out, out), 450)
    key = "on" if prefix else "off"
    row[key] = sim.peak_running
    row[key + "_prefix"] = rec.prefix is not None
    row[key + "_preempted"] = sim.preempted
    row[key + "_served"] = rec.prefix.served_tokens if rec.prefix is not None else 0
report(row=row)
"""

CAPACITY_PRESETS = ["gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise"]


@pytest.mark.parametrize("preset", CAPACITY_PRESETS)
def test_capacity_kept_without_sharing(host, tiny_dir, tmp_path, preset):
    """8k-token requests of distinct prompts, all at once, the same KV bytes: with prefix caching on
    (finished requests' paths cached, evicted LRU as new requests need the pages) peak concurrency is
    at least 0.9 of prefix caching off (recycling on in both; the full presets as in
    ``test_kv_recycling_scheduler.test_capacity_at_equal_kv_bytes``)."""
    script = (
        f"TINY = {tiny_dir!r}\nWORK = {str(tmp_path)!r}\nNAME = {preset!r}\n"
        "import fastdeploy\nfrom _scheduler_sim import make_config, make_manager, recycler_of\n"
        + PRESETS.replace('c["num_hidden_layers"]', 'c["_unused"]')
        .replace('c["window_attn_skip_freq"] = c["window_attn_skip_freq"][:8]', "pass")
        .replace('c["layer_types"] = c["layer_types"][:4]', "pass")
        + CAPACITY
    )
    row = run_scenario(script, host=host, env=PLUGIN_ENV, timeout=600).check().data["row"]
    print(json.dumps(row))
    assert row["off_prefix"] is False and row["on_prefix"] is True, row
    assert row["on_served"] == 0, row  # nothing shared: nothing served
    assert row["on"] >= 0.9 * row["off"], row


HOOK = """
import logging
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
mm = None
cfg.model_config.enable_mm = True
try:
    hook.decide(cfg, {})
except ValueError as e:
    mm = str(e)
cfg.model_config.enable_mm = False
report(
    prefix_on=cfg.cache_config.enable_prefix_caching, has_prefix=rec.prefix is not None,
    warnings=[m for lvl, m in records if lvl == "WARNING"], multimodal=mm,
)
"""


def test_prefix_caching_stays_on_without_warning(host, tiny_dir):
    script = (
        f"TINY = {tiny_dir!r}\nimport fastdeploy\n"
        "from _scheduler_sim import make_config, make_manager, recycler_of\n"
    )
    d = run_scenario(script + HOOK, host=host, env=PLUGIN_ENV).check().data
    assert d["prefix_on"] is True and d["has_prefix"] is True
    assert not [w for w in d["warnings"] if "prefix" in w], d["warnings"]
    assert (
        d["multimodal"]
        and "enable_mm=True" in d["multimodal"]
        and "FDFLEET_KV_RECYCLE=off" in d["multimodal"]
    )
