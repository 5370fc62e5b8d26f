"""Where a direct launch's host time goes on a GPU host: each part of a launch timed alone.

Parts: torch ``add_`` (yardstick), the current-stream query, one ``struct.pack_into`` of 39 values,
a ctypes call of a one-argument driver function, ``cuLaunchKernel`` through ctypes with packed
parameters (no pack), the same through a 10-line C extension (METH_FASTCALL, built with Triton's
``compile_module_from_src``), our launcher whole, Triton's compiled launcher with addresses. Prints
JSON lines (median of 5 loops of 2000 calls, us per call).

``--wrappers``: each one-shot wrapper of ``attention.py --cases host`` (same shapes) split in three
figures on this host, to place what a one-shot costs beyond its Python and one launch: ``whole`` (the
call as served), ``python`` (the same call, its plan's kept kernels swapped for no-ops: real CUDA
tensors, the real stream query) and ``kept-launch`` (each kept kernel the call launched, called alone
with the grid, arguments and stream the call gave it). ``whole - python - kept-launch`` is what the
pieces do not explain alone (e.g. the driver's cost inside the call differing from the same launch
in a tight loop). The Hopper prefill's kept launch cannot be called alone: a one-shot plan unbinds its
caches after each call, so its TMA descriptors have no base between calls (that wrapper's record is its
error).

Needs a CUDA GPU (it launches kernels through the driver, ``libcuda.so.1``) with torch and triton
(the ``bench`` extra); without one it exits 2 saying so.

Usage::

    python benchmarks/probes/launch_parts.py [--out FILE.jsonl] [--wrappers]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: attention.py, _outputs.py
ROOT = os.path.dirname(BENCH)
for _dir in (BENCH, HERE):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
import attention as A  # noqa: E402  (puts this tree's src/ first on sys.path; the trivial kernels)
import host_python as HP  # noqa: E402  (lanes: which path each call took)
from _outputs import device_problem, fail, force_help, give_up, open_records  # noqa: E402

C_SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
static launch_t fn = NULL;
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (n != 8) { PyErr_SetString(PyExc_TypeError, "launch takes 8 arguments"); return NULL; }
  unsigned long long v[8];
  for (int i = 0; i < 8; i++) {
    v[i] = PyLong_AsUnsignedLongLong(args[i]);
    if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  }
  if (!fn) {
    void *h = dlopen("libcuda.so.1", RTLD_LAZY);
    if (h) fn = (launch_t)dlsym(h, "cuLaunchKernel");
    if (!fn) { PyErr_SetString(PyExc_RuntimeError, "no cuLaunchKernel"); return NULL; }
  }
  int r = fn((void *)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3], (unsigned)v[4], 1, 1,
             (unsigned)v[5], (void *)v[6], (void **)v[7], NULL);
  return PyLong_FromLong(r);
}
static PyMethodDef methods[] = {{"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, ""},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "fdfleet_launch_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fdfleet_launch_probe(void) { return PyModule_Create(&mod); }
"""


