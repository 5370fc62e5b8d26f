"""Prefix caching with window recycling serves what FastDeploy's own prefix caching serves (issue 32, item 2).

In a fresh child process per preset (``_fastdeploy_host.run_scenario``, ``FD_PLUGINS=paddlefleet``),
FastDeploy's REAL ``ResourceManagerV1`` (built by ``_scheduler_sim.make_manager`` in FastDeploy's own
order) schedules one seeded multi-turn chat trace (``_prefix_trace``): a 2048-token system prompt
shared by every conversation, conversations of 3 to 6 turns that re-send their whole history (the
previous prompt, the tokens the engine generated, a new user message), a worker one step behind.
The same trace runs twice on the same KV bytes (the same FastDeploy block count: the hook's pool
holds ``pool.num_pages(blocks)`` pages of the same bytes), prefix caching on
(``cache_config.enable_prefix_caching``, FastDeploy's switch) in both:

* ``off``: ``FDFLEET_KV_RECYCLE=off``, FastDeploy's own prefix caching and accounting;
* ``auto``: window recycling (the plugin's hook) with prefix caching kept on.

Counted by FastDeploy itself: the sum of each request's ``metrics.gpu_cache_token_num`` (what
``get_prefix_cached_blocks`` served it at the admission that admitted it), and, never below it, the
``prefix_cache_token_num`` counter (``main_process_metrics``; it counts every admission attempt,
see ``_prefix_trace``). Independent of both, the simulated worker
counts the prefill tokens it actually ran: with no preemption that is exactly prompt tokens minus
served tokens (a served token is never recomputed), and with recycling every query's window keys
are checked mapped in the worker's tables (``_scheduler_sim.SimWorker``, tables from the tasks'
``KVDelta``), so a served token is one whose K/V the worker has pages for (which token each page
holds is checked by ``test_prefix_caching_scheduler.py``, issue 32 item 1).

Asserted: with recycling the served tokens are >= 0.95 x FastDeploy's, for gpt-oss-20b, Gemma-3-27B,
MiMo-V2-Flash-like and the head-wise ERNIE preset, with FastDeploy's default
``enable_output_caching=False`` and with it on (the token processor's ``cache_output_tokens`` at a
request's end, done by the loop before ``finish_requests`` as FastDeploy's token processor does).

While the hook still switches prefix caching off under recycling (one WARNING from ``decide``), the
``auto`` run serves nothing; the test then checks the reference side and skips, naming why.
"""

from __future__ import annotations

import json

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}
PRESETS = ["gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise"]
#: the served-token ratio the issue asks for (recycling on / FastDeploy's own, same trace and bytes)
MIN_RATIO = 0.95
NOT_YET = (
    "the plugin's scheduler hook still switches FastDeploy's prefix caching off under window "
    "recycling (decide's WARNING): window-aware prefix caching (issue 32) has not landed"
)


@pytest.fixture(scope="module")
def host():
    pytest.importorskip("paddle", reason="FastDeploy's scheduler imports paddle")
    return host_or_skip()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return str(write_model_dir("tiny", tmp_path_factory.mktemp("fdtiny"), dtype="float32", seed=5))


