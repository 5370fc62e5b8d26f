"""Compile the Hopper prefill kernel for sm_90a without a GPU: registers, stack, spills, shared memory.

Compiles with the Triton on the path (3.6, the device's, and 3.9 both compile; to compile with another,
e.g. ``pip install --target DIR triton==3.6.0`` then ``PYTHONPATH=DIR:src``); torch (CPU) builds the plans.
Triton's own ptxas and cuobjdump assemble and read the cubin. A stub driver stands in for the GPU.

Usage::

    PYTHONPATH=DIR:src python benchmarks/probes/hopper_compile.py [--case '{"dqk": 192, "dv": 128}' ...]
        [--sass-dir DIR] [--json]

Each case: ``dqk``, ``dv`` and optionally ``hq``, ``hkv``, ``bs``, ``sink_mode``, ``has_window``,
``headwise``, ``softcap`` and any :class:`HopperPlan` keyword (``block_n``, ``q_bufs``, ``num_stages``,
``q_late``, ``profile``, ``peel``, ``pingpong``, ``consumer_regs``, ``producer_regs``). ``LDL`` / ``STL``
count local-memory loads / stores in the SASS: where they sit (per tile, per item, at a partition's
entry) needs the SASS (``--sass-dir``). ``wgmma_serialized``: ptxas's reason code when it serialised
every wgmma (the kernel then runs its tensor-core work one instruction at a time); ``bars``: the
named-barrier instructions by id and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _outputs import Claim, Refused, claim, fail, force_help, mark_line, replacing  # noqa: E402

SCRIPT = "hopper_compile"  # the mark on the first line of each SASS file (benchmarks/_outputs.py)
DEFAULT_CASES = [
    dict(dqk=128, dv=128, hq=32, hkv=8),
    dict(dqk=192, dv=128, hq=16, hkv=16),
    dict(dqk=256, dv=256, hq=32, hkv=8),
]


def stub_driver() -> None:
    """Make Triton compile for sm_90 (device 0, stream 0) on a machine without a GPU."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Stub:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_Stub())


