"""What the Hopper prefill's safe launch costs when no flag is set, alone and beside the fast launch.

The prefill runs twice a step (``kernels/hopper_prefill.py``, "Masked keys"): the fast launch, then the
safe launch, whose CTAs exit at once unless the fast launch found a non-finite output row. For each
case (8192 tokens of one request, 32 q heads / 8 kv heads, 128 / 128, bf16, sinks; causal, window 1023,
window 127), this probe times the fast launch alone, the safe launch alone and the two in turn, ten
turns per CUDA-graph replay (``decode_probe``'s graph timing). It prints one JSON line per case: the
microseconds per launch (or per pair) and how many flags the fast launch set (0 on these finite
inputs).

Needs a Hopper GPU (sm_90) with torch and triton's Gluon; without one it exits 2 saying so.

Usage::

    python benchmarks/probes/safe_launch.py [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, HERE)
from _outputs import device_problem, fail, force_help, give_up, open_records  # noqa: E402

HQ, HKV, D, BS, T = 32, 8, 128, 64, 8192
WINDOWS = (None, 1023, 127)


def _per_turn_us(fns) -> float:
    """Microseconds per turn of ``fns`` (called in order), ten turns per CUDA-graph replay (the median
    of decode_probe's graph timing, which counts per launch)."""
    from decode_probe import _graph_us

    return round(_graph_us(fns, 10) * len(fns), 1)


def run_case(window: int | None) -> dict:
    """One case's record (see the module docstring)."""
    import torch

    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

    gen = torch.Generator(device="cuda").manual_seed(0)
    nb = T // BS + 4
    kw = dict(device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(nb, HKV, BS, D, generator=gen, **kw)
    vc = torch.randn(nb, HKV, BS, D, generator=gen, **kw)
    q = torch.randn(T, HQ, D, generator=gen, **kw)
    out = torch.empty_like(q)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    dec = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = torch.randperm(nb, device="cuda", generator=gen)[: T // BS].int()[None].contiguous()
    sinks = torch.zeros(HQ, device="cuda")
    plan = hp.HopperPlan(kc, vc, HQ, sinks, qk_scale=1.4426950408889634 / D**0.5, sink_mode=1, headwise=False,
                         has_window=window is not None, window=window or 0, win_h0=0, win_h1=HKV)  # fmt: skip
    n_items, grid = plan._items(T, 1)
    tail = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.stride_vr, table.stride(0),
            table.shape[1], plan.n_pages, T, 1, 2, *plan.scalars, n_items)  # fmt: skip
    args = (
        q,
        out,
        plan.value_cache,
        plan.k_desc,
        plan.v_desc,
        sinks,
        cu,
        dec,
        table,
        table,
        plan.redo,
        *tail,
    )

    def fast():
        hp._hopper_prefill_kernel[grid](*args, **plan._consts[False])

    def safe():
        hp._hopper_prefill_kernel[grid](*args, **plan._consts["safe"])

    fast()
    torch.cuda.synchronize()
    flags = int((plan.redo != 0).sum())
    return dict(
        window=window, grid=grid[0], flags_set=flags, fast_us=_per_turn_us([fast]),
        safe_us=_per_turn_us([safe]), fast_then_safe_us=_per_turn_us([fast, safe]),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Needs a Hopper GPU (sm_90).")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this .jsonl file")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    a = ap.parse_args(argv)
    existed = a.out is not None and os.path.lexists(a.out)
    try:
        fh = open_records(a.out, script="safe_launch", force=a.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    problem = device_problem("benchmarks/probes/safe_launch.py")
    if problem is None:
        sys.path.insert(0, os.path.join(ROOT, "src"))
        import torch

        from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

        if not hp.gluon_available() or not hp.is_hopper(torch.device("cuda")):
            problem = "benchmarks/probes/safe_launch.py needs a Hopper GPU (sm_90) and triton's Gluon"
    if problem:
        return give_up(fh, a.out, existed, problem)
    for window in WINDOWS:
        rec = run_case(window)
        print(json.dumps(rec), flush=True)
        if fh is not None:
            fh.record(rec)
    if fh is not None:
        fh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
