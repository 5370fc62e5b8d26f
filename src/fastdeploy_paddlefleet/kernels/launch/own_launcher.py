"""A launcher of our own for compiled Triton kernels: one ``struct`` pack and one ``cuLaunchKernel`` call.

Triton 3.6's compiled launcher (``CompiledKernel.run``) costs ~9 us per call on the H200's host for
40 arguments (benchmarks/NOTES.md, issue 20): Python that allocates (no) scratch twice, for kernels
with tensor descriptors a loop over every argument that encodes each ``CUtensorMap`` again on every
launch, then ``PyArg_ParseTuple`` of every argument and ``cuLaunchKernelEx``. :class:`OwnLauncher`
does the same launch with what is fixed per kernel derived once:

* the kernel's parameter list as Triton's launcher builds it (:func:`param_layout`): constexpr
  arguments dropped, a tensor descriptor lowered to TMA becomes a 128-byte ``CUtensorMap`` (passed by
  value, 64-byte aligned) followed by its shape (i32 x ndim) and strides (i64 x ndim), then the global
  and profile scratch pointers (0: refused when the kernel needs scratch);
* one ``struct.Struct`` packs a call's scalars and pointers into a fixed buffer whose element addresses
  are the ``void **kernelParams`` array (built once); each descriptor is encoded
  (``cuTensorMapEncodeTiled``, as Triton's ``fill_tma_descriptor`` does) into its slot only when a
  different descriptor object, or one over another address, is passed;
* one call of libcuda's ``cuLaunchKernel`` (the function handle comes from Triton's loader, which set
  its dynamic shared memory attribute) with Triton's grid and block sizes, from a small C entry point
  (:mod:`.c_entry`) where it builds, else through ctypes. The C entry point also packs: one call
  writes the values into the buffer and launches (``pack_launch``); values it does not take (tensors
  for pointers) are packed here as above.

Anything it does not reproduce exactly is refused (:func:`own_launcher` returns ``None`` and logs why;
the caller keeps Triton's launcher): clusters (``num_ctas != 1``), cooperative grids, PDL, scratch
memory, tuple or unknown argument types, descriptors without TMA metadata (or im2col), a Triton
without the attributes read here, no libcuda. A launcher holds one argument buffer: like the launch
plan that owns it, it serves one thread at a time.
"""

from __future__ import annotations

import ctypes
import logging
import re
import struct
import weakref
from operator import itemgetter
from typing import Any, NamedTuple

from . import c_entry as _fast

logger = logging.getLogger(__name__)

#: Triton scalar type -> struct code of the C type its launcher passes (``ty_to_cpp``; floats are
#: packed to their storage width as Triton's ``pack_fp16`` / ``pack_fp32`` do). bf16 scalars are refused.
SCALAR_CODES: dict[str, str] = {
    "i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q",
    "u1": "B", "u8": "B", "u16": "H", "u32": "I", "u64": "Q",
    "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d",
}  # fmt: skip

TENSORMAP_BYTES = 128
#: a CUtensorMap's host copy: Triton keeps it 128-byte aligned (its launcher checks), CUDA wants 64
TENSORMAP_ALIGN = 128
#: TMA data types as the compiler records them -> the host enum (Triton's TMA_DTYPE_DEVICE_TO_HOST)
_TMA_DTYPE_HOST = {8: 10, 9: 8, 10: 9}
_TMA_TF32 = 11
_L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B, as Triton encodes
_OOB_NAN_REQUEST_ZERO_FMA = 1
_CUDA_ERROR_INVALID_CONTEXT = 201


class Param(NamedTuple):
    """One kernel parameter as passed to ``cuLaunchKernel``. ``kind``: ``ptr`` / ``scalar`` (an
    argument's value), ``tensormap`` / ``desc_shape`` / ``desc_stride`` (from descriptor ``desc``),
    ``scratch``. ``arg``: the index of the kernel argument it comes from (-1: scratch). ``code``: its
    struct code (``tensormap``: ``None``)."""

    kind: str
    arg: int
    code: str | None
    size: int
    align: int
    desc: int = -1


