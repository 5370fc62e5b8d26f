"""Our own launcher of compiled Triton kernels (``kernels/launch/own_launcher.py``, issue 20).

CPU: (1) the parameter list it derives for the real kernels (portable decode with and without TMA
descriptors, portable prefill, cache write, split-KV reduce, Hopper prefill with its two descriptors),
compiled offline for sm_90 in a child process with a stub driver, against the ``.param`` list of the
kernel's ``.entry`` in its PTX (count, sizes, alignment): with the device's Triton 3.6 where it is
importable (``FDFLEET_TRITON36_SITE``, default ``/tmp/tr36site``) and with the local Triton; (2) the bytes
one call packs against a hand-built reference per type; (3) refusals (None, reason logged). GPU
(``gpu``): outputs bitwise equal to Triton's own launcher (decode, portable and Hopper prefill, cache
write, a mixed batch), descriptors encoded as Triton's ``fill_tma_descriptor`` encodes them, a CUDA
graph captured through it.

Run as ``python tests/test_cuda_launch.py --worker`` (with ``PYTHONPATH=<triton site>:src``) this file is
the child process: it compiles the kernels and prints one JSON record per kernel.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TR36 = os.environ.get("FDFLEET_TRITON36_SITE", "/tmp/tr36site")


# ------------------------------------------------------------------------------ child process


def _ptx_params(ptx: str) -> list[dict]:
    """The ``.param`` declarations of the PTX's ``.entry``: size and alignment of each."""
    m = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError("no .entry in the PTX")
    out = []
    for line in m.group(1).split(","):
        line = line.strip()
        arr = re.match(r"\.param\s+\.align\s+(\d+)\s+\.b8\s+\w+\[(\d+)\]", line)
        if arr:
            out.append(dict(size=int(arr.group(2)), align=int(arr.group(1))))
            continue
        sc = re.match(r"\.param\s+\.([usbf])(\d+)\b", line)
        if sc is None:
            raise ValueError(f"unparsed .param line {line!r}")
        size = int(sc.group(2)) // 8
        out.append(dict(size=size, align=size))
    return out


def _launch_with_stub_driver(cl, real, kernel, args, consts) -> list:
    """Build our launcher for ``kernel`` as KernelCache does (leading arguments, the rest from the
    constexprs and defaults) over a stub libcuda and launch it once with addresses: the calls the stub
    saw (the grid, block and shared memory it passes)."""
    seen = []
    stub = SimpleNamespace(
        cuLaunchKernel=lambda *a: seen.append(("launch", *a[1:8])) or 0,
        cuTensorMapEncodeTiled=lambda *a: seen.append(("encode", a[1], a[2])) or 0,
    )
    old, cl._LIBCUDA = cl._LIBCUDA, stub
    try:
        names = real.arg_names[len(args) :]
        tail = tuple(consts.get(n, p.default) for n, p in zip(names, real.params[len(args) :], strict=True))
        own = cl.own_launcher(kernel, len(args), tail, 0)
        if own is None:
            return ["refused"]
        addrs = tuple(a.data_ptr() if hasattr(a, "data_ptr") else a for a in args)
        own((3, 2), addrs, 0)
        return seen
    finally:
        cl._LIBCUDA = old


