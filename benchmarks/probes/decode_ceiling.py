"""What a paged decode can read per second: the read-only ceilings beside our decode kernel and cuDNN.

Issue 20 asks full decode (64 requests x 4096 keys, 8 kv heads, head 128, bf16, block 64) for >= 1.0x
cuDNN SDPA, which reads contiguous ``[B, H, S, D]`` K/V. Our kernel reads 16 KB pages through a block
table whose physical blocks ``attention.py`` shuffles. This script separates the two effects with one
plain Triton kernel that only reads (each program sums one (request, kv head)'s K and V pages, a tile
of ``BS`` keys at a time) over the same bytes laid out three ways:

* ``paged-random``: the cache ``[NB, Hkv, BS, D]``, physical blocks in random order (as benchmarked);
* ``paged-ordered``: the same cache layout, each request's blocks consecutive and in order;
* ``contiguous``: ``[B, Hkv, S, D]`` (what cuDNN reads; the table then lists consecutive tiles).

Beside them: our decode kernel on ``paged-random`` and ``paged-ordered`` tables and on the
``contiguous`` bytes (a head-wise table listing each (request, kv head)'s consecutive pages: the runs
cuDNN reads), and cuDNN SDPA on contiguous K/V. Bandwidth = K and V bytes read / time (the queries,
outputs and tables add < 0.2 %), each with ``attention.py``'s timing (do_bench and CUDA-graph
replay, the better one). If the plain reader on shuffled pages stays below cuDNN on contiguous K/V while
our kernel matches that reader, the gap is the layout, not the kernel; ours on the contiguous bytes
against cuDNN is the kernel alone.

Needs a CUDA GPU with torch and triton (the ``bench`` extra); ``--smoke`` runs tiny shapes on a CPU
under Triton's interpreter, ``TRITON_INTERPRET=1`` set before the start. Without them it exits 2
naming what is missing.

Usage::

    python benchmarks/probes/decode_ceiling.py [--out FILE.jsonl] [--smoke] [--tiles] [--tag KEY=VALUE]
        [--json]
    TRITON_INTERPRET=1 python benchmarks/probes/decode_ceiling.py --smoke   # on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: attention.py, _outputs.py
ROOT = os.path.dirname(BENCH)
for _dir in (BENCH, HERE):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
import attention as A  # noqa: E402  (puts this tree's src/ first on sys.path)
from _outputs import device_problem, fail, force_help, give_up, open_records, parse_tags  # noqa: E402

STAGES = (3, 4)  # pipeline depths of the plain reader; the best one is its figure
#: ``--tiles``: decode tile shapes of ours beside the default, (block_n, warps, stages): 32-key tiles
#: over 2 warps fit 4 programs per SM (512 programs in one wave), 2 stages of 64 keys 3 per SM
#: (block_n, warps, stages, TMA): deeper rings of 16 / 32 KB stages within two programs per SM (the
#: registers allow two programs of 4 warps), and the same through TMA descriptor loads
TILES = (
    (64, 4, 3, False), (64, 4, 4, False), (32, 4, 5, False), (32, 4, 6, False), (32, 4, 8, False),
    (32, 2, 6, False), (64, 4, 3, True), (64, 4, 4, True), (32, 4, 6, True),
)  # fmt: skip
SPLITS = (2, 4)  # ``--tiles``: split-KV counts forced on the full decode (the default chooses 1)
#: ``--regs``: (block_n, warps, stages, maxnreg): the default tile with Triton's register cap, so that
#: 3 programs of 4 warps (168 registers; 3 x ~72 KB of shared memory fit) or 4 of 2 stages (128) share
#: an SM instead of 2 at the compiler's 250: more loads in flight per SM, a shorter drain per program
REGS = ((64, 4, 3, 168), (64, 4, 3, 128), (64, 4, 2, 128), (64, 4, 2, 168))


def _reader():
    """The plain read-only kernel: program ``(b, h)`` loads every tile ``j < n_tiles`` of K and V at
    ``table[b, j] * stride_page + h * stride_h`` (``[BS, D]`` rows of ``D`` contiguous elements) and
    stores the column sums, so no load is dead."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_pages(
        K, V, Tbl, Out, stride_page, stride_h, stride_tbl, n_tiles, HKV: tl.constexpr, BS: tl.constexpr,
        D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BS)[:, None] * D + tl.arange(0, D)[None, :]
        acc = tl.zeros([BS, D], tl.float32)
        for j in range(n_tiles):
            base = tl.load(Tbl + b * stride_tbl + j).to(tl.int64) * stride_page + h * stride_h
            acc += tl.load(K + base + offs).to(tl.float32) + tl.load(V + base + offs).to(tl.float32)
        tl.store(Out + (b * HKV + h) * D + tl.arange(0, D), tl.sum(acc, 0))

    return read_pages


