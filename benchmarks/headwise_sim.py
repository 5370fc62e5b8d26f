"""Serving simulation at equal KV memory: no / layer-level / head-wise sliding-window recycling.

An event-driven simulation of one H200 serving a stream of requests with continuous batching and
chunked prefill. The KV cache is managed by the real ``HeadwiseKVManager``; only the GPU step is
modelled. Run ``python benchmarks/headwise_sim.py`` (about a minute on a laptop CPU) or with
``--quick`` / ``--smoke`` (a few seconds with an 8 GiB cache, used by the tests); ``--sweep`` adds
ERNIE-shaped variants with other head-wise ratios / windows. Outputs (``benchmarks/_outputs.py``):
without ``--out`` a fresh temporary directory; the committed ``results/headwise_sim.json`` is
rewritten only when ``--out`` names it (never by a quick run); the JSON and the plot replace their
files together, only once both are complete.

Step-time model (per step, one roofline per phase; figures from
``shared/anchors/h200-torch-2026-11-29.jsonl``: device copy 4231 GB/s, bf16 matmul 776 TFLOP/s,
causal flash-attention prefill 298 TFLOP/s)::

    t = overhead
      + max(weight_bytes_touched / BW, 2 * active_params * tokens / MATMUL)     # linear layers
      + max(kv_bytes_read_and_written / BW, attention_flops / ATTN)             # attention

* weights touched: dense params always; of the routed experts the expected fraction a step's
  ``T`` tokens hit, ``1 - (1 - k/E)^T`` (uniform routing).
* KV read: every query reads the keys visible to it under its head's window (a window-aware
  kernel skips the rest whether or not the pages were recycled), decode reads them once per
  token, a prefill chunk once per chunk. KV written: the step's new tokens.
* attention FLOPs: ``2 * (Dqk + Dv)`` per visible (query head, key) pair.
* ``overhead`` = 1 ms per step (scheduling, launches, sampling; CUDA graphs assumed).

Scheduler (FastDeploy ``ResourceManagerV1`` / SGLang style, the same for every mode): a token
budget of 8192 per step; running requests first in admission order (decode 1 token, or their
next prefill chunk); if the manager answers ``insufficient`` the newest running request is
preempted (its pages freed; it re-queues at the front and later recomputes prompt + generated
tokens). Then waiting requests are admitted FIFO while their chunk plus a reservation fits: the
pages every running request and the candidate will still need for the rest of its prefill and
``ratio x`` its remaining output (ratio 0.7 decaying to 0.1 over 600 steps, raised after a
preemption, output clipped at 4096: SGLang's defaults), counted
under the mode's release rule (``HeadwiseKVManager.held_pages``). Arrivals come at a fixed rate
("saturated": above every mode's service rate, so throughput is capacity; "moderate": below).
Throughput is reported over the whole run (all output tokens / first arrival to last finish,
as serving benchmarks do) and in steady state (between the 20% and 80% completion marks, which
leaves out the ramp-up and the drain); TTFT includes queueing.

Memory: 0.9 x 143771 MiB (an H200's nvidia-smi total) minus bf16 weights minus 4 GB activations
is the KV budget of every mode.
Groups get blocks from ``size_pools`` at the workload's mean final context length (for one-group
models, i.e. the head-wise ERNIE preset, this is just ``budget / bytes_per_block``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager, size_pools
from fastdeploy_paddlefleet.kvcache.layout import layer_bytes_per_token
from fastdeploy_paddlefleet.plan.config import plan_from_config
from fastdeploy_paddlefleet.presets import load_preset

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by file path (the tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import Refused, claim, fail, force_help, mark, output_path, plot_path, replacing  # noqa: E402

SCRIPT = "headwise_sim"  # the mark on what this script writes (benchmarks/_outputs.py)

logger = logging.getLogger("headwise_sim")

# H200 figures (anchors file, measured with torch on the lent H200)
BW = 4231.1e9  # bytes/s, device copy
MATMUL = 776.5e12  # FLOP/s, bf16 matmul
ATTN = 298.0e12  # FLOP/s, causal flash-attention prefill (S=8192)
HBM = 143771 * 2**20  # bytes, nvidia-smi total of an H200 (141 GB class)
GPU_UTIL = 0.9
ACTIVATIONS = 4e9
OVERHEAD_S = 1e-3
# admission reservation (SGLang defaults, which FastDeploy's V1 scheduler follows)
INIT_RATIO, MIN_RATIO, RATIO_DECAY = 0.7, 0.1, (0.7 - 0.1) / 600
CLIP_NEW_TOKENS = 4096
KV_DTYPE_BYTES = 2  # bf16 cache

# Assumed model sizes (model cards): total / active params, routed experts and top-k; bf16 weights.
MODELS = {
    "ernie-4.5-21b-a3b-headwise": {"total": 21.8e9, "active": 3.0e9, "experts": 64, "top_k": 6},
    "gpt-oss-20b": {"total": 20.9e9, "active": 3.6e9, "experts": 32, "top_k": 4},
}
WEIGHT_BYTES = 2
SHORT = {"ernie-4.5-21b-a3b-headwise": "ERNIE-4.5-21B-A3B (hw)", "gpt-oss-20b": "gpt-oss-20b"}

# (input, output) lengths cycled over the requests
WORKLOADS = {
    "long": [(10240, 4096)],
    "short": [(1024, 256), (2048, 1024), (4096, 512)],
}
# (workload, load, arrivals per second, requests, requests with --quick or 0 to skip)
SCENARIOS = [
    ("long", "saturated", 4.0, 1200, 40),
    ("long", "moderate", 0.8, 200, 0),
    ("short", "saturated", 40.0, 1500, 120),
]
QUICK_KV_BYTES = 8 * 2**30  # --quick: a small cache so that a few requests fill it
# ERNIE-shaped variants for the sensitivity sweep: (head_wise_swa_ratio, sliding_window)
SWEEP = [(0.5, 4096), (0.5, 1024), (0.75, 4096), (0.75, 1024)]


@dataclass
class Model:
    """Per-preset cost coefficients derived from the plan."""

    name: str
    plan: Any
    dense_bytes: float
    expert_bytes: float
    hit: float  # k / E
    active: float
    full_kv: float  # bytes per token of all full heads (all layers)
    sliding_kv: dict[int, float]  # window_left -> bytes per token of heads with that window
    full_flops: float  # attention FLOPs per (query, key) over full heads' query heads
    sliding_flops: dict[int, float]
    bytes_per_token: int


def build_model(name: str, overrides: dict[str, Any] | None = None) -> Model:
    """Cost coefficients of preset ``name`` (``overrides``: config fields to replace)."""
    plan = plan_from_config({**load_preset(name), **(overrides or {})})
    m = MODELS[name]
    hit = m["top_k"] / m["experts"]
    expert = (m["total"] - m["active"]) / (1 - hit)
    full_kv, full_fl = 0.0, 0.0
    sl_kv: dict[int, float] = {}
    sl_fl: dict[int, float] = {}
    for layer in plan:
        per_head = (layer.qk_head_dim + layer.v_head_dim) * KV_DTYPE_BYTES
        flops_head = 2 * (layer.qk_head_dim + layer.v_head_dim) * layer.group_size
        for h in range(layer.num_kv_heads):
            w = layer.head_window(h)
            if w is None:
                full_kv += per_head
                full_fl += flops_head
            else:
                sl_kv[w] = sl_kv.get(w, 0.0) + per_head
                sl_fl[w] = sl_fl.get(w, 0.0) + flops_head
    bpt = sum(layer_bytes_per_token(layer, "bf16") for layer in plan)
    return Model(
        name,
        plan,
        (m["total"] - expert) * WEIGHT_BYTES,
        expert * WEIGHT_BYTES,
        hit,
        m["active"],
        full_kv,
        sl_kv,
        full_fl,
        sl_fl,
        bpt,
    )


def _keys_sum(start: int, count: int, window: int | None) -> float:
    """Sum over queries ``i in [start, start+count)`` of visible keys ``min(i + 1, window + 1)``."""
    a, b = start + 1, start + count  # visible keys of the first / last query without a window
    if window is None or b <= window + 1:
        return (a + b) * count / 2
    if a > window + 1:
        return (window + 1) * count
    return (a + window + 1) * (window + 1 - a + 1) / 2 + (window + 1) * (b - window - 1)


def step_time(model: Model, decode_ctx: list[int], chunks: list[tuple[int, int]]) -> float:
    """Seconds for one step: ``decode_ctx`` = cache length (incl. the new token) of each decode,
    ``chunks`` = ``(start, count)`` of each prefill chunk."""
    tokens = len(decode_ctx) + sum(c for _, c in chunks)
    weights = model.dense_bytes + model.expert_bytes * (1 - (1 - model.hit) ** tokens)
    linear = max(weights / BW, 2 * model.active * tokens / MATMUL)
    ctx = np.asarray(decode_ctx, dtype=np.int64)
    keys = int(ctx.sum())
    kv, flops = model.full_kv * keys, model.full_flops * keys
    for w, b in model.sliding_kv.items():
        keys = int(np.minimum(ctx, w + 1).sum())
        kv += b * keys
        flops += model.sliding_flops[w] * keys
    for s, c in chunks:
        kv += model.full_kv * (s + c)
        flops += model.full_flops * _keys_sum(s, c, None)
        for w, b in model.sliding_kv.items():
            kv += b * (s + c - max(0, s - w))
            flops += model.sliding_flops[w] * _keys_sum(s, c, w)
    kv += model.bytes_per_token * tokens  # writes
    return OVERHEAD_S + linear + max(kv / BW, flops / ATTN)


class Req:
    __slots__ = ("rid", "arrival", "prompt", "out", "ctx", "target", "gen", "first", "done")

    def __init__(self, rid: int, arrival: float, prompt: int, out: int) -> None:
        self.rid, self.arrival, self.prompt, self.out = rid, arrival, prompt, out
        self.ctx = 0  # KV slots (= manager tokens)
        self.target = prompt  # prefill target: prompt, or prompt + generated after a preemption
        self.gen = 0
        self.first = None
        self.done = None


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def kv_budget_bytes(model: Model) -> int:
    """KV bytes left on one H200 after the weights and an activation reserve."""
    return int(GPU_UTIL * HBM - model.dense_bytes - model.expert_bytes - ACTIVATIONS)


def simulate(
    model: Model,
    mode: str,
    lengths: list[tuple[int, int]],
    rate: float,
    n_requests: int,
    budget: int,
    block_size: int = 64,
    max_batched: int = 8192,
    max_seqs: int = 512,
) -> dict[str, Any]:
    """Serve ``n_requests`` arriving at ``rate``/s (lengths cycled) with ``budget`` KV bytes."""
    mean_final = sum(i + o for i, o in lengths) / len(lengths)
    probe = HeadwiseKVManager(model.plan, 0, block_size, mode=mode)
    block_bytes = {
        g.index: sum(layer_bytes_per_token(model.plan[li], "bf16") for li in g.layers) * block_size
        for g in probe.groups
    }
    blocks = size_pools(probe.groups, budget, block_bytes, block_size, int(mean_final), max_batched)
    mgr = HeadwiseKVManager(model.plan, blocks, block_size, mode=mode)
    used_bytes = sum(b * block_bytes[g.index] for g, b in zip(mgr.groups, blocks, strict=True))
    lanes = [[(w, c * g.unit) for w, c in Counter(g.lanes).items()] for g in mgr.groups]

    def held(n: Any, c: Any) -> list[Any]:
        """Pages per group that requests with ``n`` cached tokens (``c`` computed) hold."""
        blocks = -(-n // block_size)
        return [
            sum(
                blocks * u
                if w is None
                else (blocks - np.minimum(blocks, np.maximum(0, c - w) // block_size)) * u
                for w, u in group
            )
            for group in lanes
        ]

    reqs = [Req(i, i / rate, *lengths[i % len(lengths)]) for i in range(n_requests)]
    waiting: deque[Req] = deque()
    running: list[Req] = []
    t, nxt, finished, steps, preemptions, max_conc, out_tokens = 0.0, 0, 0, 0, 0, 0, 0
    ratio = INIT_RATIO
    timeline: list[tuple[float, int, int]] = []  # (time, running, cumulative output tokens)

    def future(r: Req, ctx: int) -> int:
        """Tokens ``r`` is expected to add: the rest of its prefill + ratio x its remaining output."""
        return max(0, r.target - ctx) + math.ceil(ratio * min(r.out - r.gen, CLIP_NEW_TOKENS))

    while finished < n_requests:
        while nxt < n_requests and reqs[nxt].arrival <= t:
            waiting.append(reqs[nxt])
            nxt += 1
        if not running and not waiting:
            t = reqs[nxt].arrival
            continue
        ratio = max(MIN_RATIO, ratio - RATIO_DECAY)
        budget_left = max_batched
        sched: list[tuple[Req, int]] = []
        i = 0
        while i < len(running) and budget_left > 0:
            r = running[i]
            n = min(r.target - r.ctx, budget_left) if r.ctx < r.target else 1
            while not mgr.append(r.rid, n, computed=mgr.num_tokens(r.rid)):
                victim = running.pop()
                mgr.preempt(victim.rid)
                victim.ctx, victim.target = 0, victim.prompt + victim.gen
                waiting.appendleft(victim)
                preemptions += 1
                dec = [q for q in running if q.ctx >= q.target]
                if dec:  # SGLang's retraction update: reserve more for the survivors
                    ratio = min(
                        1.0, (sum(q.gen for q in dec) + 20 * len(dec)) / (sum(q.out for q in dec) + 1)
                    )
                if victim is r:
                    break
            else:
                sched.append((r, n))
                budget_left -= n
                i += 1
                continue
            break
        if waiting and budget_left > 0 and len(running) < max_seqs:
            # admission reserves room for what running requests will still add (FastDeploy V1 /
            # SGLang style), counted in pages under this mode's release rule
            k = len(sched)
            n_now = np.array([r.ctx + n for r, n in sched] + [r.ctx for r in running[k:]], dtype=np.int64)
            prefill_left = np.array([r.target for r in running], dtype=np.int64) - n_now
            out_left = np.array([r.out - r.gen for r in running], dtype=np.int64)
            grow = np.maximum(0, prefill_left) + np.ceil(
                ratio * np.minimum(out_left, CLIP_NEW_TOKENS)
            ).astype(np.int64)
            reserve = (
                [
                    int((a - b).sum())
                    for a, b in zip(held(n_now + grow, n_now + grow), held(n_now, n_now), strict=True)
                ]
                if len(running)
                else [0] * len(lanes)
            )
            free = [mgr.group_free_pages(g.index) for g in mgr.groups]
            while waiting and budget_left > 0 and len(running) < max_seqs:
                r = waiting[0]
                n = min(r.target, budget_left)
                total = n + future(r, n)
                now, later = held(np.int64(n), np.int64(0)), held(np.int64(total), np.int64(total))
                need = [int(a) for a in now]
                extra = [max(0, int(b) - int(a)) for a, b in zip(now, later, strict=True)]
                if any(nd + ex + res > f for nd, ex, res, f in zip(need, extra, reserve, free, strict=True)):
                    break
                if r.rid not in mgr:
                    mgr.admit(r.rid)
                if not mgr.append(r.rid, n, computed=mgr.num_tokens(r.rid)):
                    raise RuntimeError(f"admission check passed but append failed for request {r.rid}")
                free = [f - nd for f, nd in zip(free, need, strict=True)]
                reserve = [res + ex for res, ex in zip(reserve, extra, strict=True)]
                waiting.popleft()
                running.append(r)
                sched.append((r, n))
                budget_left -= n
        if not sched:  # nothing fits (a single request larger than the pool): give up loudly
            raise ValueError(f"request {waiting[0].rid} cannot be scheduled in an empty {mode} pool")
        decode_ctx, chunks = [], []
        for r, n in sched:
            if r.ctx >= r.target:
                decode_ctx.append(r.ctx + n)
            else:
                chunks.append((r.ctx, n))
            r.ctx += n
        t += step_time(model, decode_ctx, chunks)
        steps += 1
        max_conc = max(max_conc, len(running))
        for r, _ in sched:  # the step ran: release what no later query sees
            mgr.release(r.rid, mgr.num_tokens(r.rid))
        emitted = 0
        done_ids = set()
        for r, _ in sched:
            if r.ctx >= r.target:  # prefill complete (or decode): one token out
                r.gen += 1
                emitted += 1
                if r.first is None:
                    r.first = t
                if r.gen >= r.out:
                    r.done = t
                    mgr.finish(r.rid)
                    done_ids.add(r.rid)
                    finished += 1
        out_tokens += emitted
        running = [r for r in running if r.rid not in done_ids]
        if steps % 8 == 0 or finished == n_requests:
            timeline.append((t, len(running), out_tokens))
    stride = max(1, len(timeline) // 200)
    sampled = timeline[::stride] + ([timeline[-1]] if (len(timeline) - 1) % stride else [])
    if mgr.free_pages != mgr.total_pages:
        raise RuntimeError(f"leak: {mgr.total_pages - mgr.free_pages} pages still used after the run")

    start = reqs[0].arrival
    done = sorted(r.done for r in reqs)
    lo, hi = done[n_requests // 5], done[(4 * n_requests) // 5]
    tok_at = _interp(timeline)
    ttft = [r.first - r.arrival for r in reqs]
    total_tp = sum(r.out for r in reqs) / (done[-1] - start)
    return {
        "mode": mode,
        "requests": n_requests,
        "rate_per_s": rate,
        "kv_budget_bytes": budget,
        "kv_used_bytes": used_bytes,
        "blocks_per_group": blocks,
        "pages_total": mgr.total_pages,
        "duration_s": done[-1] - start,
        "output_tokens": out_tokens,
        "output_throughput": total_tp,
        "steady_output_throughput": (tok_at(hi) - tok_at(lo)) / (hi - lo) if hi > lo else total_tp,
        "max_concurrency": max_conc,
        "mean_concurrency": sum(c for _, c, _ in timeline) / max(1, len(timeline)),
        "capacity_at_final_len": capacity(model, mode, blocks, block_size, lengths, max_batched),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "preemptions": preemptions,
        "steps": steps,
        "timeline": [[round(a, 3), b] for a, b, _ in sampled],
    }


def _interp(timeline: list[tuple[float, int, int]]):
    import bisect

    times = [a for a, _, _ in timeline]

    def at(x: float) -> float:
        k = bisect.bisect_left(times, x)
        return timeline[min(k, len(timeline) - 1)][2]

    return at


def capacity(model: Model, mode: str, blocks: list[int], block_size: int, lengths, chunk: int) -> int:
    """Requests at their final length that fit at once (prefilled in chunks, then decoded)."""
    mgr = HeadwiseKVManager(model.plan, blocks, block_size, mode=mode)
    k = 0
    while True:
        prompt, out = lengths[k % len(lengths)]
        mgr.admit(k)
        left = prompt + out - 1
        while left:
            n = min(left, chunk)
            if not mgr.append(k, n, computed=mgr.num_tokens(k)):
                return k
            mgr.release(k, mgr.num_tokens(k))
            left -= n
        k += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "model": {
            "bandwidth_Bps": BW,
            "matmul_flops": MATMUL,
            "attention_flops": ATTN,
            "anchors": "shared/anchors/h200-torch-2026-11-29.jsonl (copy, matmul_bf16, sdpa flash)",
            "hbm_bytes": HBM,
            "gpu_memory_utilization": GPU_UTIL,
            "activation_reserve_bytes": ACTIVATIONS,
            "step_overhead_s": OVERHEAD_S,
            "weight_bytes_per_param": WEIGHT_BYTES,
            "kv_dtype_bytes": KV_DTYPE_BYTES,
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_batched,
            "max_num_seqs": args.max_seqs,
            "admission_watermark": 0.01,
            "models": MODELS,
        },
        "quick": args.quick,
        "workloads": WORKLOADS,
        "runs": [],
    }

    def case(preset: str, model: Model, workload: str, load: str, rate: float, n: int, modes) -> list:
        budget = QUICK_KV_BYTES if args.quick else kv_budget_bytes(model)
        out, base = [], None
        for mode in modes:
            t0 = time.perf_counter()
            r = simulate(
                model,
                mode,
                WORKLOADS[workload],
                rate,
                n,
                budget,
                args.block_size,
                args.max_batched,
                args.max_seqs,
            )
            r.update(
                preset=preset, workload=workload, load=load, sim_wall_s=round(time.perf_counter() - t0, 2)
            )
            base = base or r
            r["throughput_gain_vs_none"] = r["output_throughput"] / base["output_throughput"] - 1
            r["steady_gain_vs_none"] = r["steady_output_throughput"] / base["steady_output_throughput"] - 1
            out.append(r)
            logger.info(
                "%s %s/%s %-8s out %.0f tok/s (%+.1f%%) steady %.0f (%+.1f%%) max conc %d ttft p50 %.1fs "
                "preempt %d [%.1fs]",
                preset,
                workload,
                load,
                mode,
                r["output_throughput"],
                100 * r["throughput_gain_vs_none"],
                r["steady_output_throughput"],
                100 * r["steady_gain_vs_none"],
                r["max_concurrency"],
                r["ttft_p50_s"],
                r["preemptions"],
                r["sim_wall_s"],
            )
        return out

    for preset in args.presets:
        model = build_model(preset)
        for workload, load, rate, n, n_quick in SCENARIOS:
            n = n_quick if args.quick else n
            if n:
                results["runs"] += case(preset, model, workload, load, rate, n, ("none", "layer", "headwise"))
    ernie = "ernie-4.5-21b-a3b-headwise"
    hits = [
        r
        for r in results["runs"]
        if (r["preset"], r["workload"], r["load"], r["mode"]) == (ernie, "long", "saturated", "headwise")
    ]
    if hits:
        results["target"] = {
            "what": "output throughput, head-wise vs no recycling, ERNIE head-wise preset, 10k/4k, saturated",
            "gain_total": hits[0]["throughput_gain_vs_none"],
            "gain_steady": hits[0]["steady_gain_vs_none"],
            "goal": 0.60,
            "community_gate": 0.30,
            "met": hits[0]["steady_gain_vs_none"] >= 0.60 and hits[0]["throughput_gain_vs_none"] >= 0.60,
        }
    if args.sweep and not args.quick and ernie in args.presets:
        results["sweep"] = []
        preset = load_preset(ernie)
        for ratio, window in SWEEP:
            if (ratio, window) == (preset["head_wise_swa_ratio"], preset["sliding_window"]):
                pair = [
                    next(
                        r
                        for r in results["runs"]
                        if r["preset"] == ernie
                        and r["workload"] == "long"
                        and r["load"] == "saturated"
                        and r["mode"] == m
                    )
                    for m in ("none", "headwise")
                ]
            else:
                model = build_model(ernie, {"head_wise_swa_ratio": ratio, "sliding_window": window})
                pair = case(
                    f"{ernie} r={ratio} w={window}",
                    model,
                    "long",
                    "saturated",
                    4.0,
                    1200,
                    ("none", "headwise"),
                )
            results["sweep"].append(
                {
                    "head_wise_swa_ratio": ratio,
                    "sliding_window": window,
                    "output_throughput_none": pair[0]["output_throughput"],
                    "output_throughput_headwise": pair[1]["output_throughput"],
                    "max_concurrency_none": pair[0]["max_concurrency"],
                    "max_concurrency_headwise": pair[1]["max_concurrency"],
                    "gain_total": pair[1]["throughput_gain_vs_none"],
                    "gain_steady": pair[1]["steady_gain_vs_none"],
                    "capacity_none": pair[0]["capacity_at_final_len"],
                    "capacity_headwise": pair[1]["capacity_at_final_len"],
                }
            )
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    modes = ["none", "layer", "headwise"]
    colors = {"none": "#888888", "layer": "#4c72b0", "headwise": "#dd8452"}

    def get(case, mode):
        return next(r for r in runs if (r["preset"], r["workload"], r["load"]) == case and r["mode"] == mode)

    def bars(ax, cases, metric, label, gain=None):
        for j, mode in enumerate(modes):
            rs = [get(c, mode) for c in cases]
            xs = [i + (j - 1) * 0.27 for i in range(len(cases))]
            bs = ax.bar(xs, [r[metric] for r in rs], 0.27, label=mode, color=colors[mode])
            for b, r in zip(bs, rs, strict=True):
                text = f"{100 * r[gain]:+.0f}%" if gain else f"{r[metric]:.0f}"
                ax.annotate(
                    text,
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{SHORT.get(p, p)}\n{w} ({ld})" for p, w, ld in cases], fontsize=7)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)

    sat = list(
        dict.fromkeys((r["preset"], r["workload"], r["load"]) for r in runs if r["load"] == "saturated")
    )
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    bars(axes[0, 0], sat, "output_throughput", "output tokens/s (all / duration)", "throughput_gain_vs_none")
    bars(axes[0, 1], sat, "steady_output_throughput", "output tokens/s (steady state)", "steady_gain_vs_none")
    bars(axes[0, 2], sat, "max_concurrency", "max running requests")
    bars(axes[1, 0], sat, "ttft_p50_s", "TTFT p50 (s, includes queueing)")
    ax = axes[1, 1]
    for r in runs:
        if r["preset"].startswith("ernie") and (r["workload"], r["load"]) == ("long", "saturated"):
            ax.plot(
                [a for a, _ in r["timeline"]],
                [b for _, b in r["timeline"]],
                label=r["mode"],
                color=colors[r["mode"]],
                linestyle="--" if r["mode"] == "layer" else "-",
            )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("running requests")
    ax.set_title("ERNIE head-wise preset, 10k in / 4k out, saturated", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    sweep = results.get("sweep") or []
    if sweep:
        labels = [f"ratio {e['head_wise_swa_ratio']}\nwindow {e['sliding_window']}" for e in sweep]
        xs = range(len(sweep))
        for off, key, name in [(-0.2, "gain_total", "all / duration"), (0.2, "gain_steady", "steady state")]:
            bs = ax.bar([x + off for x in xs], [100 * e[key] for e in sweep], 0.4, label=name)
            for b, e in zip(bs, sweep, strict=True):
                ax.annotate(
                    f"{100 * e[key]:+.0f}%", (b.get_x() + 0.2, b.get_height()), ha="center", fontsize=7
                )
        ax.axhline(60, color="k", linestyle=":", linewidth=1)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("head-wise vs none throughput gain (%)")
        ax.set_title("ERNIE shapes: other head-wise ratios / windows (dotted: +60% goal)", fontsize=9)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.suptitle(
        "KV recycling at equal KV memory, one H200 (simulated step times; see docs/kvcache.md)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Needs the plugin and numpy (matplotlib for the plot); no GPU, no FastDeploy.",
    )
    p.add_argument(
        "--quick", "--smoke", action="store_true", help="few requests and an 8 GiB cache: a smoke test"
    )
    p.add_argument("--sweep", action="store_true", help="also sweep ERNIE head-wise ratio / window")
    p.add_argument("--presets", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-batched", type=int, default=8192)
    p.add_argument("--max-seqs", type=int, default=512)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: a new temporary directory; the committed results/headwise_sim.json "
        "only when named here, never with --quick)",
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG / SVG / PDF path (default: --out with .png)")
    p.add_argument("--json", action="store_true", help="print the summary (target, sweep) as JSON")
    p.add_argument("--force", action="store_true", help=force_help("the --out and --plot files"))
    args = p.parse_args(argv)
    try:
        out = output_path(
            args.out, name="headwise_sim.json", suffixes=(".json",), what="JSON", smoke=args.quick
        )
        png = plot_path(args.plot, out, smoke=args.quick)
        out_claim = claim(out, script=SCRIPT, force=args.force)
        png_claim = claim(png, script=SCRIPT, force=args.force, flag="--plot", beside=out)
    except ValueError as e:
        return fail(e)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    results = run(args)
    try:
        with replacing(out_claim) as tmp_json, replacing(png_claim) as tmp_png:  # both files or neither
            tmp_json.write_text(json.dumps(mark(results, SCRIPT), indent=1) + "\n")
            plot(results, tmp_png)
    except Refused as e:
        return fail(e)
    except OSError as e:
        print(f"error: writing {out} and {png} failed ({e}); both were left as they were", file=sys.stderr)
        return 1
    logging.getLogger(__name__).info("wrote %s and %s", out, png)
    if args.json:
        json.dump({k: results[k] for k in ("target", "sweep") if k in results}, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
