"""The C entry point of our launcher (kernels/launch/c_entry.py) against ctypes' call of the same function.

No GPU here: the module is built as on a GPU machine (Triton's ``compile_module_from_src``) and given
a C-callable stand-in for ``cuLaunchKernel`` (a ctypes callback) that records what it receives; the
reference is the same stand-in called through ctypes with cuLaunchKernel's argument types, as the
launcher calls libcuda without the module. GPU: tests/test_cuda_launch.py launches through it.
"""

from __future__ import annotations

import ctypes

import pytest

fl = pytest.importorskip("fastdeploy_paddlefleet.kernels.launch.c_entry")

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


# ------------------------------------------------------------------------------ pack_launch


def _buffers():
    """Two parameter buffers of one layout with every scalar code our kernels can have (pointers,
    i1/i8/i16/i32/i64, unsigned, fp16/fp32/fp64), 2 trailing fixed arguments."""
    from fastdeploy_paddlefleet.kernels.launch import own_launcher as cl

    sig = ["*bf16", "i32", "i64", "fp32", "*i32", "i1", "i16", "u16", "u8", "u32", "u64", "fp16", "fp64"]
    sig += ["i32", "constexpr", "i32"]
    layout = cl.param_layout(sig, None)
    return cl.ParamBuffer(layout, 13, (7, None, 9)), cl.ParamBuffer(layout, 13, (7, None, 9)), layout


ARGS = (
    0x7F00_0000_1000,
    -5,
    -(2**40),
    0.1,
    None,
    True,
    -300,
    65535,
    200,
    2**32 - 1,
    2**63,
    1.5,
    1e300,
)


def test_pack_launch_writes_what_struct_writes_then_launches(module):
    cfn, seen = _recording_target(0)
    pack_launch = fl.fast_pack_launch(cfn)
    assert pack_launch is not None
    ours, ref, layout = _buffers()
    res = pack_launch(ours.base, ours.spec, ARGS, 0xF00, 3, 2, 1, 128, 4096, 0xABC, ours.kernel_params)
    assert res == 0
    ref.pack(ARGS)
    for j, p in enumerate(layout):
        assert ours.param_bytes(j) == ref.param_bytes(j), (j, p)
    assert seen == [(0xF00, 3, 2, 1, 128, 1, 1, 4096, 0xABC, ours.kernel_params, 0)]


@pytest.mark.parametrize(
    "index, value",
    [(0, object()), (1, 2**31), (1, 1.0), (3, "x"), (3, 1e39), (6, 2**15), (9, -1), (11, 1e6), (0, -1)],
    ids=["tensor-like-pointer", "i32-range", "float-for-int", "str-for-float", "fp32-range", "i16-range",
         "u32-negative", "fp16-range", "negative-pointer"],
)  # fmt: skip
def test_pack_launch_leaves_what_it_cannot_pack_to_python(module, index, value):
    """A value struct would convert (an object's ``__index__``) or refuse: nothing launched, NOT_PACKED,
    so the launcher packs in Python (which converts, or raises naming the types)."""
    cfn, seen = _recording_target(0)
    pack_launch = fl.fast_pack_launch(cfn)
    ours, _, _ = _buffers()
    args = ARGS[:index] + (value,) + ARGS[index + 1 :]
    assert pack_launch(ours.base, ours.spec, args, 1, 1, 1, 1, 32, 0, 0, ours.kernel_params) == fl.NOT_PACKED
    assert seen == []
    assert (
        pack_launch(ours.base, ours.spec, ARGS[:5], 1, 1, 1, 1, 32, 0, 0, ours.kernel_params) == fl.NOT_PACKED
    )


def test_pack_launch_refuses_malformed_calls(module):
    cfn, _ = _recording_target(0)
    pack_launch = fl.fast_pack_launch(cfn)
    ours, _, _ = _buffers()
    with pytest.raises(TypeError, match="11 arguments"):
        pack_launch(ours.base, ours.spec, ARGS)
    with pytest.raises(TypeError, match="spec must be bytes"):
        pack_launch(ours.base, list(ours.spec), ARGS, 1, 1, 1, 1, 32, 0, 0, ours.kernel_params)
    with pytest.raises(TypeError, match="args a tuple"):
        pack_launch(ours.base, ours.spec, list(ARGS), 1, 1, 1, 1, 32, 0, 0, ours.kernel_params)
    assert fl.fast_pack_launch(lambda *a: 0) is None  # a Python stand-in: no C entry