def layouts(batch: dict, bsz: int, ctx: int) -> dict:
    """``name -> (K, V, table, stride_page, stride_h)`` over the same K/V values: the benchmark's
    shuffled cache, the same cache with blocks in order, and contiguous ``[B, Hkv, S, D]``."""
    import torch

    kc, vc, tbl = batch["kc"], batch["vc"], batch["table"]
    nb, hkv, bs, d = kc.shape
    n_tiles = ctx // bs
    used = tbl[:, :n_tiles].long()
    # in order: request b's tiles are blocks b * n_tiles + j of a new cache holding the same pages
    k_ord = kc[used.reshape(-1)].contiguous()
    v_ord = vc[used.reshape(-1)].contiguous()
    ordered = torch.arange(bsz * n_tiles, dtype=torch.int32, device=kc.device).view(bsz, n_tiles)
    # contiguous [B, Hkv, S, D]: tile j of (b, h) starts at ((b * Hkv + h) * n_tiles + j) * BS * D
    k_con = k_ord.view(bsz, n_tiles, hkv, bs, d).permute(0, 2, 1, 3, 4).contiguous()
    v_con = v_ord.view(bsz, n_tiles, hkv, bs, d).permute(0, 2, 1, 3, 4).contiguous()
    con_tbl = (torch.arange(bsz, device=kc.device)[:, None] * hkv * n_tiles + ordered % n_tiles).to(
        torch.int32
    )
    page = bs * d
    return {
        "paged-random": (kc, vc, tbl, hkv * page, page),
        "paged-ordered": (k_ord, v_ord, ordered, hkv * page, page),
        "contiguous": (k_con, v_con, con_tbl, page, n_tiles * page),
    }


def decode_compiles() -> dict:
    """The decode kernels Triton has compiled in this process, by ``id`` (its per-device caches; ``{}``
    where this Triton keeps none)."""
    from fastdeploy_paddlefleet.kernels import attention_kernels as ak

    caches = getattr(ak._decode_kernel, "device_caches", {}).values()
    return {id(k): k for c in caches for k in c[0].values()}


