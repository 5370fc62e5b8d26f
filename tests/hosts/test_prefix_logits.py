"""A request served from a prefix hit gives the logits of the same request from scratch (issue 32, item 4).

In a fresh child process per (preset, mode) (``_fastdeploy_host.run_scenario``,
``FD_PLUGINS=paddlefleet``, stand-ins of ``_model_runner_host``): FastDeploy's REAL
``ResourceManagerV1.schedule()`` with prefix caching on (``enable_prefix_caching``, FastDeploy's
switch; its default ``enable_output_caching=False``) schedules multi-turn chats
(``_prefix_trace``: a shared system prompt, conversations re-sending their history, so later turns
and later conversations start from a prefix hit, chunked prefill from the hit on), and the
plugin's real runner (FastDeploy's ``GPUModelRunner`` subclass, built, loaded and cache-sized by
FastDeploy's own code) applies every pickled batch in ``insert_tasks_v1`` and runs each step the
simulated worker runs with a real ``ForwardMeta`` (``initialize_forward_meta``), fp32 on the CPU:

* ``off``: ``FDFLEET_KV_RECYCLE=off``: FastDeploy's own prefix caching and block tables (what the
  plugin serves today with prefix caching);
* ``auto``: window recycling with prefix caching kept on (issue 32): the worker's per-group tables
  come from each task's ``KVDelta``.

Poison: every cache starts NaN, and before every forward each page the engine holds free is set
to NaN (``off``: FastDeploy's ``gpu_free_block_list``, every layer's block; ``auto``: the hook's one
pool's free pages, every slot's row): a page freed by a window, a finish, an abort or a
preemption, or evicted from the prefix cache, is NaN whenever a forward runs (the worker runs each
batch in the step that scheduled it, so the engine's free list is exactly what no query of the
batch may read). Cached pages are not free and keep their K/V.

Reference: minifleet's dense eager forward of each request's whole token sequence (prompt and the
tokens the engine appended) on the same weights, no cache: computed from scratch. Asserted: every
served logit (prefill chunks after the hit, >= 64 decode steps for each request served from a hit)
within 1e-5 and the same argmax; FastDeploy's own ``gpu_cache_token_num`` says which requests were
served from a hit, and at least a few were, with some cache eviction.

The ``auto`` chats share no system prompt (``off`` shares a 24-token one): with the hook of
i32-hook a6bd082, a request whose match is cut below FastDeploy's token match recomputes blocks
already in FastDeploy's radix tree, and FastDeploy's ``mm_build_path`` (c1b7c083d PCM 2034,
``node.children[hash_value] = new_last_node``) replaces the existing child: the paths cached
through the shared prompt before are cut off from the root and serve nothing more, leaving almost
no hits to check logits on (``test_prefix_hit_rate.py`` measures that). Without a shared prompt
each turn is served from its previous turn's path. Pools are small enough that cached blocks are
evicted (FastDeploy's ``free_block_ids``, which the hook evicts through too) and requests preempted.

While the hook switches prefix caching off under recycling (decide's WARNING, before issue 32),
``auto`` serves no hit; the test then skips, naming why.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario
from _model_runner_host import RUNNER_PRELUDE

NOT_YET = (
    "the plugin's scheduler hook still switches FastDeploy's prefix caching off under window "
    "recycling (decide's WARNING): window-aware prefix caching (issue 32) has not landed"
)

SCENARIO = r"""
import json
import random

from safetensors.numpy import load_file

import _prefix_trace as pt
import _scheduler_sim as sim
import fastdeploy.worker.gpu_worker as gw
from fastdeploy.engine.request import Request
from fastdeploy.engine.sampling_params import SamplingParams

from fastdeploy_paddlefleet.minifleet import build_minifleet
from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import recycler_of

BLOCK, SLOTS, MAX_LEN, BATCHED = 4, 4, 256, 32
PROMPTS = {}


