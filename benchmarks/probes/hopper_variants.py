"""Variants of the Hopper prefill kernel on the headline prefill cases, in one call (issue 20).

Each variant rebuilds the kernel's plan with other :class:`HopperPlan` keywords (tiles: ``block_n``,
``q_bufs``, ``num_stages``; schedule: ``peel``, ``pingpong``, ``q_late``; ``default`` is today's kernel)
and times the cases of ``attention.py`` with its inputs, timing (do_bench and CUDA-graph replay, the
better one) and dense-reference checks (a relative error over ``REL_TOL`` is recorded as an error).
Records carry ``variant``, ``issue`` and the ``--tag`` pairs, for the sweeps file; ``--out`` appends.
With ``--timeout S`` every variant runs in a child process killed after ``S`` seconds, so a variant
that hangs (a deadlock on the GPU), crashes or fails to compile is recorded and the others still run.

Usage::

    python benchmarks/probes/hopper_variants.py [--out FILE.jsonl] [--variants default,peel,...]
        [--timeout 90]
        [--tag session=2026-12-01c --tag kernel_rev=abc1234]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: attention.py, _outputs.py
ROOT = os.path.dirname(BENCH)
for _dir in (BENCH, HERE):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
import attention as A  # noqa: E402  (puts this tree's src/ first on sys.path)
from _outputs import MARK, choose, fail, force_help, open_records, parse_tags  # noqa: E402

# (case, q heads, kv heads, qk dim, v dim, window, sink kind)
CASES = {
    "prefill-causal": (32, 8, 128, 128, None, "vanilla"),
    "prefill-swa1024-sinks": (32, 8, 128, 128, 1023, "learnable"),
    "mla-prefill-causal": (16, 16, 192, 128, None, "vanilla"),
    "d256-prefill-causal": (32, 8, 256, 256, None, "vanilla"),
    # the mixed batch's prefill chunk alone (attention.py's `mixed` case): few items per CTA, where
    # the order of the items decides the tail
    "prefill2048-causal": (32, 8, 128, 128, None, "vanilla"),
}
# other windows (+ sinks) over the same 8192 tokens: the same items with 3 to 33 key tiles each, so a
# line through time against tiles per item splits the time into a cost per item and one per tile
WINDOWS = (256, 512, 2048, 4096)
CASES.update({f"prefill-swa{w}-sinks": (32, 8, 128, 128, w - 1, "learnable") for w in WINDOWS})
WINDOW_CASES = ("prefill-causal", "prefill-swa1024-sinks", *(f"prefill-swa{w}-sinks" for w in WINDOWS))
#: query tokens per case (default: attention.py's prefill length)
CASE_TOKENS = {"prefill2048-causal": 2048}
# variant -> (HopperPlan keywords, the cases it applies to)
ALL = tuple(c for c in CASES if c not in WINDOW_CASES[2:])
VARIANTS = {
    "default": ({}, ALL),
    # the first key tile peeled off the loop (the default since 2026-12-01c): every wgmma wait
    # unconditional, so ptxas no longer serialises the kernel's wgmma's (C7514 in `ptxas -v`)
    "peel": (dict(peel=True), ALL),
    # the loop before: the first tile's branches inside it (ptxas serialises every wgmma)
    "unpeeled": (dict(peel=False), ALL),
    # peel + FA3's ping-pong of the two consumer warpgroups on named barriers (inline PTX)
    "pingpong": (dict(pingpong=True), ALL),
    # peel with every second full wave of items reversed (hopper_prefill._scheduled): a balanced tail
    # (the default since 2026-12-01c, call 3; before it: round robin, "round-robin")
    "peel-snake": (dict(peel=True, snake=True), ALL),
    "snake": (dict(snake=True), ALL),
    "round-robin": (dict(snake=False), ALL),
    # peel with a third 128-key stage and one Q buffer (224 KB of shared memory for 128 / 128)
    "peel-q1-s3": (dict(peel=True, q_bufs=1, num_stages=3), ("prefill-causal", "prefill-swa1024-sinks")),
    "pingpong-q1-s3": (dict(pingpong=True, q_bufs=1, num_stages=3), ("prefill-causal",)),
    # peel with 64-key tiles and a third stage (rejected when the wgmma's were serialised: -16 %)
    "peel-n64-s3": (dict(peel=True, block_n=64, num_stages=3), WINDOW_CASES),
    # today's kernel over every window: the cost per item against the cost per key tile
    "window-fit": ({}, WINDOW_CASES),
    # what each item costs beyond its tiles (window-fit, 2026-12-01d: ~7 us, 3.8 tiles' worth): the
    # producer's Q by cp.async that complete q_ready on their own (the default since 2026-12-01d) or
    # by plain loads through its registers (before: the producer waits out their round trips)
    "qasync": (dict(q_async=True), ALL + WINDOW_CASES[2:]),
    "plain-q": (dict(q_async=False), ALL + WINDOW_CASES[2:]),
    # the output stored from the wgmma layout, 4 bytes per store (before 2026-12-01d; now 16-byte row
    # segments after a layout conversion, `o_vec`)
    "plain-store": (dict(o_vec=False), ALL + WINDOW_CASES[2:]),
    "n64-s3": (dict(block_n=64, num_stages=3), ("prefill-causal", "prefill-swa1024-sinks")),
    "n64-s4": (dict(block_n=64, num_stages=4), ("prefill-causal",)),
    "mla-n64-q2-s2": (dict(block_n=64, q_bufs=2, num_stages=2), ("mla-prefill-causal",)),
    "mla-n64-q2-s3": (dict(block_n=64, q_bufs=2, num_stages=3), ("mla-prefill-causal",)),
    # the producer loads an item's Q after issuing its first K tile (the copy overlaps the Q loads)
    "qlate": (dict(q_late=True), ALL),
    # timing ablations: the softmax left out (P = S; results wrong, not checked): the MMA + pipeline rate
    "nosoftmax": (dict(profile=1), ("prefill-causal", "mla-prefill-causal", "d256-prefill-causal")),
    "peel-nosoftmax": (dict(peel=True, profile=1), ("prefill-causal", "mla-prefill-causal")),
}
REL_TOL = 2e-2  # bf16 operands land between 1e-3 and 1e-2 against the dense reference


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

    recs = []
    base = hp.HopperPlan
    for vname in variants:
        tiles, cases = VARIANTS[vname]
        pa.HopperPlan = functools.partial(base, **tiles)
        if hasattr(pa, "_PLANS"):  # one-shot plans are memoised by cache address: none from another variant
            pa._PLANS.clear()
        try:
            for case in cases:
                hq, hkv, dqk, dv, window, sink_kind = CASES[case]
                n = CASE_TOKENS.get(case, A.SH["n"])
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
                    if errs.get("rel_err", 0.0) > REL_TOL:
                        rec["error"] = f"wrong result: relative error {errs['rel_err']} > {REL_TOL}"
                    del batch
                except Exception as e:  # noqa: BLE001 - keep the other variants' figures
                    rec["error"] = repr(e)[:300]
                A.emit(rec, fh)
                recs.append(rec)
        finally:
            pa.HopperPlan = base
    return recs


def run_isolated(variants: list[str], fh, check: bool, timeout: float) -> list[dict]:
    """:func:`run` for each variant in a child process killed after ``timeout`` seconds; a case without
    a record (timeout, crash, compile error before it) gets one with ``error``."""
    recs = []
    for vname in variants:
        tmp_dir = tempfile.mkdtemp(prefix="fdfleet-variants-")  # the child's own new file
        tmp = os.path.join(tmp_dir, "records.jsonl")
        cmd = [sys.executable, os.path.abspath(__file__), "--variants", vname, "--out", tmp]
        err = None
        try:
            r = subprocess.run(cmd + ([] if check else ["--no-check"]), timeout=timeout, capture_output=True,
                               text=True)  # fmt: skip
            if r.returncode:
                err = f"exit {r.returncode}: {r.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            err = f"timeout after {timeout:g} s (a hang?)"
        got = []
        if os.path.exists(tmp):
            with open(tmp) as f:
                got = [json.loads(line) for line in f if line.strip()]
            got = [{k: v for k, v in g.items() if k != MARK} for g in got]  # marked again below
            os.unlink(tmp)
        os.rmdir(tmp_dir)
        done = {g.get("case") for g in got}
        tiles, cases = VARIANTS[vname]
        got += [
            {
                "issue": "20",
                "variant": vname,
                "tiles": tiles,
                "case": c,
                "impl": "triton",
                "error": err or "no record",
            }
            for c in cases
            if c not in done
        ]
        for rec in got:
            A.emit(rec, fh)
        recs += got
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON lines file to append to (default: print only)")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list (default: %(default)s)")
    ap.add_argument("--no-check", action="store_true", help="skip the dense-reference checks")
    ap.add_argument("--peers", default="", help="comma list of cases to time the peers on too")
    ap.add_argument(
        "--timeout", type=float, default=None, help="seconds per variant, each in a child process"
    )
    ap.add_argument("--tag", action="append", default=[], help="KEY=VALUE added to every record (repeatable)")
    ap.add_argument("--json", action="store_true", help="the summary as one JSON object (records always are)")
    args = ap.parse_args(argv)
    try:
        names = choose(args.variants, VARIANTS, "variants")
        tags = parse_tags(args.tag)
        fh = open_records(args.out, script="hopper_variants", force=args.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    emit = A.emit
    A.emit = lambda rec, f=None: emit({**rec, **tags}, f)  # every record carries the tags
    try:
        if args.timeout:
            recs = run_isolated(names, fh, not args.no_check, args.timeout)
        else:
            recs = run(names, fh, check=not args.no_check)
        for case in (c for c in args.peers.split(",") if c):
            peers(case, fh)
    finally:
        A.emit = emit
        if fh is not None:
            fh.close()
    base = {r["case"]: r["tflops"] for r in recs if r["variant"] == "default" and "tflops" in r}
    rows = []
    for r in recs:
        ratio = round(r["tflops"] / base[r["case"]], 3) if r.get("tflops") and r["case"] in base else None
        rows.append(dict(variant=r["variant"], case=r["case"], tflops=r.get("tflops"), error=r.get("error"),
                         vs_default=ratio))  # fmt: skip
    if args.json:
        print(json.dumps({"records": len(recs), "rows": rows}), file=sys.stderr)
        return 0
    width = max(len(v) for v in names)
    for r in rows:
        what = r["error"][:60] if r["error"] else f"{r['tflops']} TFLOP/s  x{r['vs_default']}"
        print(f"{r['variant']:<{width}}  {r['case']:<24} {what}", file=sys.stderr)
    print(json.dumps({"records": len(recs)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