_DESC_RE = re.compile(r"tensordesc<([^[>]*)\[([^\]]*)\]")


def _desc_ndim(ty: str) -> int:
    """Rank of a ``tensordesc<dtype[block], ...>`` type (``input_rank=`` where given, as Triton reads)."""
    m = _DESC_RE.match(ty)
    if m is None:
        raise ValueError(f"malformed tensor descriptor type {ty!r}")
    rank = re.search(r",input_rank=(\d+)", ty)
    return int(rank.group(1)) if rank else m.group(2).count(",") + 1


def param_layout(signature: list, tensordesc_meta: list | None) -> list[Param] | str:
    """The parameters Triton's launcher passes for a kernel whose argument types are ``signature``
    (``CompiledKernel.src.signature`` values, in order) and whose descriptors lowered with
    ``tensordesc_meta``: a list of :class:`Param`, or a string saying why it is not reproduced."""
    out: list[Param] = []
    n_desc = 0
    for i, ty in enumerate(signature):
        if not isinstance(ty, str):
            return f"argument {i} has type {ty!r} (tuples are not reproduced)"
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            out.append(Param("ptr", i, "Q", 8, 8))
        elif ty.startswith("tensordesc"):
            if ty.startswith("tensordesc_im2col"):
                return f"argument {i} is an im2col descriptor ({ty})"
            meta = tensordesc_meta[n_desc] if tensordesc_meta else None
            if meta is None:
                return f"argument {i} ({ty}) is a descriptor without TMA metadata"
            try:
                ndim = _desc_ndim(ty)
            except ValueError as e:
                return str(e)
            out.append(Param("tensormap", i, None, TENSORMAP_BYTES, TENSORMAP_ALIGN, n_desc))
            out += [Param("desc_shape", i, "i", 4, 4, n_desc)] * ndim
            out += [Param("desc_stride", i, "q", 8, 8, n_desc)] * ndim
            n_desc += 1
        elif ty in SCALAR_CODES:
            code = SCALAR_CODES[ty]
            size = struct.calcsize(code)
            out.append(Param("scalar", i, code, size, size))
        else:
            return f"argument {i} has type {ty!r}"
    if tensordesc_meta and n_desc != len(tensordesc_meta):
        return f"{len(tensordesc_meta)} descriptor metadata entries for {n_desc} descriptors"
    out += [Param("scratch", -1, "Q", 8, 8)] * 2  # global and profile scratch: always the last two
    return out


def _same(args: tuple) -> tuple:
    return args


def _nothing(args: tuple) -> tuple:
    return ()