def make_chat_request(rid, prompt, max_tokens):
    PROMPTS[rid] = list(prompt)
    params = SamplingParams(
        top_p=1.0, top_k=0, min_p=0.0, temperature=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
        presence_penalty=0.0, max_tokens=max_tokens, min_tokens=1,
    )
    return Request(
        request_id=rid, prompt_token_ids=list(prompt), prompt_token_ids_len=len(prompt),
        sampling_params=params, eos_token_ids=[0] * EOS_LENS,
    )


def token(rid, pos):  # the simulator's engine appends 7 as every generated token
    prompt = PROMPTS[rid]
    return prompt[pos] if pos < len(prompt) else 7


engine_cfg = sim.make_config(
    MODEL_DIR, max_model_len=MAX_LEN, max_num_seqs=SLOTS, max_num_batched_tokens=BATCHED, block_size=BLOCK,
    num_blocks=NUM_BLOCKS,
)
engine_cfg.cache_config.enable_prefix_caching = True  # FastDeploy turns it off on the CPU platform
engine_cfg.cache_config.enable_output_caching = OUTPUT_CACHING
EOS_LENS = engine_cfg.model_config.eos_tokens_lens
pt.make_chat_request = make_chat_request
rm = sim.make_manager(engine_cfg)
rec = recycler_of(rm)
assert (rec is not None) == (MODE == "auto"), (MODE, rec)
prefix_kept = bool(engine_cfg.cache_config.enable_prefix_caching)
if MODE == "auto" and not prefix_kept:
    report(prefix_kept=False)
    raise SystemExit(0)

worker_cfg = make_config(
    MODEL_DIR, model_impl="paddlefleet", max_model_len=MAX_LEN, max_num_seqs=SLOTS,
    max_num_batched_tokens=BATCHED, block_size=BLOCK, enable_chunked_prefill=True,
)
runner = make_runner(gw.ModelRunner, worker_cfg)
runner.load_model()
runner.num_gpu_blocks = NUM_BLOCKS  # the profiled count both sides get
runner.initialize_kv_cache()
fleet = runner.fleet
assert (fleet.tables is not None) == (MODE == "auto")
if rec is not None:
    assert fleet.layout.layout_id == rec.layout.layout_id
for t in runner.cache_kvs_map.values():  # every cache starts as NaN
    t[...] = float("nan")
# the tensors a free page lives in: auto, row `unit` of every slot tensor of the one pool; off, row
# `block` of every layer's K and V cache
CACHES = [t for name, t in runner.cache_kvs_map.items() if name.startswith(("key_caches_", "value_caches_"))]
served, stats = {}, {"forwards": 0, "tokens": 0, "poisoned": 0, "evicted": 0}


EVICTED = set()  # units of the pool reused from the prefix cache since the last forward


def _count_evictions(pool):
    # the pool reuses an evictable (cached) unit for a fresh allocation: that unit's old content must
    # never be read again, so it is poisoned before the next forward like a free page
    inner = pool.on_evict
    if getattr(inner, "counted", False):
        return

    def on_evict(unit, tag):
        stats["evicted"] += 1
        EVICTED.add(unit)
        if inner is not None:
            inner(unit, tag)

    on_evict.counted = True
    pool.on_evict = on_evict


def free_pages():
    if rec is None:
        return list(rm.cache_manager.gpu_free_block_list)
    pool = rec.manager._distinct[0]  # the one shared pool: pages given back (never-used ones are NaN)
    assert len(rec.manager._distinct) == 1
    _count_evictions(pool)  # (the pool is rebuilt by reset_cache_config: checked at every step)
    pages = list(pool.free) + sorted(EVICTED)
    EVICTED.clear()
    return pages


def poison_free():
    pages = sorted(set(free_pages()))
    if pages:
        idx = paddle.to_tensor(pages, dtype="int64")
        for t in CACHES:
            shape = [len(pages)] + list(t.shape[1:])
            paddle.scatter_(t, idx, paddle.full(shape, float("nan"), dtype=t.dtype), overwrite=True)
        stats["poisoned"] += len(pages)