def with_facts(timed):
    """``timed`` (-> ``(ms, fields)``) with the registers, spills and shared memory of the decode
    kernel it compiled (the last one, where it compiled any) added to its fields."""

    def run():
        before = decode_compiles()
        ms, more = timed()
        new = [k for i, k in decode_compiles().items() if i not in before]
        if new:
            k = new[-1]
            more = {**more, "n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
        return ms, more

    return run


def run(fh=None, smoke: bool = False, tiles: bool = False, regs: bool = False) -> list[dict]:
    """Every figure of this benchmark, one record each (errors recorded, not raised). ``tiles``: ours
    with each of :data:`TILES` too; ``regs``: with each register cap of :data:`REGS`."""
    import torch

    if smoke:
        A.SH.update(A.SMOKE)
    bsz, ctx, hkv, d, bs = A.SH["bsz"], A.SH["ctx"] // A.BS * A.BS, A.HKV, A.D, A.BS
    batch = A.paged_batch([ctx - 1] * bsz, [1] * bsz, A.HQ, hkv, d, d, seed=1)
    nbytes = bsz * hkv * ctx * 2 * d * batch["kc"].element_size()
    recs: list[dict] = []

    def record(impl: str, timed, **extra) -> None:
        """Run ``timed()`` -> ``(ms, extra fields)`` and emit the record (an exception is recorded)."""
        rec = {"case": "decode-full", "impl": impl, "kind": "decode-ceiling", "kv_bytes": nbytes, **extra}
        try:
            ms, more = timed()
            rec.update(ms=round(ms, 4), gbps=round(nbytes / (ms * 1e-3) / 1e9, 1), **more)
        except Exception as e:  # noqa: BLE001 - keep the other figures
            rec["error"] = repr(e)[:300]
        A.emit(rec, fh)
        recs.append(rec)

    def best(fn):
        t = A.bench_best(fn)
        return t.pop("ms"), t

    read_pages = _reader()
    out = torch.empty(bsz * hkv * d, dtype=torch.float32, device=batch["kc"].device)
    lays = layouts(batch, bsz, ctx)
    k_con, v_con = lays["contiguous"][:2]
    want = (k_con.float() + v_con.float()).view(bsz, hkv, -1, d).sum(2).reshape(-1)
    for name, (k, v, tbl, sp, sh) in lays.items():
        for stages in STAGES if not smoke else (1,):
            kw = {} if smoke else dict(num_warps=4, num_stages=stages)

            def fn(k=k, v=v, tbl=tbl, sp=sp, sh=sh, kw=kw):
                read_pages[(bsz, hkv)](k, v, tbl, out, sp, sh, tbl.stride(0), ctx // bs, hkv, bs, d, **kw)

            if stages == STAGES[0] or smoke:  # each layout reads the same bytes, each exactly once
                fn()
                if not torch.allclose(out, want, rtol=1e-3, atol=1e-1):
                    raise ValueError(f"the plain reader's sums over {name} disagree with torch's")
            record(f"read-{name}", lambda fn=fn: best(fn), stages=stages)
    check = [(0, [0]), (bsz - 1, [0])]  # our kernel's rows checked against the dense reference
    for name in ("paged-random", "paged-ordered"):
        k, v, tbl, _, _ = lays[name]
        ours = dict(batch, kc=k, vc=v, table=tbl)
        run = lambda o=ours, n=name: A.run_ours(n, o, max_q_len=1, max_ctx=ctx, check=check)  # noqa: E731
        record(f"triton-{name}", with_facts(run))  # the default tile's compile: its registers too
    # ours on the contiguous layout too: a head-wise table (pages given directly) whose (request, kv head)
    # row lists that pair's consecutive pages, so each of our programs streams one contiguous run
    k, v = lays["contiguous"][:2]
    n_tiles = ctx // bs
    rows = torch.arange(bsz * hkv, device=k.device, dtype=torch.int32)[:, None] * n_tiles
    heads_tbl = rows + torch.arange(n_tiles, device=k.device, dtype=torch.int32)[None, :]
    ours = dict(batch, kc=k.view(-1, hkv, bs, d), vc=v.view(-1, hkv, bs, d), table=heads_tbl, headwise=True)
    record("triton-contiguous", lambda: A.run_ours("contiguous", ours, max_q_len=1, max_ctx=ctx, check=check))
    if not smoke:  # cuDNN on contiguous K/V, as attention.py times it
        k, v = k_con.view(bsz, hkv, ctx, d), v_con.view(bsz, hkv, ctx, d)
        q = torch.randn(bsz, A.HQ, 1, d, device=k.device, dtype=k.dtype)

        def cudnn():
            ms, how, t = A.peer_sdpa(q, k, v, "cudnn", causal=False)
            return ms, {"note": how, **{x: y for x, y in t.items() if x != "ms"}}

        record("sdpa-cudnn", cudnn)
        k, v, tbl, _, _ = lays["paged-random"]
        ours = dict(batch, kc=k, vc=v, table=tbl)
        if tiles:
            from fastdeploy_paddlefleet.kernels.paged_attention import TileConfig

            for bn, w, st, tma in TILES:
                cfg = TileConfig(16, bn, w, st, use_tma=tma)
                kw = dict(max_q_len=1, max_ctx=ctx, check=check, decode_config=cfg)
                record(
                    f"triton-paged-random-n{bn}w{w}s{st}" + ("-tma" if tma else ""),
                    lambda kw=kw: A.run_ours("tiles", ours, **kw),
                    block_n=bn, warps=w, stages=st, tma=tma,
                )  # fmt: skip
            # split-KV on a batch that fills the GPU without it: shorter programs, so a shorter drain
            # at the end of the launch, for one more reduce launch and the partials' traffic
            for n in SPLITS:
                kw = dict(max_q_len=1, max_ctx=ctx, check=check, num_splits=n)
                run = lambda kw=kw: A.run_ours("splits", ours, **kw)  # noqa: E731
                record(f"triton-paged-random-splits{n}", run, splits=n)
        if regs:
            from fastdeploy_paddlefleet.kernels.paged_attention import TileConfig

            for bn, w, st, cap in REGS:
                cfg = TileConfig(16, bn, w, st, maxnreg=cap)
                kw = dict(max_q_len=1, max_ctx=ctx, check=check, decode_config=cfg)

                record(
                    f"triton-paged-random-n{bn}w{w}s{st}-r{cap}",
                    with_facts(lambda kw=kw: A.run_ours("regs", ours, **kw)),
                    block_n=bn, warps=w, stages=st, maxnreg=cap,
                )  # fmt: skip
    return recs


def summary(recs: list[dict]) -> dict:
    """Best figure per implementation, and the ratios the issue's target reads."""
    best: dict[str, float] = {}
    for r in recs:
        if "gbps" in r:
            key = r["impl"]
            best[key] = max(best.get(key, 0.0), r["gbps"])

    def ratio(a: str, b: str) -> float | None:
        return round(best[a] / best[b], 3) if a in best and b in best and best[b] else None

    return {
        "gbps": best,
        "ours_vs_cudnn": ratio("triton-paged-random", "sdpa-cudnn"),
        "ours_vs_reader_same_layout": ratio("triton-paged-random", "read-paged-random"),
        "reader_random_vs_contiguous": ratio("read-paged-random", "read-contiguous"),
        "ours_ordered_vs_cudnn": ratio("triton-paged-ordered", "sdpa-cudnn"),
        # the same layout as cuDNN's: one contiguous run per (request, kv head)
        "ours_contiguous_vs_cudnn": ratio("triton-contiguous", "sdpa-cudnn"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Needs a CUDA GPU with torch and triton; --smoke on a CPU needs TRITON_INTERPRET=1.",
    )
    ap.add_argument("--out", default=None, help="JSON lines file to append to (default: print only)")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (on a CPU: under TRITON_INTERPRET=1)")
    ap.add_argument("--tag", action="append", default=[], help="KEY=VALUE added to every record (repeatable)")
    ap.add_argument(
        "--json", action="store_true", help="the summary as one JSON object on stdout's last line"
    )
    ap.add_argument("--tiles", action="store_true", help="ours with the TILES and SPLITS variants too")
    ap.add_argument("--regs", action="store_true", help="ours with the REGS register caps too")
    args = ap.parse_args(argv)
    existed = args.out is not None and os.path.lexists(args.out)
    try:
        tags = parse_tags(args.tag)
        fh = open_records(args.out, script="decode_ceiling", force=args.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    problem = device_problem("benchmarks/probes/decode_ceiling.py", "--smoke" if args.smoke else None)
    if problem:
        return give_up(fh, args.out, existed, problem)
    emit = A.emit
    A.emit = lambda rec, f=None: emit({**rec, **tags}, f)
    try:
        recs = run(fh, smoke=args.smoke, tiles=args.tiles, regs=args.regs)
    finally:
        A.emit = emit
        if fh is not None:
            fh.close()
    s = summary(recs)
    if args.json:
        print(json.dumps(s))
    else:
        for impl, g in sorted(s["gbps"].items(), key=lambda kv: -kv[1]):
            print(f"{impl:24} {g:8.1f} GB/s", file=sys.stderr)
        print({k: v for k, v in s.items() if k != "gbps"}, file=sys.stderr)
    return 0 if all(math.isfinite(v) for v in s["gbps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