def _worker() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
    from hopper_compile import stub_driver  # compile for sm_90 (device 0, stream 0) without a GPU

    stub_driver()
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels import split_kv_reduce as sr
    from fastdeploy_paddlefleet.kernels.launch import own_launcher as cl

    calls = []

    class Recorder:
        def __init__(self, real):
            self.real = real
            self.arg_names, self.params = real.arg_names, real.params

        def __getitem__(self, grid):
            def call(*args, **consts):
                calls.append((self.real, grid, args, consts))

            return call

    for mod, name in ((pa, "_decode_kernel"), (pa, "_prefill_kernel"), (cw, "_write_kv_kernel")):
        setattr(mod, name, Recorder(getattr(mod, name)))
    sr._split_kv_reduce_kernel = Recorder(sr._split_kv_reduce_kernel)
    bf = torch.bfloat16
    hkv, g, d, bs = 2, 4, 128, 64
    kc = torch.zeros(8, hkv, bs, d, dtype=bf)
    vc = torch.zeros(8, hkv, bs, d, dtype=bf)
    q = torch.zeros(40, hkv * g, d, dtype=bf)
    cu = torch.tensor([0, 32, 33, 40], dtype=torch.int32)
    dec = torch.tensor([5, 70, 0], dtype=torch.int32)
    tbl = torch.zeros(3, 4, dtype=torch.int32)
    bid = torch.zeros(40, dtype=torch.int32)
    err = torch.zeros(8, dtype=torch.int32)
    sinks = torch.zeros(hkv * g, dtype=torch.float32)
    plan = pa.AttentionPlan(kc, vc, q, scale=0.1, sink_kind="learnable", sinks=sinks, prefill_impl="portable")
    plan.run(q, cu, dec, tbl, max_q_len=32, max_context_len=200, errors=err, num_splits=2)
    cw.CacheWritePlan(kc, vc).run(q[:, :hkv], q[:, :hkv], bid, cu, dec, tbl, errors=err)
    cases = {}
    for real, grid, args, consts in calls:
        name = real.fn.__name__ if hasattr(real, "fn") else real.__name__
        cases.setdefault(name, (real, grid, args, consts))  # the prefill's fast launch, not its safe one
    # the decode kernel with TMA descriptors (as on an H200: host descriptors lowered to TMA)
    from triton.tools.tensor_descriptor import TensorDescriptor

    real, grid, args, consts = cases["_decode_kernel"]
    kd = TensorDescriptor.from_tensor(kc.view(-1, d), [64, d])
    vd = TensorDescriptor.from_tensor(vc.view(-1, d), [64, d])
    args = list(args)
    args[4], args[5] = kd, vd
    cases["_decode_kernel_tma"] = (real, grid, tuple(args), dict(consts, USE_TMA=True, BLOCK_N=64))
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

    if hp.gluon_available():
        hq = hkv * g
        hplan = hp.HopperPlan(kc, vc, hq, sinks, qk_scale=0.1, sink_mode=1, headwise=False, has_window=True,
                              window=100, win_h0=0, win_h1=hkv, num_ctas=132)  # fmt: skip
        out = torch.zeros_like(q)
        hargs = (q, out, vc, hplan.k_desc, hplan.v_desc, sinks, cu, dec, tbl, err, hplan.redo,
                 q.stride(0), q.stride(1), out.stride(0), out.stride(1), vc.stride(2), tbl.stride(0),
                 tbl.shape[1], hplan.n_pages, q.shape[0], 3, 2, *hplan.scalars, 16)  # fmt: skip
        cases["_hopper_prefill_kernel"] = (hp._hopper_prefill_kernel, (1,), hargs, hplan._consts[True])
    for name, (real, grid, args, consts) in cases.items():
        rec = dict(name=name, triton=triton.__version__)
        try:
            kernel = real.warmup(*args, grid=grid, **consts)
            layout, _meta = cl.layout_of(kernel)
            rec["refused"] = cl.refusal(kernel) if not isinstance(layout, str) else layout
            rec["ours"] = (
                [] if isinstance(layout, str) else [dict(size=p.size, align=p.align) for p in layout]
            )
            rec["kinds"] = [] if isinstance(layout, str) else [p.kind for p in layout]
            rec["ptx"] = _ptx_params(kernel.asm["ptx"])
            rec["launched"] = _launch_with_stub_driver(cl, real, kernel, args, consts)
            rec["num_warps"], rec["shared"] = kernel.metadata.num_warps, kernel.metadata.shared
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            rec["error"] = repr(e)[:800]
        print("RECORD " + json.dumps(rec), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    _worker()
    sys.exit(0)


# ------------------------------------------------------------------------------ tests

import pytest  # noqa: E402

from fastdeploy_paddlefleet.kernels.launch import own_launcher as cl  # noqa: E402


def _compile_records(site: str | None) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    path = [os.path.join(ROOT, "src")]
    if site:
        path.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("TRITON_CACHE_DIR", os.path.join("/tmp", f"fdfleet-triton-cache-{os.getuid()}"))
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    recs = {}
    for line in r.stdout.splitlines():
        if line.startswith("RECORD "):
            rec = json.loads(line[7:])
            recs[rec["name"]] = rec
    if not recs:
        pytest.fail(f"the compile worker printed no record (rc {r.returncode}): {r.stderr[-3000:]}")
    return recs


def _triton_site_version(site: str) -> str | None:
    try:
        with open(os.path.join(site, "triton", "__init__.py")) as f:
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


SITES = ["local"]
if _triton_site_version(TR36):
    SITES.insert(0, "triton36")

KERNELS = [
    "_decode_kernel",
    "_decode_kernel_tma",
    "_prefill_kernel",
    "_write_kv_kernel",
    "_split_kv_reduce_kernel",
]


@pytest.fixture(scope="module", params=SITES)
def compiled(request):
    if request.param == "triton36":
        return _compile_records(TR36)
    pytest.importorskip("triton")
    return _compile_records(None)


@pytest.mark.parametrize("name", [*KERNELS, "_hopper_prefill_kernel"])
def test_layout_matches_the_kernels_ptx_params(compiled, name):
    """Count, size and alignment of every parameter as the compiled PTX declares them."""
    if name not in compiled:
        if name == "_hopper_prefill_kernel":
            pytest.skip("no Gluon in this Triton")
        pytest.fail(f"{name} was not compiled: {sorted(compiled)}")
    rec = compiled[name]
    if "error" in rec:
        if name == "_hopper_prefill_kernel" and not rec["triton"].startswith("3.6"):
            pytest.skip(f"the Hopper kernel is written for Triton 3.6's Gluon: {rec['error'][:200]}")
        pytest.fail(rec["error"])
    assert rec["refused"] is None, rec["refused"]
    ptx, ours = rec["ptx"], rec["ours"]
    assert len(ours) == len(ptx), (rec["kinds"], ptx)
    for i, (a, b) in enumerate(zip(ours, ptx, strict=True)):
        assert a["size"] == b["size"], (i, rec["kinds"][i], a, b)
        assert a["align"] % b["align"] == 0, (i, rec["kinds"][i], a, b)
    # our launcher built from the real kernel and launched once over a stub libcuda: Triton's block size
    # (32 x num_warps) and shared memory, every descriptor encoded once
    launches = [c for c in rec["launched"] if c[0] == "launch"]
    assert launches and launches[0][1:4] == [3, 2, 1], rec["launched"]
    assert launches[0][4] == 32 * rec["num_warps"] and launches[0][7] == rec["shared"]
    encodes = [c for c in rec["launched"] if c[0] == "encode"]
    assert len(encodes) == rec["kinds"].count("tensormap")
    if name in ("_decode_kernel_tma", "_hopper_prefill_kernel"):
        assert rec["kinds"].count("tensormap") == 2
        assert [p for p in ptx if p["size"] == 128] == [dict(size=128, align=64)] * 2


# ---- (2) packing against hand-built bytes


def _hand(code: str, v) -> bytes:
    """One value as the C type Triton's launcher stores it, built without struct for the integers."""
    ints = {"b": (1, True), "B": (1, False), "h": (2, True), "H": (2, False), "i": (4, True), "I": (4, False),
            "q": (8, True), "Q": (8, False)}  # fmt: skip
    if code in ints:
        n, signed = ints[code]
        return int(v).to_bytes(n, "little", signed=signed)
    import numpy as np

    return {"f": np.float32, "e": np.float16, "d": np.float64}[code](v).tobytes()


TYPES = ["*bf16", "i1", "i32", "i64", "u64", "fp32", "u8", "i16", "u32", "fp16", "fp64", "i8", "u16", "u1"]
VALUES = {"*bf16": 0x7F12_3456_7800, "i1": True, "i32": -123456, "i64": -(2**40) - 3, "u64": 2**63 + 5,
          "fp32": 0.1, "u8": 200, "i16": -300, "u32": 2**31 + 7, "fp16": 1 / 3, "fp64": -2.5e-300, "i8": -5,
          "u16": 65535, "u1": 1}  # fmt: skip


def test_one_call_packs_each_type_as_tritons_c_types():
    sig = ["constexpr", *TYPES, "constexpr"]
    layout = cl.param_layout(sig, [])
    assert [p.kind for p in layout] == ["ptr"] + ["scalar"] * (len(TYPES) - 1) + ["scratch", "scratch"]
    buf = cl.ParamBuffer(layout, n_args=len(sig) - 1, tail=(7,))
    args = (None, *[VALUES[t] for t in TYPES])
    buf.pack(args)
    for i, t in enumerate(TYPES):
        code = cl.SCALAR_CODES.get(t, "Q")
        got = buf.param_bytes(i)
        assert got == _hand(code, VALUES[t]), (t, got)
        assert buf.address(i) % struct.calcsize(code) == 0  # natural alignment
    assert buf.param_bytes(len(TYPES)) == bytes(8) == buf.param_bytes(len(TYPES) + 1)  # no scratch
    # the kernelParams array holds each slot's address, in parameter order
    import ctypes

    arr = (ctypes.c_void_p * len(layout)).from_address(buf.kernel_params)
    assert list(arr) == [buf.address(i) for i in range(len(layout))]
    # a second call with other values overwrites every slot (tensors for pointers: their address)
    tensor_like = SimpleNamespace(data_ptr=lambda: 0x1000)
    args2 = (None, tensor_like, False, 7, 8, 9, -1.5, 1, 2, 3, 0.5, 1.0, 4, 5, 0)
    buf.pack(args2)
    for i, t in enumerate(TYPES):
        want = 0x1000 if t == "*bf16" else args2[i + 1]
        assert buf.param_bytes(i) == _hand(cl.SCALAR_CODES.get(t, "Q"), want), t


def test_arguments_that_do_not_fit_are_refused_by_name():
    buf = cl.ParamBuffer(cl.param_layout(["*fp32", "i32"], []), n_args=2)
    with pytest.raises(ValueError, match="do not fit"):
        buf.pack((0x1000, 2**40))  # an i32 parameter (Triton compiled it for a small value)


def test_trailing_runtime_arguments_are_fixed_and_descriptor_slots_follow_tritons_expansion():
    meta = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False)]
    sig = ["*fp16", "tensordesc<bf16[64, 64],NVMMA>", "i32", "constexpr", "i64"]
    layout = cl.param_layout(sig, meta)
    kinds = [p.kind for p in layout]
    assert kinds == ["ptr", "tensormap", "desc_shape", "desc_shape", "desc_stride", "desc_stride", "scalar",
                     "scalar", "scratch", "scratch"]  # fmt: skip
    assert [p.size for p in layout] == [8, 128, 4, 4, 8, 8, 4, 8, 8, 8]
    buf = cl.ParamBuffer(layout, n_args=4, tail=(-9,))
    assert buf.address(1) % 128 == 0
    buf.pack((0xABC0, object(), 41, None))  # the descriptor and the constexpr are not packed
    assert buf.param_bytes(0) == _hand("Q", 0xABC0) and buf.param_bytes(6) == _hand("i", 41)
    assert buf.param_bytes(7) == _hand("q", -9)  # the fixed trailing i64


