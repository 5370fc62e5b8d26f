"""``cuLaunchKernel`` called from a 30-line C extension instead of through ctypes (issue 20).

On the H200's host a ctypes call of ``cuLaunchKernel`` (11 arguments converted by ``argtypes``) costs
7.0 us, the same launch from C reached by ``METH_FASTCALL`` 4.4 us (``benchmarks/launch_parts.py``,
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

static PyMethodDef methods[] = {
  {"set_target", set_target, METH_O, "the address of cuLaunchKernel"},
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "cuLaunchKernel's 11 arguments"},
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


__all__ = ["C_SOURCE", "build_module", "fast_launch"]