def _one(i: int) -> Any:
    return lambda args: (args[i],)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ParamBuffer:
    """A kernel's parameters in one fixed buffer (:func:`param_layout`): fixed parts (descriptors,
    scratch pointers, arguments past ``n_args`` given as ``tail``) are written when set, a call's
    scalars and pointers by one ``struct.Struct.pack_into``. :attr:`kernel_params` is the address of
    the ``void *[n]`` array ``cuLaunchKernel`` takes."""

    def __init__(self, layout: list[Param], n_args: int, tail: tuple = ()) -> None:
        self.layout = layout
        self.n_args = n_args
        fixed = [j for j, p in enumerate(layout) if p.kind not in ("ptr", "scalar") or p.arg >= n_args]
        dynamic = [j for j, p in enumerate(layout) if p.kind in ("ptr", "scalar") and p.arg < n_args]
        # fixed region first (tensormaps 128-aligned at its start), then the packed region: the
        # struct's pad bytes never overwrite a fixed slot
        offsets = [0] * len(layout)
        pos = 0
        for j in sorted(fixed, key=lambda j: -layout[j].align):
            pos = _align(pos, layout[j].align)
            offsets[j] = pos
            pos += layout[j].size
        pos = _align(pos, 8)
        self._dyn_offset = pos
        fmt = "<"
        at = 0
        for j in dynamic:
            p = layout[j]
            pad = _align(at, p.align) - at
            fmt += "x" * pad + p.code
            at += pad
            offsets[j] = pos + at
            at += p.size
        self._struct = struct.Struct(fmt)
        size = pos + at + TENSORMAP_ALIGN
        self.raw = (ctypes.c_char * size)()
        base = ctypes.addressof(self.raw)
        self._shift = _align(base, TENSORMAP_ALIGN) - base  # the buffer's TENSORMAP_ALIGN-aligned start
        self.offsets = offsets  # per parameter, from the aligned start
        addrs = [base + self._shift + o for o in self.offsets]
        self._params = (ctypes.c_void_p * max(1, len(addrs)))(*addrs)
        self.kernel_params = ctypes.addressof(self._params)
        self.pack_into = self._struct.pack_into
        self.dyn_at = self._shift + self._dyn_offset
        #: the same packing for the C entry point (``c_entry.fast_pack_launch``): the aligned start's
        #: address and, per packed value, its offset from there, argument index and struct code
        self.base = base + self._shift
        self.spec = b"".join(
            struct.pack(_fast.SPEC_ENTRY, self.offsets[j], layout[j].arg, ord(layout[j].code))
            for j in dynamic
        )
        idx = [layout[j].arg for j in dynamic]
        #: picks a call's packed values out of its argument tuple (as a tuple)
        if idx == list(range(n_args)):
            self.pick = _same
        elif len(idx) > 1:
            self.pick = itemgetter(*idx)
        elif idx:
            self.pick = _one(idx[0])
        else:
            self.pick = _nothing
        self.ptr_args = [k for k, j in enumerate(dynamic) if layout[j].kind == "ptr"]
        for p, off in zip(layout, self.offsets, strict=True):
            if p.kind in ("ptr", "scalar") and p.arg >= n_args:
                v = tail[p.arg - n_args]
                struct.pack_into("<" + p.code, self.raw, self._shift + off, 0 if v is None else v)

    def pack(self, args: tuple) -> None:
        """Pack one call's arguments (pointers as addresses, or objects with ``data_ptr()``)."""
        vals = self.pick(args)
        try:
            self.pack_into(self.raw, self.dyn_at, *vals)
        except (struct.error, TypeError):  # a tensor for an integer code raises TypeError
            vals = list(vals)
            for j in self.ptr_args:  # tensors (or None) for pointers: their addresses
                v = vals[j]
                vals[j] = 0 if v is None else (v if isinstance(v, int) else v.data_ptr())
            try:
                self.pack_into(self.raw, self.dyn_at, *vals)
            except struct.error as e:
                raise ValueError(
                    f"arguments {vals!r} do not fit the compiled kernel's parameter types "
                    f"({self._struct.format!r}): {e}"
                ) from None

    def write(self, index: int, code: str, value: Any) -> None:
        """Write parameter ``index`` (a fixed slot) as struct ``code``."""
        struct.pack_into("<" + code, self.raw, self._shift + self.offsets[index], value)

    def address(self, index: int) -> int:
        """Host address of parameter ``index``'s slot."""
        return ctypes.addressof(self.raw) + self._shift + self.offsets[index]

    def param_bytes(self, index: int) -> bytes:
        """The bytes of parameter ``index`` as the driver will read them."""
        p, off = self.layout[index], self._shift + self.offsets[index]
        return bytes(self.raw[off : off + p.size])


_LIBCUDA: Any = None


