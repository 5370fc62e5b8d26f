"""``cuLaunchKernel`` called from a 30-line C extension instead of through ctypes (issue 20).

On the H200's host a ctypes call of ``cuLaunchKernel`` (11 arguments converted by ``argtypes``) costs
7.0 us, the same launch from C reached by ``METH_FASTCALL`` 4.4 us (``benchmarks/probes/launch_parts.py``,
same call; torch ``add_`` 9.1 us): 2.6 us per launch, two launches per served layer. The module is
built once per machine with Triton's own ``compile_module_from_src`` (the compiler and Python headers
Triton needs for its launchers anyway; cached in Triton's cache directory) and told the address of
libcuda's ``cuLaunchKernel`` through :func:`fast_launch`, so it links nothing itself.

``launch`` takes the 11 arguments of ``cuLaunchKernel`` in its order as Python ints (``None`` reads as
0) and returns the ``CUresult``, as the ctypes function does: callers switch between the two freely.
The GIL is released around the driver call, as ctypes and Triton's launcher do. Where the module
cannot be built (no compiler, no headers, an older Triton), :func:`fast_launch` returns ``None`` and
the ctypes call serves (logged once).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

logger = logging.getLogger(__name__)

MODULE_NAME = "fdfleet_fast_launch"

C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        void *, void **, void **);
static launch_t target = NULL;

static int as_u64(PyObject *o, unsigned long long *v) {
  if (o == Py_None) { *v = 0; return 0; }
  *v = PyLong_AsUnsignedLongLong(o);
  return (*v == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *set_target(PyObject *self, PyObject *arg) {
  unsigned long long p;
  if (as_u64(arg, &p)) return NULL;
  target = (launch_t)(uintptr_t)p;
  Py_RETURN_NONE;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  unsigned long long v[11];
  if (n != 11) {
    PyErr_SetString(PyExc_TypeError, "launch takes the 11 arguments of cuLaunchKernel");
    return NULL;
  }
  if (!target) { PyErr_SetString(PyExc_RuntimeError, "no cuLaunchKernel set"); return NULL; }
  for (int i = 0; i < 11; i++) if (as_u64(args[i], &v[i])) return NULL;
  int r;
  Py_BEGIN_ALLOW_THREADS;
  r = target((void *)(uintptr_t)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3], (unsigned)v[4],
             (unsigned)v[5], (unsigned)v[6], (unsigned)v[7], (void *)(uintptr_t)v[8],
             (void **)(uintptr_t)v[9], (void **)(uintptr_t)v[10]);
  Py_END_ALLOW_THREADS;
  return PyLong_FromLong(r);
}

/* One spec entry per packed value: uint32 offset from base, uint16 index into args, uint8 struct code. */
typedef struct { uint32_t off; uint16_t arg; uint8_t code; uint8_t pad; } entry_t;

/* Write v at p as struct code c; 0 on success, -1 where struct.pack_into would not take it as an
   exact int or float here (the caller then packs in Python, which converts or raises). */
static int put(char *p, char c, PyObject *v) {
  long long x;
  unsigned long long u;
  double d;
  switch (c) {
  case 'Q':
    if (v == Py_None) { u = 0; memcpy(p, &u, 8); return 0; }
    if (!PyLong_Check(v)) return -1;
    u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    memcpy(p, &u, 8); return 0;
  case 'f': case 'd': case 'e':
    if (!PyFloat_Check(v) && !PyLong_Check(v)) return -1;
    d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    if (c == 'd') { memcpy(p, &d, 8); return 0; }
    if (c == 'f') { /* struct refuses a finite value past float's range: so does this */
      float f = (float)d;
      if (isfinite(d) && !isfinite(f)) return -1;
      memcpy(p, &f, 4);
      return 0;
    }
    return PyFloat_Pack2(d, p, 1);
  default: {
    long long lo, hi;
    size_t size;
    switch (c) {
    case 'q': lo = LLONG_MIN; hi = LLONG_MAX; size = 8; break;
    case 'i': lo = INT32_MIN; hi = INT32_MAX; size = 4; break;
    case 'I': lo = 0; hi = UINT32_MAX; size = 4; break;
    case 'h': lo = INT16_MIN; hi = INT16_MAX; size = 2; break;
    case 'H': lo = 0; hi = UINT16_MAX; size = 2; break;
    case 'b': lo = INT8_MIN; hi = INT8_MAX; size = 1; break;
    case 'B': lo = 0; hi = UINT8_MAX; size = 1; break;
    default: return -1;
    }
    if (!PyLong_Check(v)) return -1;
    x = PyLong_AsLongLong(v);
    if ((x == -1 && PyErr_Occurred()) || x < lo || x > hi) return -1;
    memcpy(p, &x, size); /* the low bytes: CUDA hosts are little-endian, as struct's "<" */
    return 0;
  }
  }
}

/* pack_launch(base, spec, args, function, gx, gy, gz, block_x, shared, stream, kernel_params):
   args' values into the parameter buffer at base as spec says, then cuLaunchKernel. Returns the
   CUresult, or -1 (no CUresult is negative) with nothing launched where a value is not a plain int /
   float / None of its code's range: the caller packs those in Python. */
static PyObject *pack_launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  unsigned long long base, v[8];
  if (n != 11) {
    PyErr_SetString(PyExc_TypeError, "pack_launch takes 11 arguments");
    return NULL;
  }
  if (!target) { PyErr_SetString(PyExc_RuntimeError, "no cuLaunchKernel set"); return NULL; }
  if (!PyBytes_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "pack_launch: spec must be bytes and args a tuple");
    return NULL;
  }
  if (as_u64(args[0], &base)) return NULL;
  for (int i = 0; i < 8; i++) if (as_u64(args[3 + i], &v[i])) return NULL;
  const entry_t *e = (const entry_t *)PyBytes_AS_STRING(args[1]);
  Py_ssize_t ne = PyBytes_GET_SIZE(args[1]) / (Py_ssize_t)sizeof(entry_t);
  PyObject *tup = args[2];
  Py_ssize_t na = PyTuple_GET_SIZE(tup);
  for (Py_ssize_t i = 0; i < ne; i++) {
    char *at = (char *)(uintptr_t)base + e[i].off;
    if (e[i].arg >= na || put(at, (char)e[i].code, PyTuple_GET_ITEM(tup, e[i].arg))) {
      PyErr_Clear();
      return PyLong_FromLong(-1);
    }
  }
  int r;
  Py_BEGIN_ALLOW_THREADS;
  r = target((void *)(uintptr_t)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3], (unsigned)v[4], 1, 1,
             (unsigned)v[5], (void *)(uintptr_t)v[6], (void **)(uintptr_t)v[7], NULL);
  Py_END_ALLOW_THREADS;
  return PyLong_FromLong(r);
}

static PyMethodDef methods[] = {
  {"set_target", set_target, METH_O, "the address of cuLaunchKernel"},
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "cuLaunchKernel's 11 arguments"},
  {"pack_launch", (PyCFunction)(void (*)(void))pack_launch, METH_FASTCALL,
   "pack a call's values into the parameter buffer, then cuLaunchKernel"},
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fdfleet_fast_launch", NULL, -1, methods};
PyMODINIT_FUNC PyInit_fdfleet_fast_launch(void) { return PyModule_Create(&module); }
"""

