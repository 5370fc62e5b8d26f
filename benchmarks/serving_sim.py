"""FastDeploy's real scheduler driving a step-time model: FastDeploy's KV accounting vs window recycling.

Both modes run FastDeploy's own ``ResourceManagerV1.schedule()`` (the host's real code, located by
``FDFLEET_HOST_FASTDEPLOY`` or an installed ``fastdeploy``) over the same requests and the same KV
bytes: ``fastdeploy`` is its one block pool (``FDFLEET_KV_RECYCLE=off``), ``recycling`` is the
plugin's hook (installed by the plugin's own early hook with ``FD_PLUGINS=paddlefleet``) routing
the block calls to per-group pools with window recycling. The worker is simulated
(``tests/hosts/_scheduler_sim.py``: tasks pickled, deltas applied, one forward per step) and each
forward is priced with the step-time model of ``headwise_sim.py`` (one roofline per phase: weights
read once per step, attention bytes and FLOPs per visible key, H200 figures; see its docstring).
The attention roofline is checked against the measured H200 decode bandwidth in
``results/attention-h200.jsonl`` (the model's ``BW`` must not exceed what the kernels reached).

Workload per (model, context): every request arrives at time 0 (saturated), prompt
``context - output`` tokens, ``output`` tokens generated; FastDeploy settings: block 64,
``max_num_batched_tokens`` 8192, ``max_num_seqs`` 512. KV budget: 0.9 x an H200's memory minus
bf16 weights minus 4 GB, the same for both modes (FastDeploy's ``num_gpu_blocks`` at per-layer
block bytes). Reported: peak concurrent running requests, output tokens/s over the run, TTFT p50 /
p99 (queueing included).

Model sizes (weights): gpt-oss-20b and ERNIE-4.5-21B-A3B as in ``headwise_sim.py``; Gemma-3-27B
27.4B dense; MiMo-V2-Flash-like is one GPU's share of an 8-way expert-parallel deployment (each GPU
serves its own requests with every attention head; 1/8 of the 256 experts, top-8): 5.3B dense +
38.6B of experts, 15B active per token. These are stated assumptions, not measurements.

Run ``python benchmarks/serving_sim.py --out benchmarks/results/serving_sim.json`` (minutes) or
``--smoke`` (seconds, tiny workload, written to a temporary directory: never the committed results).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for extra in (HERE, REPO / "tests" / "hosts"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from _outputs import output_path, plot_path, replacing  # noqa: E402

logger = logging.getLogger("serving_sim")

MODELS_EXTRA = {
    # dense: no routed experts (headwise_sim's formula needs top_k < experts; 0 expert bytes)
    "gemma3-27b": {"total": 27.4e9, "active": 27.4e9, "experts": 2, "top_k": 1},
    "mimo-v2-flash-like": {"total": 43.9e9, "active": 15.0e9, "experts": 256, "top_k": 8},
}
PRESETS = ["gpt-oss-20b", "mimo-v2-flash-like", "gemma3-27b", "ernie-4.5-21b-a3b-headwise"]
# (context, output tokens, requests)
CONTEXTS = [(8192, 1024, 0), (32768, 1024, 0)]
# decode-heavy: 1024-token prompts, the rest of the context generated, for the two models with a
# throughput target (saturated like the prefill-heavy workload: twice what the recycling pools hold)
DECODE_HEAVY = {"presets": ["gpt-oss-20b", "mimo-v2-flash-like"], "context": 8192, "prompt": 1024}
SMOKE = {"presets": ["gpt-oss-20b"], "contexts": [(2048, 64, 24)], "budget": 1 << 30}
BLOCK, BATCHED, MAX_SEQS = 64, 8192, 512


def _host_path() -> None:
    """Put FastDeploy (``FDFLEET_HOST_FASTDEPLOY``) first on ``sys.path``; plugins on."""
    host = os.environ.get("FDFLEET_HOST_FASTDEPLOY", "").strip()
    if host:
        sys.path.insert(0, str(Path(host).expanduser()))
    os.environ.setdefault("FD_PLUGINS", "paddlefleet")


def measured_decode_gbps(path: Path = HERE / "results" / "attention-h200.jsonl") -> float:
    """The best decode bandwidth the H200 attention benchmark measured (GB/s)."""
    best = 0.0
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "decode" and "gbps" in row:
                best = max(best, float(row["gbps"]))
    return best


def _key(row: dict[str, Any]) -> tuple:
    return (row.get("workload", "prefill-heavy"), row["model"], row["context"], row["mode"])


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def run_one(
    name: str, ctx: int, out: int, n_req: int, mode: str, budget: int | None, work: Path
) -> dict[str, Any]:
    import headwise_sim as hs
    from _scheduler_sim import Sim, make_config, make_manager, make_trace, recycler_of

    from fastdeploy_paddlefleet.kvcache.pools import split_kv_pools
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.presets import load_preset
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    for key, value in MODELS_EXTRA.items():
        hs.MODELS.setdefault(key, value)
    model = hs.build_model(name)
    kv_bytes = hs.kv_budget_bytes(model) if budget is None else budget
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(load_preset(name)))
    plan = plan_from_config(str(d))
    fd_block = split_kv_pools(plan, kv_bytes, BLOCK, ctx + 512).fastdeploy_block_bytes
    num_blocks = kv_bytes // fd_block
    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        write_model_dir("tiny", tiny, dtype="float32", seed=5)
    os.environ["FDFLEET_KV_RECYCLE"] = "auto" if mode == "recycling" else "off"
    cfg = make_config(
        str(tiny),
        max_model_len=ctx + 512,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BATCHED,
        block_size=BLOCK,
        num_blocks=int(num_blocks),
    )
    rm = make_manager(cfg, str(d))
    if (recycler_of(rm) is not None) != (mode == "recycling"):
        raise RuntimeError(f"{name}: mode {mode} but recycler {recycler_of(rm)!r}")
    sim = Sim(rm, 0, check=False, step_time=lambda dec, ch: hs.step_time(model, dec, ch))
    t0 = time.time()
    st = sim.run(make_trace(11, n_req, (ctx - out, ctx - out), (out, out), 0), 10**7)
    return {
        "model": name,
        "context": ctx,
        "output": out,
        "requests": n_req,
        "mode": mode,
        "kv_bytes": kv_bytes,
        "num_gpu_blocks": int(num_blocks),
        "pools": recycler_of(rm).split.num_blocks if recycler_of(rm) else [int(num_blocks)],
        "peak_running": st.peak_running,
        "steps": st.steps,
        "output_tokens": st.tokens,
        "seconds_simulated": sim.clock,
        "tokens_per_s": st.tokens / sim.clock if sim.clock else 0.0,
        "ttft_p50_s": _pct(st.ttft, 0.5),
        "ttft_p99_s": _pct(st.ttft, 0.99),
        "preempted": st.preempted,
        "wall_s": round(time.time() - t0, 2),
    }


SHORT = {
    "gpt-oss-20b": "gpt-oss-20b",
    "mimo-v2-flash-like": "MiMo-like",
    "gemma3-27b": "Gemma-3-27B",
    "ernie-4.5-21b-a3b-headwise": "ERNIE hw",
}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Recycling / FastDeploy's accounting per (model, context): tokens/s, peak running, TTFT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {m: i for i, m in enumerate(PRESETS)}
    keys = sorted(
        {(r.get("workload", "prefill-heavy"), r["model"], r["context"]) for r in rows},
        key=lambda k: (k[0] != "prefill-heavy", order.get(k[1], 9), k[2]),
    )
    by = {_key(r): r for r in rows}
    labels = [f"{SHORT.get(m, m)} {c // 1024}k" + (" dec" if w == "decode-heavy" else "") for w, m, c in keys]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = (
        ("tokens_per_s", "output tokens/s, recycling / FastDeploy", 1.6),
        ("peak_running", "peak running requests, recycling / FastDeploy", None),
        ("ttft_p50_s", "TTFT p50, recycling / FastDeploy (lower is better)", None),
    )
    for ax, (metric, title, target) in zip(axes, panels, strict=True):
        vals = [
            by[(w, m, c, "recycling")][metric] / max(1e-12, by[(w, m, c, "fastdeploy")][metric])
            for w, m, c in keys
        ]
        bars = ax.bar(range(len(keys)), vals, color="tab:orange")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8)
        if target:
            ax.axhline(
                target, color="tab:red", ls="--", lw=0.8, label=f"x{target} target (gpt-oss, MiMo at 8k)"
            )
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(keys)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle(
        "FastDeploy's real scheduler, same KV bytes: window recycling vs FastDeploy's accounting "
        "(H200 step model)",
        fontsize=10,
    )
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default: a fresh temporary directory)")
    p.add_argument("--plot", help="plot path (default: the JSON path with .png)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds); never the committed results")
    p.add_argument("--models", nargs="*", default=None, help=f"presets (default {PRESETS})")
    p.add_argument("--json", action="store_true", help="print the JSON summary on stdout")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of an earlier run's JSON")
    p.add_argument(
        "--workload",
        choices=("prefill-heavy", "decode-heavy", "all"),
        default="all",
        help="prefill-heavy: prompt = context - 1024, 1024 generated (4 models, 8k and 32k); "
        "decode-heavy: 1024-token prompts, the rest generated (gpt-oss, MiMo-like at 8k); default all",
    )
    p.add_argument("--merge", metavar="JSON", help="keep an earlier run's rows that this run does not redo")
    args = p.parse_args(argv)
    if args.replot:
        rows = json.loads(Path(args.replot).read_text())["rows"]
        png = plot_path(args.plot, Path(args.replot), smoke=False)
        plot(rows, png)
        print(json.dumps({"plot": str(png)}) if args.json else f"wrote {png}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    out = output_path(args.out, name="serving_sim.json", suffixes=(".json",), what="JSON", smoke=args.smoke)
    png = plot_path(args.plot, out, smoke=args.smoke)
    _host_path()
    import fastdeploy  # noqa: F401  (loads the plugin's early hook, which patches the scheduler)
    from tqdm import tqdm

    from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import install

    if not install():
        raise SystemExit("FastDeploy's ResourceManagerV1 could not be imported (set FDFLEET_HOST_FASTDEPLOY)")
    presets = SMOKE["presets"] if args.smoke else (args.models or PRESETS)
    contexts = SMOKE["contexts"] if args.smoke else CONTEXTS
    budget = SMOKE["budget"] if args.smoke else None
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="fdfleet-serving-sim-"))
    jobs = []
    if args.workload in ("prefill-heavy", "all"):
        jobs += [("prefill-heavy", m, c, o, n) for m in presets for c, o, n in contexts]
    if args.workload in ("decode-heavy", "all") and not args.smoke:
        c = DECODE_HEAVY["context"]
        jobs += [("decode-heavy", m, c, c - DECODE_HEAVY["prompt"], 0) for m in DECODE_HEAVY["presets"]]
    rows = json.loads(Path(args.merge).read_text())["rows"] if args.merge else []
    for r in rows:
        r.setdefault("workload", "prefill-heavy")
    from fastdeploy_paddlefleet.kvcache.pools import split_kv_pools
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.presets import load_preset

    for workload, name, ctx, o, n in tqdm(jobs, desc="serving sim", disable=args.json):
        if n <= 0:  # 0: twice what the recycling pools hold at this context (saturated); -1: once
            import headwise_sim as hs

            for key, value in MODELS_EXTRA.items():
                hs.MODELS.setdefault(key, value)
            split = split_kv_pools(
                plan_from_config(load_preset(name)),
                hs.kv_budget_bytes(hs.build_model(name)),
                BLOCK,
                ctx + 512,
                MAX_SEQS,
                max_num_batched_tokens=BATCHED,
            )
            n = max(16, min((2 if n == 0 else 1) * split.max_requests, 2 * MAX_SEQS))
        for mode in ("fastdeploy", "recycling"):
            row = {"workload": workload, **run_one(name, ctx, o, n, mode, budget, work)}
            rows = [r for r in rows if _key(r) != _key(row)] + [row]
    gains = {}
    for workload, name, ctx in sorted({(r["workload"], r["model"], r["context"]) for r in rows}):
        fd = next(r for r in rows if _key(r) == (workload, name, ctx, "fastdeploy"))
        rc = next(r for r in rows if _key(r) == (workload, name, ctx, "recycling"))
        suffix = "" if workload == "prefill-heavy" else f" {workload}"
        gains[f"{name}@{ctx}{suffix}"] = {
            "tokens_per_s_gain": rc["tokens_per_s"] / fd["tokens_per_s"] - 1 if fd["tokens_per_s"] else None,
            "concurrency_ratio": rc["peak_running"] / max(1, fd["peak_running"]),
        }
    import headwise_sim as hs

    result = {
        "meta": {
            "smoke": args.smoke,
            "block_size": BLOCK,
            "max_num_batched_tokens": BATCHED,
            "max_num_seqs": MAX_SEQS,
            "bw_model_gbps": hs.BW / 1e9,
            "attention_h200_decode_gbps_measured": measured_decode_gbps(),
            "models_extra": MODELS_EXTRA,
        },
        "rows": rows,
        "gains": gains,
    }
    with replacing(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, png)
    if args.json:
        print(json.dumps(result))
    else:
        for key, g in gains.items():
            print(f"{key}: tokens/s {g['tokens_per_s_gain']:+.0%}, concurrency x{g['concurrency_ratio']:.2f}")
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