def _libcuda() -> Any:
    """libcuda with the argument types of the calls made here set once (``None`` where absent)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")  # releases the GIL per call, as Triton's launcher does
        except OSError:
            _LIBCUDA = False
            return None
        vp, u32 = ctypes.c_void_p, ctypes.c_uint
        lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuTensorMapEncodeTiled.argtypes = [vp, ctypes.c_int, u32, vp, vp, vp, vp, vp] + [ctypes.c_int] * 4
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxGetCurrent.restype = ctypes.c_int
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.restype = ctypes.c_int
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuCtxSetCurrent.restype = ctypes.c_int
        _LIBCUDA = lib
    return _LIBCUDA or None


def _error_string(lib: Any, code: int) -> str:
    s = ctypes.c_char_p()
    if lib.cuGetErrorString(code, ctypes.byref(s)) != 0 or not s.value:
        return f"CUresult {code}"
    return f"{s.value.decode(errors='replace')} (CUresult {code})"


def tma_encode_args(desc: Any, meta: dict) -> tuple:
    """What Triton 3.6's ``fill_tma_descriptor`` passes ``cuTensorMapEncodeTiled`` for descriptor
    ``desc`` (``base``, ``shape``, ``strides``, ``padding``) lowered with ``meta``: ``(data type, rank,
    address, dims, byte strides, box, swizzle, oob fill)``, dims innermost first."""
    shape, strides = list(desc.shape), list(desc.strides)
    if strides[-1] != 1:
        raise ValueError(f"a TMA descriptor's last dim must be contiguous, got strides {strides}")
    if meta["fp4_padded"]:
        shape[-1] *= 2
    elem_type = meta["elem_type"]
    if getattr(desc, "round_f32_to_tf32", False):
        elem_type = _TMA_TF32
    esize = meta["elem_size"]
    rank = len(shape)
    dims = [int(x) for x in reversed(shape)]
    byte_strides = [esize * int(s) for s in reversed(strides[:-1])]
    box = [int(x) for x in reversed(meta["block_size"])]
    fill = _OOB_NAN_REQUEST_ZERO_FMA if desc.padding == "nan" else 0
    dtype = _TMA_DTYPE_HOST.get(elem_type, elem_type)
    return dtype, rank, desc.base.data_ptr(), dims, byte_strides, box, meta["swizzle"], fill


def _weak(x: Any) -> Any:
    """A weak reference to ``x``, or ``None`` where ``x`` takes none."""
    try:
        return weakref.ref(x)
    except TypeError:
        return None


class OwnLauncher:
    """Launches one compiled Triton kernel: ``launcher(grid, args, stream)`` with ``args`` the kernel's
    ``n_args`` leading arguments (pointers as addresses or tensors, descriptors as Triton's
    ``TensorDescriptor`` objects), its other arguments fixed (``tail``). Built by :func:`own_launcher`."""

    def __init__(
        self,
        name: str,
        function: int,
        packed: tuple,
        layout: list[Param],
        meta: list,
        n_args: int,
        tail: tuple,
        lib: Any,
        device_index: int | None = None,
    ) -> None:
        self.name = name
        self.function = function
        num_warps, _, self.shared = packed
        self.block = 32 * num_warps
        self.buf = ParamBuffer(layout, n_args, tail)
        self.lib = lib
        # the C entry point where it builds (2.6 us less per launch on the H200's host), else ctypes
        self._launch = None if lib is None else (_fast.fast_launch(lib.cuLaunchKernel) or lib.cuLaunchKernel)
        #: pack and launch in one C call where the module builds (``None``: pack here, then ``_launch``)
        self._pack_launch = None if lib is None else _fast.fast_pack_launch(lib.cuLaunchKernel)
        self.device_index = device_index
        self.meta = meta
        # per descriptor: (argument index, tensormap param index, shape param indices, stride indices)
        self.descs = []
        for d in range(len(meta) if meta else 0):
            idx = [j for j, p in enumerate(layout) if p.desc == d]
            arg = layout[idx[0]].arg
            self.descs.append(
                (
                    arg,
                    idx[0],
                    [j for j in idx if layout[j].kind == "desc_shape"],
                    [j for j in idx if layout[j].kind == "desc_stride"],
                )
            )
        self._desc_args = [(d, t[0]) for d, t in enumerate(self.descs)]
        # per descriptor: (the object encoded, a weak reference to its base or None, the base's address)
        self._held: list = [None] * len(self.descs)
        self.encodes = 0

    def _encode(self, d: int, desc: Any) -> None:
        arg, tm, shape_idx, stride_idx = self.descs[d]
        dtype, rank, addr, dims, bstrides, box, swizzle, fill = tma_encode_args(desc, self.meta[d])
        u64x5, u32x5 = ctypes.c_uint64 * 5, ctypes.c_uint32 * 5
        res = self.lib.cuTensorMapEncodeTiled(
            self.buf.address(tm), dtype, rank, addr, u64x5(*dims), u64x5(*bstrides), u32x5(*box),
            u32x5(1, 1, 1, 1, 1), 0, swizzle, _L2_PROMOTION_128B, fill,
        )  # fmt: skip
        if res != 0:
            raise RuntimeError(
                f"{self.name}: cuTensorMapEncodeTiled of argument {arg} failed: "
                f"{_error_string(self.lib, res)} "
                f"(shape {list(desc.shape)}, strides {list(desc.strides)}, meta {self.meta[d]})"
            )
        for j, v in zip(shape_idx, desc.shape, strict=True):
            self.buf.write(j, "i", int(v))
        for j, v in zip(stride_idx, desc.strides, strict=True):
            self.buf.write(j, "q", int(v))
        self._held[d] = (desc, _weak(desc.base), addr)
        self.encodes += 1

    def _check_descs(self, args: tuple) -> None:
        """Encode a descriptor argument again only when it is another object than the one encoded, or its
        ``base`` is another tensor (identity through a weak reference: the launcher keeps no cache alive)
        whose address differs. Descriptors are taken as immutable: a changed shape in place is not seen."""
        held = self._held
        for d, arg in self._desc_args:
            desc = args[arg]
            h = held[d]
            if h is None or h[0] is not desc:
                self._encode(d, desc)
                continue
            base = desc.base
            if h[1] is None or h[1]() is not base:  # another base tensor (bind): same memory?
                if base.data_ptr() != h[2]:
                    self._encode(d, desc)
                else:
                    held[d] = (desc, _weak(base), h[2])

    def __call__(self, grid: tuple, args: tuple, stream: int | None) -> None:
        buf = self.buf
        if self.descs:
            self._check_descs(args)
        n = len(grid)
        gx = grid[0]
        gy = grid[1] if n > 1 else 1
        gz = grid[2] if n > 2 else 1
        if gx * gy * gz <= 0:  # Triton launches nothing for an empty grid
            return
        pl = self._pack_launch
        res = _fast.NOT_PACKED
        if pl is not None and type(args) is tuple:
            res = pl(
                buf.base, buf.spec, args, self.function, gx, gy, gz, self.block, self.shared, stream,
                buf.kernel_params,
            )  # fmt: skip
        if res == _fast.NOT_PACKED:  # no C entry, or a value it does not pack (e.g. a tensor for a pointer)
            try:  # inline ParamBuffer.pack: a frame less per launch
                buf.pack_into(buf.raw, buf.dyn_at, *buf.pick(args))
            except (struct.error, TypeError):  # tensors for pointers: their addresses
                buf.pack(args)
            res = self._launch(
                self.function, gx, gy, gz, self.block, 1, 1, self.shared, stream, buf.kernel_params, None
            )  # fmt: skip
        if res:
            if res == _CUDA_ERROR_INVALID_CONTEXT and self._make_context():
                res = self._launch(
                    self.function, gx, gy, gz, self.block, 1, 1, self.shared, stream, buf.kernel_params, None
                )  # fmt: skip
            if res:
                raise RuntimeError(f"launch of {self.name} failed: {_error_string(self.lib, res)}")

    def _make_context(self) -> bool:
        """No current context in this thread (Triton's launcher makes one): the device's primary one."""
        lib = self.lib
        ctx = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or ctx.value:
            return False
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device_index or 0) != 0:
            return False
        return lib.cuCtxSetCurrent(ctx) == 0


def layout_of(kernel: Any) -> tuple[list[Param] | str, list]:
    """:func:`param_layout` of a ``CompiledKernel`` and its descriptor metadata (or a refusal string)."""
    try:
        signature = list(kernel.src.signature.values())
        meta = list(getattr(kernel.metadata, "tensordesc_meta", None) or [])
    except AttributeError as e:
        return f"a compiled kernel without {e.name or 'src.signature / metadata'}", []
    return param_layout(signature, meta), meta


def refusal(kernel: Any) -> str | None:
    """Why :class:`OwnLauncher` does not reproduce ``kernel``'s launch (``None``: it does)."""
    md = getattr(kernel, "metadata", None)
    need = (
        "num_ctas",
        "global_scratch_size",
        "profile_scratch_size",
        "launch_cooperative_grid",
        "launch_pdl",
    )
    if md is None or not all(hasattr(md, a) for a in need):
        return "a Triton whose compiled kernels lack the metadata read here"
    if (
        not hasattr(kernel, "function")
        or not hasattr(kernel, "packed_metadata")
        or not hasattr(kernel, "src")
    ):
        return "a Triton whose compiled kernels lack function / packed_metadata / src"
    if md.num_ctas != 1:
        return f"num_ctas {md.num_ctas} (clusters)"
    if md.launch_cooperative_grid:
        return "a cooperative grid"
    if md.launch_pdl:
        return "programmatic dependent launch"
    if md.global_scratch_size or md.profile_scratch_size:
        return f"scratch memory (global {md.global_scratch_size}, profile {md.profile_scratch_size})"
    if getattr(getattr(kernel, "_run", None), "gsan_enabled", False):
        return "GSan instrumentation"
    packed = kernel.packed_metadata
    if not (isinstance(packed, tuple) and len(packed) == 3 and all(isinstance(x, int) for x in packed)):
        return f"packed metadata {packed!r} is not (num_warps, num_ctas, shared)"
    return None


def own_launcher(
    kernel: Any, n_args: int, tail: tuple, device_index: int | None = None
) -> OwnLauncher | None:
    """An :class:`OwnLauncher` for ``kernel`` (a ``CompiledKernel`` already launched once through Triton)
    taking its first ``n_args`` arguments per call, the rest fixed to ``tail``; ``None`` (reason logged)
    where it would not reproduce Triton's launch exactly or libcuda is missing."""
    name = getattr(getattr(kernel, "metadata", None), "name", None) or getattr(kernel, "name", "kernel")
    why = refusal(kernel)
    layout: list[Param] | str = []
    meta: list = []
    if why is None:
        layout, meta = layout_of(kernel)
        if isinstance(layout, str):
            why = layout
        elif n_args + len(tail) != len(kernel.src.signature):
            why = f"{n_args} + {len(tail)} arguments for {len(kernel.src.signature)} parameters"
        elif any(p.desc >= 0 and p.arg >= n_args for p in layout):
            why = "a tensor descriptor among the fixed trailing arguments"
    lib = _libcuda() if why is None else None
    if why is None and lib is None:
        why = "no libcuda.so.1"
    if why is not None:
        logger.info("own launcher refused for %s: %s (Triton's launcher kept)", name, why)
        return None
    return OwnLauncher(
        name, kernel.function, kernel.packed_metadata, layout, meta, n_args, tail, lib, device_index
    )


__all__ = ["OwnLauncher", "Param", "ParamBuffer", "layout_of", "own_launcher", "param_layout", "refusal"]
