"""Tile variants of the Hopper prefill kernel on the headline prefill cases, in one process (issue 20).

Each variant rebuilds the kernel's plan with other tiles (``HopperPlan(block_n=, q_bufs=, num_stages=)``:
keys per tile, Q buffers, K/V ring depth; ``default`` is ``hopper_prefill.tile_for``) and times the
cases of ``attention.py`` with its inputs, timing (do_bench and CUDA-graph replay, the better one)
and dense-reference checks. Records carry ``variant`` and ``issue`` for the sweeps file.

Usage::

    python benchmarks/hopper_variants.py [--out FILE.jsonl] [--variants default,n64-s3,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import attention as A  # noqa: E402  (puts this tree's src/ first on sys.path)

# (case, q heads, kv heads, qk dim, v dim, window, sink kind)
CASES = {
    "prefill-causal": (32, 8, 128, 128, None, "vanilla"),
    "prefill-swa1024-sinks": (32, 8, 128, 128, 1023, "learnable"),
    "mla-prefill-causal": (16, 16, 192, 128, None, "vanilla"),
    "d256-prefill-causal": (32, 8, 256, 256, None, "vanilla"),
}
# variant -> (HopperPlan keywords, the cases it applies to)
VARIANTS = {
    "default": ({}, tuple(CASES)),
    "n64-s3": (dict(block_n=64, num_stages=3), ("prefill-causal", "prefill-swa1024-sinks")),
    "n64-s4": (dict(block_n=64, num_stages=4), ("prefill-causal",)),
    "mla-n64-q2-s2": (dict(block_n=64, q_bufs=2, num_stages=2), ("mla-prefill-causal",)),
    "mla-n64-q2-s3": (dict(block_n=64, q_bufs=2, num_stages=3), ("mla-prefill-causal",)),
    # the producer loads an item's Q after issuing its first K tile (the copy overlaps the Q loads)
    "qlate": (dict(q_late=True), tuple(CASES)),
    # timing ablation: the softmax left out (P = S; results wrong, not checked): the MMA + pipeline rate
    "nosoftmax": (dict(profile=1), ("prefill-causal", "mla-prefill-causal", "d256-prefill-causal")),
}


def peers(case: str, fh) -> None:
    """The peers of ``attention.py`` (SDPA cuDNN / flash, FlexAttention) on ``case``, contiguous K/V."""
    import torch

    n = A.SH["n"]
    hq, hkv, dqk, dv, window, sink_kind = CASES[case]
    q = torch.randn(1, hq, n, dqk, device=A.SH["dev"], dtype=A.DT())
    k = torch.randn(1, hkv, n, dqk, device=A.SH["dev"], dtype=A.DT())
    v = torch.randn(1, hkv, n, dv, device=A.SH["dev"], dtype=A.DT())
    sinks = torch.randn(hq, device=A.SH["dev"]) if sink_kind == "learnable" else None
    flops = 2 * A.visible_pairs(0, n, window) * (dqk + dv) * hq
    A.peer_records("prefill", case, q, k, v, causal=True, window=window, sinks=sinks, work=flops,
                   unit="tflops", fh=fh)  # fmt: skip


def run(variants: list[str], fh, check: bool = True) -> list[dict]:
    """Time every (variant, case) pair; one JSON record each (errors recorded, not raised)."""
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    n, recs = A.SH["n"], []
    base = hp.HopperPlan
    for vname in variants:
        tiles, cases = VARIANTS[vname]
        pa.HopperPlan = functools.partial(base, **tiles)
        if hasattr(pa, "_PLANS"):  # one-shot plans are memoised by cache address: none from another variant
            pa._PLANS.clear()
        try:
            for case in cases:
                hq, hkv, dqk, dv, window, sink_kind = CASES[case]
                rec = {"issue": "20", "variant": vname, "tiles": tiles, "case": case, "impl": "triton"}
                try:
                    batch = A.paged_batch([0], [n], hq, hkv, dqk, dv, seed=2)
                    flops = 2 * A.visible_pairs(0, n, window) * (dqk + dv) * hq
                    rows = sorted({0, 1, 1023, 1024, n // 2 + 1, n - 1})
                    checked = check and "profile" not in tiles
                    ms, errs = A.run_ours(case, batch, window=window, sink_kind=sink_kind, max_q_len=n,
                                          max_ctx=n, check=[(0, rows)] if checked else None,
                                          prefill_impl="hopper")  # fmt: skip
                    rec.update(ms=round(ms, 4), tflops=round(flops / (ms * 1e-3) / 1e12, 1), **errs)
                    del batch
                except Exception as e:  # noqa: BLE001 - keep the other variants' figures
                    rec["error"] = repr(e)[:300]
                A.emit(rec, fh)
                recs.append(rec)
        finally:
            pa.HopperPlan = base
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON lines file (default: print only)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list (default: %(default)s)")
    ap.add_argument("--no-check", action="store_true", help="skip the dense-reference checks")
    ap.add_argument("--peers", default="", help="comma list of cases to time the peers on too")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"error: unknown variants {bad} (known: {sorted(VARIANTS)})", file=sys.stderr)
        return 2
    fh = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
    try:
        recs = run(names, fh, check=not args.no_check)
        for case in (c for c in args.peers.split(",") if c):
            peers(case, fh)
    finally:
        if fh is not None:
            fh.close()
    width = max(len(v) for v in names)
    for r in recs:
        print(f"{r['variant']:<{width}}  {r['case']:<24} {r.get('tflops', r.get('error'))}", file=sys.stderr)
    print(json.dumps({"records": len(recs)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