# FastDeploy's own eviction of cached blocks (PrefixCacheManager.free_block_ids): counted
cm = rm.cache_manager
if hasattr(cm, "free_block_ids"):
    _free_block_ids = cm.free_block_ids

    def free_block_ids(need_block_num, *args, **kwargs):
        stats["evicted"] += 1
        return _free_block_ids(need_block_num, *args, **kwargs)

    cm.free_block_ids = free_block_ids


class RunnerWorker(sim.SimWorker):
    # the simulator's worker (its table and window checks) plus the plugin's real runner doing the forward

    def _check_queries(self, step, rid, start, end):
        idx = next(i for i, s in self.slots.items() if s.rid == rid)
        self.ranges.append((idx, rid, start, end))
        super()._check_queries(step, rid, start, end)

    def run(self, step, batch):
        prefill = {t.request_id for t in batch.requests if t.task_type.name == "PREFILL"}
        runner.insert_tasks_v1(batch, SLOTS)  # the runner's own tables (FastDeploy's, or from the deltas)
        self.ranges = []
        out = super().run(step, batch)
        if self.ranges:
            poison_free()
            self.forward(prefill)
        return out

    def forward(self, prefill):
        work = {idx: (rid, s, e) for idx, rid, s, e in self.ranges}
        this, enc, dec, ids, rows = [], [], [], [], []
        for idx in range(SLOTS):
            rid, s, e = work.get(idx, (None, 0, 0))
            this.append(e - s)
            dec.append(s)
            enc.append(e - s if rid in prefill else 0)
            ids += [token(rid, p) for p in range(s, e)]
            rows += [(rid, p) for p in range(s, e)]
        ids_t = fill_step_inputs(runner, this, enc, dec, ids)
        runner.initialize_forward_meta()
        fm = runner.forward_meta
        hidden = runner.model({"ids_remove_padding": ids_t}, fm)
        logits = runner.model.compute_logits(hidden, fm).numpy()
        for row, key in enumerate(rows):
            served[key] = logits[row]
        stats["forwards"] += 1
        stats["tokens"] += len(rows)


# the worker's checks: every key a query's window sees is mapped in its tables (units are shared
# between requests with prefix caching: the recycling sim's one-owner check does not apply)
loop = pt.ChatSim(rm, 0, check=False)
loop.worker = RunnerWorker(loop.bs, rec.layout if rec is not None else None, rec is not None)
loop.worker._check_tables = lambda step: None
loop.worker.ranges = []
trace = pt.make_chat_trace(
    SEED, 4, (2, 3), SYSTEM, (4, 12), (66, 72), every=6, think=2, max_context=MAX_LEN - 6 * BLOCK, vocab=VOCAB
)
result, chat = loop.run_chat(trace, 5000)

raw = json.load(open(MODEL_DIR + "/config.json"))
native = build_minifleet(raw, seed=0)
weights = load_file(MODEL_DIR + "/model.safetensors")
native.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
native.eval()
worst, same, total = 0.0, 0, 0
per_request = {}
hits = {f"c{c}-t{t}": served_from for c, t, _, served_from in chat.per_turn}
for rid in PROMPTS:
    positions = sorted(p for r, p in served if r == rid)
    tokens = [token(rid, p) for p in range(positions[-1] + 1)]
    with paddle.no_grad():
        ref = native(paddle.to_tensor([tokens], dtype="int64"))[0].numpy()
    w = 0.0
    for p in positions:
        got = served[(rid, p)]
        w = max(w, float(np.abs(got - ref[p]).max()))
        same += int(got.argmax() == ref[p].argmax())
        total += 1
    worst = max(worst, w)
    plen = len(PROMPTS[rid])
    per_request[rid] = dict(
        prompt=plen, hit=hits.get(rid, 0), first=positions[0], decode_steps=sum(p >= plen for p in positions),
        worst=w, preempted=rid in loop.preempted_ids,
    )