#: the built module (``False``: it could not be built here; ``None``: not tried yet)
_MODULE: Any = None


def build_module() -> Any:
    """The C module, built (or loaded from Triton's cache) on first use; ``None`` where it cannot be."""
    global _MODULE
    if _MODULE is None:
        try:
            from triton.runtime.build import compile_module_from_src

            _MODULE = compile_module_from_src(C_SOURCE, MODULE_NAME)
        except Exception as e:  # noqa: BLE001 - any failure: the ctypes call serves
            logger.info("fast launch module not built (%r): launches go through ctypes", e)
            _MODULE = False
    return _MODULE or None


#: what ``pack_launch`` returns when it launched nothing: a value it does not pack (the caller packs)
NOT_PACKED = -1

#: one ``pack_launch`` spec entry: offset from the buffer's base (u32), argument index (u16), struct code
SPEC_ENTRY = "<IHBx"


def fast_pack_launch(target: Any) -> Any:
    """``pack_launch`` of the C module calling ``target`` (as :func:`fast_launch`), or ``None``:
    ``pack_launch(base, spec, args, function, gx, gy, gz, block_x, shared, stream, kernel_params)``
    writes each ``args[index]`` as its struct code at ``base + offset`` (``spec``: :data:`SPEC_ENTRY`
    entries), then calls ``cuLaunchKernel`` (grid ``gx, gy, gz``, block ``block_x, 1, 1``) and returns
    the ``CUresult``; :data:`NOT_PACKED` with nothing launched where a value is not a plain int /
    float (or ``None`` for a pointer) that fits its code, so the caller packs it in Python. One call
    instead of an ``itemgetter``, ``struct.pack_into`` and the launch (~1.3 us less here per launch)."""
    launch = fast_launch(target)
    return None if launch is None else _MODULE.pack_launch


def fast_launch(target: Any) -> Any:
    """``launch`` of the C module calling ``target`` (a ctypes function with ``cuLaunchKernel``'s
    signature, e.g. libcuda's), or ``None`` (no module, or ``target`` is not a C function pointer)."""
    mod = build_module()
    if mod is None:
        return None
    try:
        address = ctypes.cast(target, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):  # a Python stand-in (tests): nothing to call from C
        return None
    if not address:
        return None
    mod.set_target(address)
    return mod.launch


__all__ = ["C_SOURCE", "NOT_PACKED", "SPEC_ENTRY", "build_module", "fast_launch", "fast_pack_launch"]