def _ptxas_path() -> str:
    """The ptxas Triton itself runs for sm_90 (3.9 takes ``ptxas-blackwell``, a newer CUDA, for sm_90 too:
    the PTX it emits is a version the older ``bin/ptxas`` rejects)."""
    import triton
    from triton.backends.nvidia import compiler

    get = getattr(compiler, "get_ptxas", None)
    if get is not None:
        return get(90).path
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _ptxas_info(ptx: str, ptxas: str) -> dict:
    """Re-assemble the PTX with ``ptxas -v`` for the notes Triton's own call hides: every wgmma of the
    kernel serialised (C7514: a non-wgmma instruction may read an accumulator while its wgmma is in
    flight; C7512: too few registers to keep them in flight; C75xx: other reasons) and C7517 (a wait
    the compiler injected)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        raise ValueError(f"ptxas failed: {r.stderr[-500:]!r}")
    text = r.stdout + r.stderr
    why = re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are ser", text)
    return dict(serialized=",".join(sorted(set(why))) or False, injected=text.count("C7517"))


def _bars(sass: str) -> dict:
    """Named-barrier instructions in the SASS, by kind and id (``BAR.SYNC 0x2, 0x80``: id 2, 128 threads)."""
    out: dict = {}
    pat = r"BAR\.(SYNC|ARV|RED\.\w+)(?:\.DEFER_BLOCKING)?\s+(0x[0-9a-f]+)(?:,\s*(0x[0-9a-f]+))?"
    for m in re.finditer(pat, sass):
        key = f"{m[1]} {int(m[2], 16)}" + (f"/{int(m[3], 16)}" if m[3] else "")
        out[key] = out.get(key, 0) + 1
    return out


def _instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every SASS instruction."""
    return [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def inner_loops(sass: str) -> list[tuple[int, int]]:
    """The address ranges ``[target, branch]`` of backward branches that hold no other backward branch
    (the key-tile loops; the wait spin loops hold none), in address order."""
    loops = []
    for addr, text in _instructions(sass):
        b = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if b and int(b[1], 16) <= addr:
            loops.append((int(b[1], 16), addr))
    return sorted(lo for lo in loops if not any(o != lo and lo[0] <= o[0] and o[1] <= lo[1] for o in loops))


def inner_loop_sizes(sass: str) -> list[int]:
    """Instructions in each of :func:`inner_loops` (a key tile's work per thread)."""
    ins = _instructions(sass)
    return [sum(1 for addr, _ in ins if a <= addr <= b) for a, b in inner_loops(sass)]


def _inner_loop_spills(sass: str) -> int:
    """``LDL`` / ``STL`` inside :func:`inner_loops`."""
    inner = inner_loops(sass)
    return sum(
        1
        for addr, text in _instructions(sass)
        if re.search(r"\b(LDL|STL)\b", text) and any(a <= addr <= b for a, b in inner)
    )


def sass_path(sass_dir: str, case: dict) -> str:
    """Where ``--sass-dir`` puts ``case``'s SASS."""
    name = "_".join(f"{k}{v}" for k, v in sorted(case.items())).replace(" ", "")
    return os.path.join(sass_dir, f"hopper_prefill_{name}.sass")


def read_cubin(cubin: bytes) -> tuple[dict, str]:
    """A compiled kernel's cubin read with Triton's bundled ``cuobjdump``: its resources
    ``{regs, stack, local}`` and its SASS."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    if m is None:
        raise ValueError(f"no resource line in cuobjdump's report: {res[-300:]!r}")
    return dict(regs=int(m[1]), stack=int(m[2]), local=int(m[3])), sass


def compile_case(case: dict, sass_file: Claim | None = None) -> dict:
    """Compile one case (see the module docstring) and read its resources off the cubin: the build
    ``FDFLEET_PREFILL_KERNEL=hopper`` checks on an untested Triton (``kernels/hopper_support.py``)."""
    from fastdeploy_paddlefleet.kernels.hopper_support import compile_case as build

    kernel, consts = build(case)
    res, sass = read_cubin(kernel.asm["cubin"])
    ptxas = _ptxas_info(kernel.asm["ptx"], _ptxas_path())
    tiles = {
        k: consts[k] for k in ("BLOCK_N", "Q_BUFS", "NUM_STAGES", "QKC", "CONSUMER_REGS", "PRODUCER_REGS")
    }
    rec = dict(case=case, regs_at_entry=res["regs"], stack=res["stack"], local=res["local"],
               smem=kernel.metadata.shared, ldl=sass.count(" LDL"), stl=sass.count(" STL"),
               hgmma=sass.count("HGMMA"), spills_in_inner_loops=_inner_loop_spills(sass),
               wgmma_serialized=ptxas["serialized"],
               wait_injected=ptxas["injected"], bars=_bars(sass), **tiles)  # fmt: skip
    if sass_file is not None:  # its own file (a mark on the first line), all or nothing
        with replacing(sass_file) as tmp:
            tmp.write_text(mark_line(SCRIPT) + sass)
        rec["sass"] = str(sass_file.path)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", default=None, help="a JSON object (repeatable)")
    ap.add_argument("--sass-dir", default=None, help="write each case's SASS here")
    ap.add_argument("--force", action="store_true", help=force_help("a case's .sass file in --sass-dir"))
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = ap.parse_args(argv)
    try:
        cases = [json.loads(c) for c in args.case] if args.case else DEFAULT_CASES
    except json.JSONDecodeError as e:
        print(f"error: --case is not JSON: {e}", file=sys.stderr)
        return 2
    try:  # each case's SASS file: refused by name before any work
        sass = [claim(sass_path(args.sass_dir, c), script=SCRIPT, force=args.force, flag="--sass-dir")
                if args.sass_dir else None for c in cases]  # fmt: skip
    except ValueError as e:
        return fail(e)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    stub_driver()
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

    if not hp.gluon_available():
        print(f"error: gluon unavailable: {hp.GLUON_IMPORT_ERROR!r}", file=sys.stderr)
        return 2
    rc = 0
    for case, sass_file in zip(cases, sass, strict=True):
        try:
            rec = compile_case(case, sass_file)
        except Refused as e:
            return fail(e)
        except Exception as e:  # noqa: BLE001 - report every case
            rec, rc = {"case": case, "error": repr(e)[:500]}, 1
        if args.json:
            print(json.dumps(rec), flush=True)
        elif "error" in rec:
            print(f"{json.dumps(case)}: {rec['error']}", flush=True)
        else:
            print(f"{json.dumps(case)}: entry regs {rec['regs_at_entry']}, stack {rec['stack']} B, "
                  f"LDL {rec['ldl']} / STL {rec['stl']}, smem {rec['smem']} B, BLOCK_N {rec['BLOCK_N']}, "
                  f"Q_BUFS {rec['Q_BUFS']}, stages {rec['NUM_STAGES']}, HGMMA {rec['hgmma']}, "
                  f"LDL/STL in inner loops {rec['spills_in_inner_loops']}, "
                  f"wgmma serialised {rec['wgmma_serialized']}, injected waits {rec['wait_injected']}, "
                  f"bars {rec['bars']}", flush=True)  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
