"""Where a full decode's time goes on the H200: per-program stamps, equal-byte shapes, hardware counters.

Issue 20 asks full decode (64 requests x 4096 keys, 32 q / 8 kv heads, head 128, bf16, block 64) for
>= 1.0x cuDNN SDPA on contiguous K/V; ours has stayed at 0.977-0.992. This script measures where the
launch's time goes instead of guessing:

* ``stamps``: a copy of ``kernels/attention_kernels.py`` whose ``_decode_kernel`` reads ``%globaltimer``
  when a program starts and after its key loop, and ``%smid``, into a trace buffer (the package's kernel
  is not changed; an anchor that moved stops the script naming it). From the trace: the launch's span,
  the programs running at each moment, how long the GPU ran below 90 % of its peak concurrency at the
  start (ramp) and at the end (tail: the drain, programs of equal work ending at different times), each
  wave's program time, and one full wave's rate (``wave_gbps``).
* ``shapes``: ours and cuDNN at equal K/V bytes over batch x context (16 x 16384 ... 256 x 1024): a
  launch of fewer, longer programs (one wave) against more, shorter ones.
* ``--ncu``: one launch of ours and one of cuDNN inside NVTX ranges ``ours`` / ``cudnn``, for
  ``ncu --nvtx --nvtx-include ours/ --nvtx-include cudnn/ ...`` (the device call gives the metrics).

Usage::

    python benchmarks/probes/decode_probe.py [--out FILE.json] [--parts stamps,shapes] [--ncu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: attention.py, _outputs.py
ROOT = os.path.dirname(BENCH)
for _dir in (BENCH, HERE):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
import attention as A  # noqa: E402  (puts this tree's src/ first on sys.path)
from _outputs import Refused, claim, fail, force_help, mark, read_json, replacing  # noqa: E402

SCRIPT = "decode_probe"  # the mark on what this script writes (benchmarks/_outputs.py)

SRC = os.path.join(ROOT, "src", "fastdeploy_paddlefleet", "kernels", "attention_kernels.py")
SHAPES = ((16, 16384), (32, 8192), (64, 4096), (128, 2048), (256, 1024))

_GTIME = '''
@triton.jit
def _probe_time(dep):
    """probe: the global timer (ns), read after ``dep`` is ready."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _probe_smid(dep):
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize'''
_END = """    t_end = _probe_time(tl.sum(l_i).to(tl.int32))
    pid = ((b * HKV + kvh) * NUM_SPLITS + split) * 4
    tl.store(Trace + pid, t_beg)
    tl.store(Trace + pid + 1, t_end)
    tl.store(Trace + pid + 2, _probe_smid(q0).to(tl.int64))
"""
# (name, source text, replacement, occurrences): each anchor must match exactly that often
_DECODE_DEF = '=["stride_tbl", "n_blk", "n_pages", "n_tok"])\ndef _decode'
EDITS = [
    ("stamp helpers", "\n@triton.jit(do_not_specialize" + _DECODE_DEF, _GTIME + _DECODE_DEF, 1),
    ("decode signature", "stride_ksp, stride_ksr, stride_vsp, stride_vsr,\n    G: tl.constexpr, BLOCK_H",
     "stride_ksp, stride_ksr, stride_vsp, stride_vsr, Trace,\n    G: tl.constexpr, BLOCK_H", 1),
    ("program start", "    split = tl.program_id(2)\n",
     "    split = tl.program_id(2)\n    t_beg = _probe_time(b)\n", 1),
    ("after the key loop", "    out = _apply_v_scale(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], VS, kvh, "
     "offs_dv, DV, SCALE_MODE)\n    dv_ok = offs_dv[None, :] < DV\n    if NUM_SPLITS == 1:", None, 1),
]  # fmt: skip


#: kernel variants timed beside the package's (``--variants``): extra edits of the stamped copy
_K_LOAD = "k = tl.load(K + k_off + offs_dk[None, :], mask=k_mask, other=0.0)"
_V_LOAD = "v = tl.load(V + v_off + offs_dv[None, :], mask=v_mask, other=0.0)"
_SPLIT = (
    "    per = tl.cdiv(tl.cdiv(kv_len, BLOCK_N) - t0, NUM_SPLITS)\n"
    "    start = (t0 + split * per) * BLOCK_N\n"
    "    stop = tl.minimum((t0 + split * per + per) * BLOCK_N, kv_len)\n"
)


def _skewed(weights: dict) -> list:
    """Split ``s`` of ``NUM_SPLITS`` covers its share ``weights[NUM_SPLITS][s]`` of the key tiles (the grid
    launches split 0 of every (request, kv head) first: long pieces first, short ones fill the drain)."""
    lines = ["    n_t = tl.cdiv(kv_len, BLOCK_N) - t0\n", "    c0 = split * 0\n", "    c1 = split * 0 + 1\n",
             "    den = 1\n"]  # fmt: skip
    for n, ws in weights.items():
        cum = [sum(ws[:i]) for i in range(n + 1)]
        lines.append(f"    if NUM_SPLITS == {n}:\n        den = {cum[-1]}\n")
        for i in range(n):
            lines.append(f"        c0 = tl.where(split == {i}, {cum[i]}, c0)\n")
            lines.append(f"        c1 = tl.where(split == {i}, {cum[i + 1]}, c1)\n")
    lines.append("    start = (t0 + n_t * c0 // den) * BLOCK_N\n")
    lines.append("    stop = tl.minimum((t0 + n_t * c1 // den) * BLOCK_N, kv_len)\n")
    return [("split bounds", _SPLIT, "".join(lines), 1)]


VARIANTS = {
    "package": [],
    # longest pieces first: splits of 3:1 (2 splits) and 8:4:2:1 (4 splits) of each key range
    "skewed": _skewed({2: (3, 1), 4: (8, 4, 2, 1)}),
    # K/V are read once per launch: mark them first to leave L2 (the queries, tables stay)
    "evict-first": [
        ("k load", _K_LOAD, _K_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
        ("v load", _V_LOAD, _V_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
    ],
}


def patched_source(src: str | None = None, variant: str = "package") -> str:
    """The kernels' source with the stamps (and ``variant``'s edits) in; ``ValueError`` naming an anchor
    not found exactly as often as expected (the kernel changed: move the stamp)."""
    text = open(SRC).read() if src is None else src
    for name, old, new, count in EDITS + VARIANTS[variant]:
        found = text.count(old)
        if found != count:
            raise ValueError(f"stamp point {name!r}: its anchor occurs {found} times, expected {count}")
        text = text.replace(old, _END + old if new is None else new)
    return text.replace("from .errors import", "from fastdeploy_paddlefleet.kernels.errors import")


def load_probe(variant: str = "package"):
    """Import the stamped copy (with ``variant``'s edits) as a module of its own."""
    name = "decode_probe_" + variant.replace("-", "_")
    path = os.path.join(tempfile.mkdtemp(prefix="fdfleet-probe-"), name + ".py")
    with open(path, "w") as f:
        f.write(patched_source(variant=variant))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(bsz: int, ctx: int):
    return A.paged_batch([ctx - 1] * bsz, [1] * bsz, A.HQ, A.HKV, A.D, A.D, seed=1)


def _recorded_launch(batch, ctx: int, num_splits: int | None = None, every: bool = False):
    """``(args, grid, consts)`` of the decode launch ``paged_attention`` makes for ``batch`` (Triton's
    path, recorded by a stand-in ``KernelCache.launch``); ``every``: the list of ``(kernel, grid, args,
    consts)`` of every launch (decode, then the split-KV reduce)."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    seen = []
    real = _launch.KernelCache.launch

    def record(self, fn, key, grid, args, consts, stream):
        seen.append((fn, grid, args, consts))
        return real(self, fn, None, grid, args, consts, stream)

    _launch.KernelCache.launch = record
    try:
        pa._PLANS.clear()
        q = batch["q"]
        pa.paged_attention(
            q, batch["kc"], batch["vc"], batch["cu"], batch["dec"], batch["table"], scale=1 / math.sqrt(A.D),
            max_q_len=1, max_context_len=ctx, num_splits=num_splits,
        )  # fmt: skip
    finally:
        _launch.KernelCache.launch = real
        pa._PLANS.clear()
    if every:
        return seen
    decodes = [s for s in seen if s[0].__name__ == "_decode_kernel"]
    if len(decodes) != 1:
        raise ValueError(f"expected one decode launch, got {[s[0].__name__ for s in seen]}")
    _, grid, args, consts = decodes[0]
    return args, grid, consts


def timeline(trace: list, kv_bytes: int) -> dict:
    """Concurrency and waves from ``trace [programs][start ns, end ns, sm, -]`` (module docstring)."""
    rows = [r for r in trace if r[1] > r[0] > 0]
    t0 = min(r[0] for r in rows)
    beg = sorted(r[0] - t0 for r in rows)
    end = sorted(r[1] - t0 for r in rows)
    span = end[-1]
    events = sorted([(t, 1) for t in beg] + [(t, -1) for t in end])
    active, curve = 0, []  # (from, to, programs running in between)
    for (t, d), (nxt, _) in zip(events, events[1:] + [(span, 0)], strict=True):
        active += d
        if nxt > t:
            curve.append((t, nxt, active))
    peak = max(a for _, _, a in curve)
    full = [(a, z) for a, z, n in curve if n >= 0.9 * peak]
    ramp, last_full = full[0][0], full[-1][1]  # first moment at >= 90 % of the peak, last one
    first_wave = sorted(rows, key=lambda r: r[0])[:peak]
    later = sorted(rows, key=lambda r: r[0])[peak:]
    dur = lambda rs: statistics.median(r[1] - r[0] for r in rs) / 1e3 if rs else None  # noqa: E731
    per_prog = kv_bytes / len(rows)
    busy = sum((r[1] - r[0]) for r in rows)
    bins = [0] * (span // 2000 + 1)  # programs running in each 2 us bin (time-weighted)
    for r in rows:
        a, z = r[0] - t0, r[1] - t0
        for i in range(a // 2000, z // 2000 + 1):
            bins[i] += (min(z, (i + 1) * 2000) - max(a, i * 2000)) / 2000
    return {
        "active_2us": [round(x, 1) for x in bins],
        "programs": len(rows),
        "sms": len({r[2] for r in rows}),
        "peak_active": peak,
        "span_us": round(span / 1e3, 2),
        "ramp_us": round(ramp / 1e3, 2),
        "tail_us": round((span - last_full) / 1e3, 2),
        "mean_active": round(busy / span, 1),
        "first_wave_us": round(dur(first_wave), 2),
        "later_us": None if not later else round(dur(later), 2),
        "first_end_us": round(end[0] / 1e3, 2),
        "last_start_us": round(beg[-1] / 1e3, 2),
        # one full wave's rate: its programs' bytes over their median time
        "wave_gbps": round(peak * per_prog / statistics.median(r[1] - r[0] for r in first_wave), 1),
    }


def stamps(shapes, variant: str = "package") -> list[dict]:
    import torch

    mod = load_probe(variant)
    recs = []
    for bsz, ctx in shapes:
        batch = _batch(bsz, ctx)
        kv_bytes = bsz * A.HKV * ctx * 2 * A.D * batch["kc"].element_size()
        args, grid, consts = _recorded_launch(batch, ctx)
        n = grid[0] * grid[1] * grid[2]
        trace = torch.zeros(n * 4, dtype=torch.int64, device=batch["q"].device)

        def launch(args=args, grid=grid, consts=consts, trace=trace):
            mod._decode_kernel[grid](*args, trace, **consts)

        launch()
        torch.cuda.synchronize()
        t = A.bench_best(launch)
        trace.zero_()
        launch()
        torch.cuda.synchronize()
        rec = {"part": "stamps", "variant": variant, "bsz": bsz, "ctx": ctx, "grid": list(grid),
               "ms": t["ms"], "gbps": round(kv_bytes / (t["ms"] * 1e-3) / 1e9, 1), "timing": t["timing"],
               **timeline(trace.view(n, 4).cpu().tolist(), kv_bytes)}  # fmt: skip
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        del batch, trace
    return recs


def splits_part(bsz: int = 64, ctx: int = 4096) -> list[dict]:
    """The full decode with its key ranges split 1, 2 or 4 ways, equal pieces (the package's kernel) or
    longest first (``skewed``), the reduce launch included; stamps of the decode launch for the drain.
    Outputs checked against the package's unsplit launch (itself checked against the dense reference
    by ``attention.py`` / ``decode_ceiling.py``)."""
    import torch

    batch = _batch(bsz, ctx)
    kv_bytes = bsz * A.HKV * ctx * 2 * A.D * batch["kc"].element_size()
    mods = {v: load_probe(v) for v in ("package", "skewed")}
    want = None
    recs = []
    for variant, splits in (("package", 1), ("package", 2), ("package", 4), ("skewed", 2), ("skewed", 4)):
        seen = _recorded_launch(batch, ctx, splits, every=True)
        (_, grid, dargs, dconsts), rest = seen[0], seen[1:]
        n = grid[0] * grid[1] * grid[2]
        trace = torch.zeros(n * 4, dtype=torch.int64, device=batch["q"].device)
        out = dargs[3]  # the decode's (or the reduce's) output: O

        def launch(mod=mods[variant], grid=grid, dargs=dargs, dconsts=dconsts, rest=rest, trace=trace):
            mod._decode_kernel[grid](*dargs, trace, **dconsts)
            for fn, g, args, consts in rest:
                fn[g](*args, **consts)

        launch()
        torch.cuda.synchronize()
        got = out.float().clone()
        if want is None:
            want = got
        err = float((got - want).abs().max())
        t = A.bench_best(launch)
        trace.zero_()
        launch()
        torch.cuda.synchronize()
        tl_ = timeline(trace.view(n, 4).cpu().tolist(), kv_bytes)
        rec = {"part": "splits", "variant": variant, "splits": splits, "bsz": bsz, "ctx": ctx, "ms": t["ms"],
               "gbps": round(kv_bytes / (t["ms"] * 1e-3) / 1e9, 1), "timing": t["timing"],
               "max_abs_vs_unsplit": err, **tl_}  # fmt: skip
        print(json.dumps({k: v for k, v in rec.items() if k != "active_2us"}), flush=True)
        recs.append(rec)
        if err > 2e-2:
            raise ValueError(f"{variant} x {splits}: output differs from the unsplit launch by {err}")
    return recs


def shapes_part(shapes) -> list[dict]:
    import torch

    recs = []
    for bsz, ctx in shapes:
        batch = _batch(bsz, ctx)
        kv_bytes = bsz * A.HKV * ctx * 2 * A.D * batch["kc"].element_size()
        rec = {"part": "shapes", "bsz": bsz, "ctx": ctx}
        try:
            ms, t = A.run_ours("decode", batch, max_q_len=1, max_ctx=ctx, check=[(0, [0]), (bsz - 1, [0])])
            rec.update(ours_gbps=round(kv_bytes / (ms * 1e-3) / 1e9, 1), ours_timing=t.get("timing"))
        except Exception as e:  # noqa: BLE001 - keep the other figures
            rec["ours_error"] = repr(e)[:200]
        try:  # cuDNN on contiguous K/V of the same bytes
            k = torch.randn(bsz, A.HKV, ctx, A.D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(bsz, A.HQ, 1, A.D, device="cuda", dtype=torch.bfloat16)
            ms, how, _ = A.peer_sdpa(q, k, v, "cudnn", causal=False)
            rec.update(cudnn_gbps=round(kv_bytes / (ms * 1e-3) / 1e9, 1), cudnn_how=how)
            del k, v, q
        except Exception as e:  # noqa: BLE001
            rec["cudnn_error"] = repr(e)[:200]
        if "ours_gbps" in rec and "cudnn_gbps" in rec:
            rec["ratio"] = round(rec["ours_gbps"] / rec["cudnn_gbps"], 4)
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        del batch
    return recs


def _captured(fns, rounds: int):
    """A CUDA graph holding ``rounds`` passes over the launches ``fns`` (each run once before, so
    nothing compiles during capture), replayed once."""
    import torch

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(rounds):
                for f in fns:
                    f()
    g.replay()
    torch.cuda.synchronize()
    return g


def _graph_us(fns, rounds: int) -> float:
    """Median us per call of a CUDA graph holding ``rounds`` passes over the launches ``fns``."""
    import torch

    g = _captured(fns, rounds)
    times = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / (rounds * len(fns)))
    return statistics.median(times)


def modes(shapes=((64, 4096), (32, 8192)), sets: int = 4, rounds: int = 8) -> list[dict]:
    """Ours and cuDNN timed three ways in CUDA graphs: ``same`` (one call on one data set, replayed back
    to back: the benchmark's way), ``rotate`` (``sets`` data sets in turn, as a model's layers read
    their own caches: no L2 carry-over from the call before), ``between`` (a tiny torch kernel between
    calls, its own time taken off: no overlap of one call with the next)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from fastdeploy_paddlefleet.kernels.errors import new_error_flag
    from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention

    recs = []
    tiny = torch.zeros(1024, device="cuda")
    tick = lambda: tiny.add_(1.0)  # noqa: E731
    tick_us = _graph_us([tick], 200)
    for bsz, ctx in shapes:
        kv_bytes = bsz * A.HKV * ctx * 2 * A.D * 2
        impls = {}
        ours = []
        for i in range(sets):
            b = A.paged_batch([ctx - 1] * bsz, [1] * bsz, A.HQ, A.HKV, A.D, A.D, seed=10 + i)
            err = new_error_flag(b["q"])
            out = torch.empty_like(b["q"])

            def f(b=b, err=err, out=out, ctx=ctx):
                paged_attention(
                    b["q"], b["kc"], b["vc"], b["cu"], b["dec"], b["table"], scale=1 / math.sqrt(A.D),
                    max_q_len=1, max_context_len=ctx, out=out, errors=err,
                )  # fmt: skip

            ours.append(f)
        impls["ours"] = ours
        cud = []
        for _ in range(sets):
            k = torch.randn(bsz, A.HKV, ctx, A.D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(bsz, A.HQ, 1, A.D, device="cuda", dtype=torch.bfloat16)

            def f(q=q, k=k, v=v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return sdpa(q, k, v, enable_gqa=True)

            cud.append(f)
        impls["cudnn"] = cud
        rec = {"part": "modes", "bsz": bsz, "ctx": ctx, "tick_us": round(tick_us, 2)}
        for name, fns in impls.items():
            try:
                same = _graph_us(fns[:1], rounds * sets)
                rot = _graph_us(fns, rounds)
                betw = _graph_us([g for f in fns for g in (f, tick)], rounds) * 2 - tick_us
                for mode, us in (("same", same), ("rotate", rot), ("between", betw)):
                    rec[f"{name}_{mode}_gbps"] = round(kv_bytes / (us * 1e-6) / 1e9, 1)
            except Exception as e:  # noqa: BLE001 - keep the other figures
                rec[f"{name}_error"] = repr(e)[:200]
        for mode in ("same", "rotate", "between"):
            a, c = rec.get(f"ours_{mode}_gbps"), rec.get(f"cudnn_{mode}_gbps")
            if a and c:
                rec[f"ratio_{mode}"] = round(a / c, 4)
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        del impls, ours, cud
        torch.cuda.empty_cache()
    return recs


def ncu_once() -> None:
    """One launch of ours and one of cuDNN, each inside an NVTX range (warm-up calls outside)."""
    import torch

    from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention

    bsz, ctx = 64, 4096
    batch = _batch(bsz, ctx)
    k = torch.randn(bsz, A.HKV, ctx, A.D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(bsz, A.HQ, 1, A.D, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def ours():
        paged_attention(
            batch["q"], batch["kc"], batch["vc"], batch["cu"], batch["dec"], batch["table"],
            scale=1 / math.sqrt(A.D), max_q_len=1, max_context_len=ctx,
        )  # fmt: skip

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            sdpa(q, k, v, enable_gqa=True)

    # ours streaming contiguous runs: cuDNN's K/V viewed as pages, a head-wise table of consecutive pages
    n_tiles = ctx // A.BS
    rows = torch.arange(bsz * A.HKV, device="cuda", dtype=torch.int32)[:, None] * n_tiles
    heads_tbl = rows + torch.arange(n_tiles, device="cuda", dtype=torch.int32)[None, :]
    kc, vc = k.view(-1, A.HKV, A.BS, A.D), v.view(-1, A.HKV, A.BS, A.D)

    def ours_contiguous():
        paged_attention(
            batch["q"], kc, vc, batch["cu"], batch["dec"], heads_tbl, scale=1 / math.sqrt(A.D), headwise=True,
            max_q_len=1, max_context_len=ctx,
        )  # fmt: skip

    for name, fn in (("ours", ours), ("cudnn", cudnn), ("ours_contiguous", ours_contiguous)):
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def plot(recs: list[dict], path: str) -> None:
    """Programs running over time (the stamps' 2 us bins), one line per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in recs:
        if r.get("part") == "stamps" and "active_2us" in r:
            xs = [2 * i for i in range(len(r["active_2us"]))]
            label = f"{r['bsz']} x {r['ctx']} ({r['gbps']} GB/s)"
            ax.plot(xs, r["active_2us"], label=label, lw=1)
    ax.set_xlabel("us since the first program started")
    ax.set_ylabel("decode programs running")
    ax.set_title("Full decode on the H200: programs running (per-program %globaltimer stamps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="stamps,shapes", help="comma list of stamps, shapes, modes, splits")
    ap.add_argument("--out", help="write every record to this JSON file")
    ap.add_argument("--variants", action="store_true", help="stamps of every variant (VARIANTS) too")
    ap.add_argument("--plot", help="draw the stamps' running-programs curves into this PNG")
    ap.add_argument("--from-json", help="re-plot the records of an earlier --out instead of running")
    ap.add_argument("--ncu", action="store_true", help="one launch each of ours and cuDNN in NVTX ranges")
    ap.add_argument("--force", action="store_true", help=force_help("the --out and --plot files"))
    args = ap.parse_args(argv)
    if args.ncu:
        ncu_once()
        return 0
    try:  # what this run writes and reads: refused by name before any work (benchmarks/_outputs.py)
        out = claim(args.out, script=SCRIPT, force=args.force) if args.out else None
        data = args.out or args.from_json
        png = None
        if args.plot:
            png = claim(args.plot, script=SCRIPT, force=args.force, flag="--plot", beside=data)
        if args.from_json:
            recs = read_json(args.from_json, "--from-json", want=list)
    except ValueError as e:
        return fail(e)
    if args.from_json:
        try:
            write_plot(recs, png)
        except Refused as e:
            return fail(e)
        except (KeyError, TypeError, ValueError) as e:  # records of another shape than this script's
            why = f"a record is not what this script writes ({e!r})"
            return fail(Refused(f"--from-json {args.from_json!r}: {why}"))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    bad = sorted(set(parts) - {"stamps", "shapes", "modes", "splits"})
    if bad:
        raise SystemExit(f"--parts: unknown {bad}; choose from stamps, shapes, modes, splits")
    recs: list[dict] = []
    if "stamps" in parts:
        for variant in VARIANTS if args.variants else ["package"]:
            try:
                recs += stamps(SHAPES if variant == "package" else [(64, 4096)], variant)
            except Exception as e:  # noqa: BLE001 - the other parts still run
                recs.append({"part": "stamps", "variant": variant, "error": repr(e)[:400]})
                print(json.dumps(recs[-1]), flush=True)
    if "splits" in parts:
        recs += splits_part()
    if "modes" in parts:
        recs += modes()
    if "shapes" in parts:
        recs += shapes_part(SHAPES)
    try:
        if out is not None:
            with replacing(out) as tmp:
                tmp.write_text(json.dumps([mark(r, SCRIPT) for r in recs], indent=1) + "\n")
        write_plot(recs, png)
    except Refused as e:
        return fail(e)
    return 0


def write_plot(recs: list[dict], png) -> None:
    """:func:`plot` into the claimed ``png`` all or nothing (``None``: no plot)."""
    if png is not None:
        with replacing(png) as tmp:
            plot(recs, str(tmp))


if __name__ == "__main__":
    raise SystemExit(main())