def test_tma_encode_arguments_follow_tritons_fill_tma_descriptor():
    """Hand-derived from Triton 3.6's fillTMADescriptor: innermost dim first, byte strides, box from the
    metadata, NaN padding requests the NaN fill, the device data type enum mapped to the host's."""
    base = SimpleNamespace(data_ptr=lambda: 0x7000_0000)
    desc = SimpleNamespace(base=base, shape=[4096, 128], strides=[256, 1], padding="zero")
    meta = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False)
    assert cl.tma_encode_args(desc, meta) == (9, 2, 0x7000_0000, [128, 4096], [512], [64, 64], 3, 0)
    desc3 = SimpleNamespace(base=base, shape=[2, 8, 32], strides=[512, 64, 1], padding="nan")
    meta3 = dict(swizzle=2, elem_size=4, elem_type=7, block_size=[1, 4, 32], fp4_padded=False)
    assert cl.tma_encode_args(desc3, meta3) == (7, 3, 0x7000_0000, [32, 8, 2], [256, 2048], [32, 4, 1], 2, 1)
    with pytest.raises(ValueError, match="contiguous"):
        cl.tma_encode_args(SimpleNamespace(base=base, shape=[4, 4], strides=[1, 4], padding="zero"), meta)


def test_descriptors_are_encoded_once_per_object_and_base_address():
    """A stub libcuda records the encodes: the same descriptor again encodes nothing, another object or
    a base at another address encodes again, another base tensor over the same memory does not; the
    shape / stride parameters after the map carry the descriptor's."""
    torch = pytest.importorskip("torch")
    encoded = []

    def encode(addr, dtype, rank, base, dims, strides, box, elem_strides, *rest):
        encoded.append(
            (dtype, rank, base, list(dims)[:rank], list(strides)[: rank - 1], list(box)[:rank], rest)
        )
        return 0

    lib = SimpleNamespace(cuLaunchKernel=lambda *a: 0, cuTensorMapEncodeTiled=encode)
    meta = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False)]
    layout = cl.param_layout(["*bf16", "tensordesc<bf16[64, 64],L>", "i32"], meta)
    own = cl.OwnLauncher("k", 1, (4, 1, 0), layout, meta, 3, (), lib)
    cache = torch.zeros(256, 64, dtype=torch.bfloat16)

    def desc(base):
        return SimpleNamespace(base=base, shape=[256, 64], strides=[64, 1], padding="zero")

    d = desc(cache)
    for _ in range(3):
        own((2,), (0x1000, d, 5), 0)
    assert len(encoded) == 1
    assert encoded[0] == (9, 2, cache.data_ptr(), [64, 256], [128], [64, 64], (0, 3, 2, 0))
    assert [int.from_bytes(own.buf.param_bytes(j), "little") for j in (2, 3, 4, 5)] == [256, 64, 64, 1]
    d.base = cache.view(256, 64)  # another tensor object over the same memory (a plan's bind)
    own((2,), (0x1000, d, 5), 0)
    assert len(encoded) == 1
    d.base = cache.clone()  # other memory
    own((2,), (0x1000, d, 5), 0)
    assert len(encoded) == 2 and encoded[1][2] == d.base.data_ptr()
    own((2,), (0x1000, desc(d.base), 5), 0)  # another descriptor object
    assert len(encoded) == 3