HIT_RATE = """
import json, logging, os
import fastdeploy
from _scheduler_sim import make_config, make_manager, recycler_of
from _prefix_trace import ChatSim, make_chat_trace
from fastdeploy_paddlefleet.presets import load_preset

warnings = []
class Grab(logging.Handler):
    def emit(self, record):
        if record.levelname == "WARNING":
            warnings.append(record.getMessage())
logging.getLogger("fastdeploy_paddlefleet").addHandler(Grab())

d = os.path.join(WORK, PRESET)
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(load_preset(PRESET), f)
trace = make_chat_trace(SEED, 12, (3, 6), 2048, (64, 512), (32, 256), every=20, think=5, max_context=8000)
runs = []
for output_caching in (False, True):
    for mode in ("off", "auto"):
        os.environ["FDFLEET_KV_RECYCLE"] = mode
        cfg = make_config(TINY, max_model_len=8192, max_num_seqs=32, max_num_batched_tokens=2048,
                          block_size=64, num_blocks=BLOCKS)
        # FastDeploy turns prefix caching off on the CPU platform (EngineArgs): on, as on a GPU
        cfg.cache_config.enable_prefix_caching = True
        cfg.cache_config.enable_output_caching = output_caching
        rm = make_manager(cfg, d)
        rec = recycler_of(rm)
        # the worker's checks: every key a query's window sees is mapped in its tables. Units are
        # shared between requests (that is prefix caching), so the recycling sim's one-owner and
        # held + free = pool checks do not apply; the token-identity checks with caching are
        # test_prefix_caching_scheduler.py's (issue 32 item 1)
        sim = ChatSim(rm, 1, check=False)
        sim.worker.check = rec is not None
        sim.worker._check_tables = lambda step: None
        st, chat = sim.run_chat(trace, 100000)
        runs.append(dict(
            mode=mode, output_caching=output_caching, recycler=rec is not None,
            prefix_caching=bool(cfg.cache_config.enable_prefix_caching),
            pages=rec.num_pages if rec is not None else None,
            steps=st.steps, finished=st.finished, preempted=st.preempted, tokens=st.tokens,
            prefill_run=st.prefill_tokens, checks=st.checks, queries=sim.worker._checks,
            prompt_tokens=chat.prompt_tokens, served=chat.served, served_metric=chat.served_metric,
            served_gpu_metric=chat.served_gpu_metric, hit_requests=chat.hit_requests,
            left=len(rm.requests), held_at_end=len(rec.manager.requests) if rec is not None else 0,
            per_turn=chat.per_turn,
        ))
report(runs=runs, trace=trace.describe(), requests=trace.requests,
       output_tokens=sum(t.max_tokens for c in trace.convs for t in c),
       warnings=[w for w in warnings if "prefix" in w])
"""


def _run(host, tiny_dir, tmp_path, preset: str) -> dict:
    script = (
        f"TINY = {tiny_dir!r}\nWORK = {str(tmp_path)!r}\nPRESET = {preset!r}\nSEED = 3\nBLOCKS = 400\n"
        + HIT_RATE
    )
    return run_scenario(script, host=host, env=PLUGIN_ENV, timeout=600).check().data


@pytest.mark.parametrize("preset", PRESETS)
def test_recycling_serves_as_many_cached_tokens_as_fastdeploy(host, tiny_dir, tmp_path, preset):
    d = _run(host, tiny_dir, tmp_path, preset)
    runs = {(r["mode"], r["output_caching"]): r for r in d["runs"]}
    summary = {
        k: {
            f: r[f]
            for f in ("served", "prompt_tokens", "prefill_run", "preempted", "steps", "prefix_caching")
        }
        for k, r in runs.items()
    }
    print(preset, d["trace"], json.dumps({str(k): v for k, v in summary.items()}))  # -rP
    for r in runs.values():
        # the whole trace ran; FastDeploy's counter (every admission attempt) is never below what it served
        assert r["finished"] == d["requests"] and r["tokens"] == d["output_tokens"] and r["left"] == 0, r
        assert r["served_metric"] == r["served_gpu_metric"] >= r["served"], r
        assert r["prompt_tokens"] == runs[("off", False)]["prompt_tokens"]  # the same trace in every run
        if r["preempted"] == 0:  # the worker ran exactly what was not served: a served token is never run
            assert r["prefill_run"] == r["prompt_tokens"] - r["served"], r
        assert r["recycler"] == (r["mode"] == "auto"), r
    for oc in (False, True):
        ref = runs[("off", oc)]
        # FastDeploy's own prefix caching serves the system prompt and the re-sent histories
        assert ref["prefix_caching"] and ref["served"] > 0.5 * ref["prompt_tokens"], ref
        assert ref["hit_requests"] >= d["requests"] - 1, ref
    assert runs[("off", True)]["served"] >= runs[("off", False)]["served"]  # output blocks add hits
    if not all(runs[("auto", oc)]["prefix_caching"] for oc in (False, True)):
        assert all(runs[("auto", oc)]["served"] == 0 for oc in (False, True))
        assert any("enable_prefix_caching" in w for w in d["warnings"]), d["warnings"]
        pytest.skip(NOT_YET)
    ratios = {}
    for oc in (False, True):
        got, ref = runs[("auto", oc)], runs[("off", oc)]
        assert got["queries"] > 0, got  # every query's window checked mapped
        assert got["held_at_end"] == 0, got  # no request holds a unit at the end (cached ones stay)
        ratios[oc] = got["served"] / ref["served"]
        print(f"{preset} output_caching={oc}: served {got['served']} / {ref['served']} = {ratios[oc]:.4f}")
    for oc, ratio in ratios.items():
        got, ref = runs[("auto", oc)], runs[("off", oc)]
        assert ratio >= MIN_RATIO, (preset, oc, ratios, got["per_turn"], ref["per_turn"])
