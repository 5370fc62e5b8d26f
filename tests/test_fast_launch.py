"""The C entry point of our launcher (kernels/_fast_launch.py) against ctypes' call of the same function.

No GPU here: the module is built as on a GPU machine (Triton's ``compile_module_from_src``) and given
a C-callable stand-in for ``cuLaunchKernel`` (a ctypes callback) that records what it receives; the
reference is the same stand-in called through ctypes with cuLaunchKernel's argument types, as the
launcher calls libcuda without the module. GPU: tests/test_cuda_launch.py launches through it.
"""

from __future__ import annotations

import ctypes

import pytest

fl = pytest.importorskip("fastdeploy_paddlefleet.kernels._fast_launch")

VP, U32 = ctypes.c_void_p, ctypes.c_uint
PROTO = ctypes.CFUNCTYPE(ctypes.c_int, VP, U32, U32, U32, U32, U32, U32, U32, VP, VP, VP)


def _recording_target(result: int = 0):
    seen = []

    def target(*args):
        seen.append(tuple(0 if a is None else a for a in args))
        return result

    return PROTO(target), seen


@pytest.fixture(scope="module")
def module():
    mod = fl.build_module()
    if mod is None:
        pytest.skip("the C module does not build here (no compiler or Python headers)")
    return mod


def test_the_c_entry_passes_every_argument_as_ctypes_does(module):
    cfn, seen = _recording_target(0)
    launch = fl.fast_launch(cfn)
    assert launch is not None
    args = (0x7F00_0000_1000, 132, 2, 3, 384, 1, 1, 197000, 0x5555_0000, 0x6666_0008, None)
    assert launch(*args) == 0
    ref = ctypes.CFUNCTYPE(ctypes.c_int, VP, U32, U32, U32, U32, U32, U32, U32, VP, VP, VP)(
        ctypes.cast(cfn, VP).value
    )
    assert ref(*args) == 0
    assert seen[0] == seen[1] == tuple(0 if a is None else a for a in args)


def test_the_driver_result_comes_back_and_bad_arguments_raise(module):
    cfn, _ = _recording_target(201)  # CUDA_ERROR_INVALID_CONTEXT
    launch = fl.fast_launch(cfn)
    assert launch(1, 1, 1, 1, 32, 1, 1, 0, 0, 0, None) == 201
    with pytest.raises(TypeError, match="11 arguments"):
        launch(1, 1, 1)
    with pytest.raises(OverflowError):
        launch(-1, 1, 1, 1, 32, 1, 1, 0, 0, 0, None)
    with pytest.raises(TypeError):
        launch("f", 1, 1, 1, 32, 1, 1, 0, 0, 0, None)


def test_a_python_stand_in_gets_no_c_entry(module):
    """Stand-ins that are not C functions (the stub libcuda of tests/test_cuda_launch.py) keep ctypes'
    path: there is no address to call from C."""
    assert fl.fast_launch(lambda *a: 0) is None