# ---- (3) refusals


def _fake_kernel(**md):
    meta = dict(num_ctas=1, global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                launch_pdl=False, tensordesc_meta=None, name="fake_kernel")  # fmt: skip
    meta.update(md)
    sig = md.pop("signature", {"A": "*fp32", "n": "i32"})
    return SimpleNamespace(
        metadata=SimpleNamespace(**{k: v for k, v in meta.items() if k != "signature"}),
        src=SimpleNamespace(signature=sig), function=1, packed_metadata=(4, meta["num_ctas"], 0),
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(num_ctas=2), "num_ctas 2"),
        (dict(launch_cooperative_grid=True), "cooperative"),
        (dict(launch_pdl=True), "programmatic dependent launch"),
        (dict(global_scratch_size=64), "scratch memory"),
        (dict(profile_scratch_size=8), "scratch memory"),
        (dict(signature={"A": "*fp32", "x": "bf16"}), "'bf16'"),
        (dict(signature={"A": "*fp32", "t": ("i32", "i32")}), "tuples"),
        (dict(signature={"A": "*fp32", "d": "tensordesc<fp16[64, 64]>"}), "without TMA metadata"),
        (dict(signature={"A": "*fp32", "n": "i32", "m": "i32"}), "arguments for 3 parameters"),
    ],
)
def test_refusals_return_none_and_log_why(change, reason, caplog):
    with caplog.at_level(logging.INFO, logger=cl.__name__):
        assert cl.own_launcher(_fake_kernel(**change), 1, (0,)) is None
    assert reason in caplog.text and "fake_kernel" in caplog.text