def timeit(fn, calls=2000, loops=5):
    import torch

    fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res.append((t1 - t0) / calls * 1e6)
    res.sort()
    return res[len(res) // 2], res[0]


class _Recorder:
    """A kept kernel's stand-in that records each launch (``grid, args, stream``) and, unless ``stub``,
    launches it through the kept kernel it wraps."""

    def __init__(self, hit) -> None:
        self.hit, self.calls, self.stub = hit, [], False

    def __call__(self, grid, args, stream) -> None:
        if len(self.calls) < 4:
            self.calls.append((grid, args, stream))
        if not self.stub:
            self.hit(grid, args, stream)


def wrapper_parts(emit) -> None:
    """The ``--wrappers`` figures (module docstring)."""
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    cases = dict(A.one_shot_cases())
    for name, fn in cases.items():
        try:
            emit(_wrapper_record(name, fn, cw._PLANS if name == "write_kv_cache" else pa._PLANS))
        except Exception as e:  # noqa: BLE001 - one wrapper's failure is its record
            emit({"kind": "launch-part", "wrapper": name, "error": repr(e)[:300]})


def _wrapper_record(name: str, fn, memo) -> dict:
    """One wrapper's ``--wrappers`` record: ``fn`` called through the plan ``memo`` keeps."""
    memo.clear()  # this wrapper's plan alone in its memo
    fn()  # compiles and keeps every kernel the call needs
    fn()
    lane = HP.lanes(fn)
    plans = memo.plans()
    if len(plans) != 1:
        raise RuntimeError(f"{len(plans)} plans in the memo")
    kept = plans[0].kernels._kernels
    recs = {key: _Recorder(hit) for key, hit in kept.items()}
    kept.update(recs)
    try:
        fn()
        launched = [(r.hit, *r.calls[-1]) for r in recs.values() if r.calls]
        whole = timeit(fn)
        for r in recs.values():
            r.stub = True
        python = timeit(fn)
    finally:
        kept.update({key: r.hit for key, r in recs.items()})

    def alone():
        for hit, grid, args, stream in launched:
            hit(grid, args, stream)

    launch = timeit(alone)
    figs = {"whole": whole[0], "python": python[0], "kept-launch": launch[0]}
    return {
        "kind": "launch-part", "wrapper": name, "launches": len(launched), "lanes": lane,
        **{k: round(v, 2) for k, v in figs.items()},
        "unexplained": round(whole[0] - python[0] - launch[0], 2),
        **{k + "_min": round(v[1], 2) for k, v in zip(figs, (whole, python, launch), strict=True)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog="Needs a CUDA GPU with torch and triton."
    )
    ap.add_argument("--out", default=None, help="also append the JSON lines to this .jsonl file")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument("--wrappers", action="store_true", help="the one-shot wrappers' parts (docstring)")
    a = ap.parse_args(argv)
    existed = a.out is not None and os.path.lexists(a.out)
    try:
        fh = open_records(a.out, script="launch_parts", force=a.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    problem = device_problem("benchmarks/probes/launch_parts.py")
    if problem:
        return give_up(fh, a.out, existed, problem)
    import torch
    from triton.runtime import driver

    from fastdeploy_paddlefleet.kernels.launch.own_launcher import own_launcher

    _, trivial40 = A.trivial_kernels()
    x = torch.zeros(1024, device="cuda")
    ints = [3] * 38
    k = trivial40[(1,)](x, *ints, N=16)
    addr = (x.data_ptr(), *ints)
    own = own_launcher(k, len(addr), (16,))
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    own((1,), addr, stream)  # packs the parameters the bare cuLaunchKernel parts below reuse
    buf = own.buf
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    byref = ctypes.byref(ctx)
    st = struct.Struct("<Q" + "i" * 38)
    raw = (ctypes.c_char * 512)()
    from triton.runtime.build import compile_module_from_src

    probe = compile_module_from_src(C_SRC, "fdfleet_launch_probe")
    func, block, smem, params = own.function, own.block, own.shared, buf.kernel_params
    parts = {
        "torch-add_": lambda: x.add_(1),
        "get-current-stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "struct-pack-39": lambda: st.pack_into(raw, 0, *addr),
        "ctypes-call-1-arg": lambda: lib.cuCtxGetCurrent(byref),
        "cuLaunchKernel-ctypes": lambda: own._launch(func, 1, 1, 1, block, 1, 1, smem, stream, params, None),
        "cuLaunchKernel-c-fastcall": lambda: probe.launch(func, 1, 1, 1, block, smem, stream, params),
        "own-launcher-whole": lambda: own((1,), addr, stream),
        "triton-compiled-addr": lambda: k.run(
            1, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *addr, 16
        ),
    }

    def emit(rec: dict) -> None:
        print(json.dumps(rec))
        if fh is not None:
            fh.record(rec)

    try:
        for name, fn in parts.items():
            med, best = timeit(fn)
            emit({"kind": "launch-part", "part": name, "us": round(med, 2), "us_min": round(best, 2)})
        if a.wrappers:
            wrapper_parts(emit)
    finally:
        if fh is not None:
            fh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