report(
    prefix_kept=prefix_kept, worst=worst, same_argmax=same, total=total, stats=stats, per_request=per_request,
    served=chat.served, served_metric=chat.served_metric, sim_steps=result.steps, finished=result.finished,
    preempted=result.preempted, requests=trace.requests,
    held_at_end=len(rec.manager.requests) if rec is not None else 0,
    left=len(rm.requests), backend=runner.model.backend.name,
)
"""

#: (preset, FastDeploy blocks): pools small enough that FastDeploy evicts cached blocks
CASES = [("tiny", 120), ("tiny-mimo", 120), ("tiny-headwise", 120)]
#: FastDeploy blocks with recycling on: small enough that the hook evicts cached entries (and preempts)
AUTO_BLOCKS = {"tiny": 64, "tiny-mimo": 64, "tiny-headwise": 48}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    pytest.importorskip("paddle", reason="the runner and minifleet need paddle")
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    root = tmp_path_factory.mktemp("prefixlogits")
    return {name: str(write_model_dir(name, root / name, dtype="float32", seed=0)) for name, _ in CASES}


def _run(model_dirs, preset: str, blocks: int, mode: str, system: int) -> dict:
    pytest.importorskip("safetensors")
    host = host_or_skip()
    script = (
        f"MODEL_DIR = {json.dumps(model_dirs[preset])}\nSEED = 11\nMODE = {mode!r}\nNUM_BLOCKS = {blocks}\n"
        f"SYSTEM = {system}\nVOCAB = 256\nOUTPUT_CACHING = False\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(SCENARIO)
    )
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_BACKEND": "reference", "FDFLEET_KV_RECYCLE": mode}
    return run_scenario(script, host=host, env=env, timeout=900).check().data


def _check(d: dict) -> None:
    per = d["per_request"]
    assert d["finished"] == d["requests"] == len(per) and d["left"] == 0 and d["held_at_end"] == 0, d
    assert d["backend"] == "reference"
    served_from_hit = {rid: r for rid, r in per.items() if r["hit"] > 0}
    # FastDeploy's own counts: requests served from a hit, their first computed position at the hit
    assert len(served_from_hit) >= 3, per
    assert sum(r["hit"] for r in per.values()) == d["served"] > 0 and d["served_metric"] >= d["served"]
    for rid, r in served_from_hit.items():
        # the cached positions were not recomputed (a preempted request starts over: FastDeploy keeps
        # the first admission's gpu_cache_token_num, and its re-admission may be served less)
        assert r["first"] == r["hit"] or (r["preempted"] and r["first"] < r["hit"]), (rid, r)
        assert r["decode_steps"] >= 64, (rid, r)
    assert d["stats"]["poisoned"] > 0 and d["stats"]["evicted"] > 0, d["stats"]
    assert d["total"] > 0 and d["same_argmax"] == d["total"], (d["same_argmax"], d["total"])
    assert d["worst"] <= 1e-5, d["worst"]


@pytest.mark.parametrize("preset, blocks", CASES[:1])
def test_fastdeploy_prefix_hits_give_scratch_logits(model_dirs, preset, blocks):
    """The reference side: FastDeploy's own prefix caching (recycling off) through the plugin's runner,
    on ``tiny`` (full, sliding and head-wise layers; per-layer caches of different shapes)."""
    d = _run(model_dirs, preset, blocks, "off", 24)
    print(preset, "off", d["worst"], d["stats"], d["sim_steps"], d["preempted"], d["per_request"])  # -rP
    _check(d)


@pytest.mark.parametrize("preset, blocks", CASES)
def test_prefix_hits_with_recycling_give_scratch_logits(model_dirs, preset, blocks):
    """Recycling on: chats without a shared system prompt, each turn served from its previous
    turn's cached path (history and the written reply); see the module docstring."""
    d = _run(model_dirs, preset, AUTO_BLOCKS[preset], "auto", 0)
    if not d["prefix_kept"]:
        pytest.skip(NOT_YET)
    print(preset, "auto", d["worst"], d["stats"], d["sim_steps"], d["preempted"], d["per_request"])  # -rP
    _check(d)
