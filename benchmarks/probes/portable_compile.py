"""The portable kernels compiled offline for sm_90: registers, spills and instruction counts.

Builds ``paged_attention``'s portable prefill launch on CPU tensors with the GPU's tile configs, catches
the launch (nothing runs), compiles the kernel for sm_90 through a stubbed driver (as
``hopper_compile.py`` does) and reads the cubin with ``cuobjdump``. ``--src DIR`` compiles another source
tree's kernel (an A/B against an older commit, e.g. ``git archive`` into a directory). Cases:

* ``causal``: 128 / 128, 32 q heads / 8 kv heads, 128 x 64 tiles over 8 warps (the H200 default);
* ``window``: the same heads, window 1024, 64 x 64 tiles over 4 warps (the sliding default);
* ``mla``: 192 / 128, 16 heads, no GQA, 128 x 64 tiles over 8 warps, 2 stages;
* ``decode-fp8``: the decode kernel over a block_wise_fp8 cache (bf16 q, 32 / 8 heads, 128 / 128, one
  split, 64-key tiles over 4 warps, 3 stages; ``--f16-codes`` picks how e4m3 codes are read:
  ``paged_attention.FP8_F16_CODES_DECODE``), with ``lds_u8`` (byte loads from shared memory: V's codes
  read one at a time) and the instructions of each innermost key loop (``inner_loops``; the middle one
  is the unmasked loop); ``--key-rows on`` compiles the key-rows layout instead (``key_rows`` in the
  record).

Prints one line per case (``--json``: one JSON object). Needs torch and triton (Triton's bundled
``ptxas`` / ``cuobjdump``); no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

#: name -> (q heads, kv heads, qk dim, v dim, window_left, (block_m, block_n, warps, stages))
CASES = {
    "causal": (32, 8, 128, 128, None, (128, 64, 8, 3)),
    "window": (32, 8, 128, 128, 1023, (64, 64, 4, 3)),
    "mla": (16, 16, 192, 128, None, (128, 64, 8, 2)),
    "decode-fp8": (32, 8, 128, 128, None, (16, 64, 4, 3)),
}


def _catch_launch(direct, caught: list):
    """``direct.KernelCache.launch`` replaced by one that records ``(kernel, grid, args, consts)``; returns
    the original."""
    real = direct.KernelCache.launch
    direct.KernelCache.launch = lambda self, kernel, key, grid, args, consts, stream: caught.append(
        (kernel, grid, args, consts)
    )
    return real


def _decode_fp8(pa, direct, f16_codes: int, key_rows: bool) -> tuple:
    """The fp8 decode case's caught launch: 4 requests of 4001 keys, block_wise_fp8 codes and scales, the
    decode layout forced (``key_rows``: ``paged_attention.DECODE_KEY_ROWS``; an older tree without it: its
    only layout)."""
    import torch

    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    hq, hkv, dqk, dv, _, (bm, bn, warps, stages) = CASES["decode-fp8"]
    nb, bs = 70, 64
    caught = []
    real = _catch_launch(direct, caught)
    kept = getattr(pa, "DECODE_KEY_ROWS", None)
    if hasattr(pa, "DECODE_KEY_ROWS"):
        pa.DECODE_KEY_ROWS = key_rows
    try:
        q = torch.zeros(4, hq, dqk, dtype=torch.bfloat16)
        kc = torch.zeros(nb, hkv, bs, dqk, dtype=torch.uint8)
        vc = torch.zeros(nb, hkv, bs, dv, dtype=torch.uint8)
        ks = torch.zeros(nb, hkv, bs, dtype=torch.bfloat16)
        pa.paged_attention(
            q, kc, vc, torch.arange(5, dtype=torch.int32), torch.full((4,), 4000, dtype=torch.int32),
            torch.arange(64, dtype=torch.int32)[None].repeat(4, 1), scale=0.1, num_splits=1, max_q_len=1,
            max_context_len=4001, kv_quant=kv_cache_quant("block_wise_fp8"), key_scale=ks,
            value_scale=ks.clone(),
            decode_config=pa.TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages),
        )  # fmt: skip
    finally:
        direct.KernelCache.launch = real
        if hasattr(pa, "DECODE_KEY_ROWS"):
            pa.DECODE_KEY_ROWS = kept
    kernel, grid, args, consts = caught[0]
    return kernel, grid, args, dict(consts, F16_CODES=f16_codes)  # CPU tensors: the plan takes 2 for 3


def compile_case(name: str, f16_codes: int = 1, key_rows: bool = False) -> dict:
    """Compile case ``name`` of :data:`CASES` with the imported ``fastdeploy_paddlefleet`` and read its
    resources: registers, stack, ``LDL`` / ``STL`` (spills), SASS instructions."""
    import torch
    from hopper_compile import inner_loop_sizes, read_cubin

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    try:
        from fastdeploy_paddlefleet.kernels.launch import direct
    except ImportError:  # an older tree: the launch machinery as one module
        from fastdeploy_paddlefleet.kernels import _launch as direct
    if name == "decode-fp8":
        kernel, grid, args, consts = _decode_fp8(pa, direct, f16_codes, key_rows)
        res, sass = read_cubin(kernel.warmup(*args, grid=grid, **consts).asm["cubin"])
        return dict(
            case=name, f16_codes=f16_codes, key_rows=bool(consts.get("KEY_ROWS", False)), regs=res["regs"],
            stack=res["stack"], ldl=sass.count(" LDL"), stl=sass.count(" STL"), lds_u8=sass.count("LDS.U8"),
            inner_loops=inner_loop_sizes(sass),
        )  # fmt: skip
    hq, hkv, dqk, dv, window, (bm, bn, warps, stages) = CASES[name]
    caught = []
    real = _catch_launch(direct, caught)
    try:
        t, bs = 256, 64
        nb = t // bs + 2
        q = torch.zeros(t, hq, dqk, dtype=torch.bfloat16)
        kc = torch.zeros(nb, hkv, bs, dqk, dtype=torch.bfloat16)
        vc = torch.zeros(nb, hkv, bs, dv, dtype=torch.bfloat16)
        cfg = pa.TileConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        pa.paged_attention(
            q, kc, vc, torch.tensor([0, t], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.arange(nb, dtype=torch.int32)[None], scale=0.1, prefill_config=cfg, window_left=window,
            max_q_len=t, max_context_len=t,
        )  # fmt: skip
    finally:
        direct.KernelCache.launch = real
    kernel, grid, args, consts = caught[0]
    res, sass = read_cubin(kernel.warmup(*args, grid=grid, **consts).asm["cubin"])
    return dict(
        case=name, regs=res["regs"], stack=res["stack"], ldl=sass.count(" LDL"), stl=sass.count(" STL"),
        instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]", sass)),
        block_nm=consts.get("BLOCK_NM", bn),
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Needs torch and triton (Triton's bundled ptxas and cuobjdump); no GPU.",
    )
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="repeatable (default: all)")
    ap.add_argument("--src", default=os.path.join(ROOT, "src"), help="the source tree to compile")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    ap.add_argument(
        "--f16-codes", type=int, choices=(1, 2, 3), default=1,
        help="decode-fp8: how e4m3 codes are read under a bf16 model (paged_attention.FP8_F16_CODES_DECODE)",
    )  # fmt: skip
    ap.add_argument(
        "--key-rows", choices=("on", "off"), default="off",
        help="decode-fp8: the key tiles as the dots' rows (paged_attention.DECODE_KEY_ROWS; default off: the "
        "query-rows layout)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    for module in ("torch", "triton"):
        try:
            __import__(module)
        except ImportError:
            print(f"error: {module} is not installed (pip install -e '.[bench]')", file=sys.stderr)
            return 2
    if not os.path.isdir(os.path.join(args.src, "fastdeploy_paddlefleet")):
        print(f"error: --src {args.src!r} holds no fastdeploy_paddlefleet package", file=sys.stderr)
        return 2
    sys.path.insert(0, args.src)
    from hopper_compile import stub_driver

    stub_driver()
    rc = 0
    for name in args.case or list(CASES):
        try:
            rec = compile_case(name, args.f16_codes, args.key_rows == "on")
        except Exception as e:  # noqa: BLE001 - report every case
            rec, rc = {"case": name, "error": repr(e)[:500]}, 1
        if args.json or "error" in rec or name == "decode-fp8":
            print(json.dumps(rec), flush=True)
        else:
            print(
                f"{name}: {rec['regs']} registers, stack {rec['stack']} B, LDL {rec['ldl']} / STL "
                f"{rec['stl']}, {rec['instructions']} instructions, masked tiles of {rec['block_nm']} keys",
                flush=True,
            )
    return rc


if __name__ == "__main__":
    sys.exit(main())