def test_refuses_a_triton_without_the_attributes_it_reads(caplog):
    k = _fake_kernel()
    del k.metadata.launch_pdl
    with caplog.at_level(logging.INFO, logger=cl.__name__):
        assert cl.own_launcher(k, 1, (0,)) is None
    assert "lack" in caplog.text
    with caplog.at_level(logging.INFO, logger=cl.__name__):
        assert cl.own_launcher(SimpleNamespace(run=None), 1, ()) is None


def test_refuses_without_libcuda(monkeypatch, caplog):
    monkeypatch.setattr(cl, "_LIBCUDA", False)  # as on a machine without the driver
    with caplog.at_level(logging.INFO, logger=cl.__name__):
        assert cl.own_launcher(_fake_kernel(), 1, (0,)) is None
    assert "no libcuda" in caplog.text


def test_kernel_cache_keeps_tritons_launcher_where_ours_refuses(monkeypatch):
    """With launch hooks set when the plan is built, or our launcher switched off, no plan uses it;
    a refused kernel keeps the compiled launcher's tuple (tests/test_launch_cost.py drives that path)."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "OWN_LAUNCHER", False)
    cache = _launch.KernelCache(0)
    assert not cache.own
    monkeypatch.setattr(_launch, "OWN_LAUNCHER", None)
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "off")
    assert not _launch.own_wanted()
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "on")
    assert _launch.own_wanted()
    assert _launch.KernelCache(None).own is False  # off the GPU: never


# ---- (4) GPU: bitwise equal to Triton's own launcher

try:
    import torch

    CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is in the CI env
    torch, CUDA = None, False
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
#: the first variant of each parametrized GPU test stays in ``-m gpu``, the rest are ``gpu_long``
#: (conftest.py: each compiles its own kernels; every other GPU test launches through this launcher too)
GPU_LONG_VARIANTS = True

DECODE_TMA = dict(block_m=16, block_n=64, num_warps=4, num_stages=3, use_tma=True)


def _own_on(monkeypatch):
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_launch, "OWN_LAUNCHER", True)


def _reqs(kind: str, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 600, (6,), generator=gen).tolist()
    if kind.startswith("decode"):
        return [(c, 1) for c in ctx]
    if kind == "mixed":
        return [(c, 1 if i % 2 else 37) for i, c in enumerate(ctx)]
    return [(c if i else 0, 70 + 9 * i) for i, c in enumerate(ctx[:3])]  # prefill only, one without context


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "kind", ["decode", "decode-split", "decode-tma", "mixed", "prefill-portable", "prefill-hopper"]
)
def test_gpu_own_launcher_equals_tritons_launch(kind, monkeypatch):
    """Four steps (fresh metadata and cache contents in the same tensors) through plans whose kept
    kernels launch through our launcher, against plans that launch every call through Triton's own path
    (``cached=False``) on copies: cache writes and outputs bitwise equal; every kept kernel is ours."""
    sys.path.insert(0, HERE)
    from test_triton_kernels import REAL, make_step

    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    impl = "hopper" if kind == "prefill-hopper" else "portable"
    if impl == "hopper" and not (hp.gluon_available() and hp.is_hopper(torch.device("cuda"))):
        pytest.skip("the Hopper prefill kernel needs sm_90 and Gluon")
    _own_on(monkeypatch)
    hkv, bf = REAL["hkv"], torch.bfloat16
    big_k = torch.empty(80, hkv, REAL["block_size"], 128, dtype=bf, device="cuda")
    big_v = torch.empty_like(big_k)
    sinks = torch.randn(hkv * REAL["group"], device="cuda")
    dcfg = pa.TileConfig(**DECODE_TMA) if kind == "decode-tma" else None
    splits = 4 if kind == "decode-split" else None
    opts = dict(scale=0.1, sink_kind="learnable", sinks=sinks, prefill_impl=impl, decode_config=dcfg)
    q_like = torch.empty(1, hkv * REAL["group"], 128, dtype=bf, device="cuda")
    plan = pa.AttentionPlan(big_k, big_v, q_like, **opts)
    wplan = cw.CacheWritePlan(big_k, big_v)
    assert plan.kernels.own and wplan.kernels.own
    err, ref_err = (torch.zeros(8, dtype=torch.int32, device="cuda") for _ in range(2))
    for seed in range(4):
        reqs = _reqs(kind, seed)
        s = make_step(reqs, dtype=bf, seed=seed, **REAL)
        nb = s.key_cache.shape[0]
        assert nb <= big_k.shape[0]
        big_k.fill_(float("nan"))
        big_v.fill_(float("nan"))
        big_k[:nb].copy_(s.key_cache)
        big_v[:nb].copy_(s.value_cache)
        kc, vc = big_k.clone(), big_v.clone()
        mq, mc = max(n for _, n in reqs), max(c + n for c, n in reqs)
        step = _launch.LaunchStep(s.cu, s.dec, s.table, s.bid, max_q_len=mq, max_context_len=mc, errors=err)
        wplan.run_step(s.k, s.v, step)
        out = plan.run_step(s.q, step, num_splits=splits)
        cw.CacheWritePlan(kc, vc, cached=False).run(s.k, s.v, s.bid, s.cu, s.dec, s.table, errors=ref_err)
        ref = pa.AttentionPlan(kc, vc, q_like, cached=False, **opts)
        want = ref.run(s.q, s.cu, s.dec, s.table, max_q_len=mq, max_context_len=mc, num_splits=splits,
                       errors=ref_err)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(big_k.nan_to_num(7.0), kc.nan_to_num(7.0)), (kind, seed)
        assert torch.equal(big_v.nan_to_num(7.0), vc.nan_to_num(7.0)), (kind, seed)
        assert torch.equal(out, want), (kind, seed)
    assert torch.equal(err, ref_err)  # the error flags too (clean tables: both zero)
    kept = [*plan.kernels._kernels.values(), *wplan.kernels._kernels.values()]
    assert len(kept) >= 2 and all(isinstance(h, cl.OwnLauncher) for h in kept), kept
    with_desc = [h for h in kept if h.descs]
    if kind in ("decode-tma", "prefill-hopper"):
        assert with_desc and all(h.encodes == 2 for h in with_desc)  # once per descriptor, not per launch
    else:
        assert not with_desc


def _triton_tensormap_bytes(desc, meta) -> bytes:
    """The CUtensorMap Triton's launcher would pass for ``desc``: its own ``make_tensordesc_arg``."""
    import ctypes
    import inspect

    from triton.backends.nvidia import driver as nd

    n = len(inspect.signature(nd.make_tensordesc_arg).parameters)
    tmap = nd.make_tensordesc_arg(desc, meta, *([None] * (n - 2)))[0]
    return ctypes.string_at(id(tmap) + 128, 128)  # PyObject_HEAD, then the 128-byte aligned map


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["decode-tma", "prefill-hopper"])
def test_gpu_descriptors_are_encoded_as_tritons_launcher_encodes_them(kind, monkeypatch):
    """The 128 bytes of each CUtensorMap and the shape / stride parameters after it equal what Triton's
    launcher builds; a different descriptor object is encoded again, the same one is not."""
    sys.path.insert(0, HERE)
    from test_triton_kernels import REAL, make_step

    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    if kind == "prefill-hopper" and not (hp.gluon_available() and hp.is_hopper(torch.device("cuda"))):
        pytest.skip("the Hopper prefill kernel needs sm_90 and Gluon")
    _own_on(monkeypatch)
    reqs = _reqs(kind, 0)
    s = make_step(reqs, dtype=torch.bfloat16, seed=0, **REAL)
    impl = "hopper" if kind == "prefill-hopper" else "portable"
    dcfg = pa.TileConfig(**DECODE_TMA) if kind == "decode-tma" else None
    plan = pa.AttentionPlan(s.key_cache, s.value_cache, s.q, scale=0.1, prefill_impl=impl, decode_config=dcfg)
    step = _launch.LaunchStep(s.cu, s.dec, s.table, s.bid, max_q_len=max(n for _, n in reqs))
    for _ in range(2):
        plan.run_step(s.q, step)
    # the fast launch's kernel (the Hopper prefill's safe launch keeps one of its own, encoded alike)
    (hit,) = [h for k, h in plan.kernels._kernels.items() if h.descs and not k[0].endswith("-safe")]
    for d, (_arg, tm, shape_idx, stride_idx) in enumerate(hit.descs):
        desc = hit._held[d][0]
        assert hit.buf.param_bytes(tm) == _triton_tensormap_bytes(desc, hit.meta[d]), d
        assert [int.from_bytes(hit.buf.param_bytes(j), "little", signed=True) for j in shape_idx] == list(
            desc.shape
        )
        assert [int.from_bytes(hit.buf.param_bytes(j), "little", signed=True) for j in stride_idx] == list(
            desc.strides
        )
    n = hit.encodes
    plan.run_step(s.q, step)
    assert hit.encodes == n  # same descriptors: nothing encoded
    if kind == "prefill-hopper":
        old = plan.hopper.k_desc
        plan.hopper.k_desc = hp._descriptor(s.key_cache, old.block_shape[0])
        plan.run_step(s.q, step)
        assert hit.encodes == n + 1
    torch.cuda.synchronize()


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_captured_through_own_launcher(monkeypatch):
    """A decode step (cache write + attention) captured in a CUDA graph through our launcher, replayed
    with new contents in the same tensors: equal to Triton's path on each replay's inputs."""
    sys.path.insert(0, HERE)
    from test_triton_kernels import REAL, make_step

    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    _own_on(monkeypatch)
    reqs = [(300, 1), (41, 1), (7, 1), (130, 1)]
    s = make_step(reqs, dtype=torch.bfloat16, seed=3, **REAL)
    kc, vc = s.key_cache, s.value_cache
    plan = pa.AttentionPlan(kc, vc, s.q, scale=0.1)
    wplan = cw.CacheWritePlan(kc, vc)
    step = _launch.LaunchStep(s.cu, s.dec, s.table, s.bid, max_q_len=1, max_context_len=301)
    q, k, v = s.q.clone(), s.k.clone(), s.v.clone()
    out = torch.empty(q.shape[0], q.shape[1], 128, dtype=q.dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, keep, launch through ours once
            wplan.run_step(k, v, step)
            plan.run_step(q, step, out=out, num_splits=1)
    torch.cuda.current_stream().wait_stream(side)
    kept = [*plan.kernels._kernels.values(), *wplan.kernels._kernels.values()]
    assert kept and all(isinstance(h, cl.OwnLauncher) for h in kept)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wplan.run_step(k, v, step)
        plan.run_step(q, step, out=out, num_splits=1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
        rk, rv = kc.clone(), vc.clone()
        graph.replay()
        cw.CacheWritePlan(rk, rv, cached=False).run(k, v, s.bid, s.cu, s.dec, s.table)
        want = pa.AttentionPlan(rk, rv, q, scale=0.1, cached=False).run(
            q, s.cu, s.dec, s.table, max_q_len=1, max_context_len=301, num_splits=1
        )
        torch.cuda.synchronize()
        assert torch.equal(kc.nan_to_num(7.0), rk.nan_to_num(7.0))
        assert torch.equal(out, want)


def test_kernel_cache_uses_our_launcher_only_with_addresses(monkeypatch):
    """Plans that pass tensors for pointers (``ADDRESS_ARGS`` off) keep Triton's launcher: the one-struct
    pack would read a one-element integer tensor (e.g. ``seq_lens_decoder`` of one request) through
    ``__index__`` as its value, not its address."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "_direct_ok", lambda: True)
    monkeypatch.setattr(_launch, "OWN_LAUNCHER", True)
    monkeypatch.setattr(_launch, "ADDRESS_ARGS", True)
    assert _launch.KernelCache(0).own
    monkeypatch.setattr(_launch, "ADDRESS_ARGS", False)
    cache = _launch.KernelCache(0)
    assert cache.direct and not cache.own


def test_a_tensor_for_a_pointer_packs_its_address_not_its_value():
    """A torch tensor given for a pointer (``__index__`` raises TypeError for several elements) packs
    its ``data_ptr()``, as Triton's launcher does."""
    import torch as _torch

    buf = cl.ParamBuffer(cl.param_layout(["*fp32", "i32"], []), n_args=2)
    t = _torch.zeros(4)
    buf.pack((t, 3))
    assert buf.param_bytes(0) == struct.pack("<Q", t.data_ptr())
    assert buf.param_bytes(1) == struct.pack("<i", 3)


def test_kernel_cache_launch_gives_a_kept_kernel_addresses(monkeypatch):
    """``KernelCache.launch`` takes tensors; a kernel it already keeps gets their addresses, so our
    launcher never reads a one-element integer tensor (``__index__``) as a pointer's value."""
    import torch as _torch

    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "_direct_ok", lambda: True)
    cache = _launch.KernelCache(0)
    seen = []
    cache._kernels["k"] = lambda grid, args, stream: seen.append((grid, args, stream))
    one = _torch.tensor([5], dtype=_torch.int32)  # e.g. seq_lens_decoder of one request
    cache.launch(None, "k", (3,), (one, 7, None), {}, 11)
    assert seen == [((3,), (one.data_ptr(), 7, None), 11)]
