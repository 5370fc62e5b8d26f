"""safetensors files read and written one tensor (or one slice of one) at a time.

The format (https://github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian
header length ``n``, ``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the byte buffer the offsets index (relative to its start,
row-major, little-endian). ``safe_open`` reads a tensor into a framework's array, but numpy has no
bfloat16 or float8 dtype: reading the bytes at the header's offsets needs no framework and copies a
tensor that is not converted byte for byte. The header is validated before a byte of data is read
(:func:`read_header`), and every output file is opened again with safetensors' own ``safe_open``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..plan.fields import open_regular

#: bytes per element of the safetensors dtypes
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: safetensors' own cap on a header (its ``MAX_HEADER_SIZE``)
MAX_HEADER_BYTES = 100_000_000
#: the most bytes one copy step holds
COPY_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: ``begin`` / ``end`` are absolute file offsets of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Header:
    """A validated header: the tensors in file order, the metadata, the file's size."""

    path: Path
    entries: list[Entry]
    metadata: dict[str, str] | None
    size: int
    by_name: dict[str, Entry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {e.name: e for e in self.entries}


def _bad(path: Path, why: str) -> ValueError:
    return ValueError(f"weights file {str(path)!r}: not a readable safetensors file: {why}")


def read_header(path: Path) -> Header:
    """The header of ``path``, checked against the file: a regular file, the header length within
    safetensors' cap and the file, JSON of known dtypes, every tensor's bytes ``prod(shape) *
    itemsize``, the buffers back to back from 0 to the end of the file (nothing overlaps, nothing
    is left over). ``ValueError`` naming the file and the tensor otherwise."""
    f, size = open_regular(path, "weights file")
    with f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"{size} bytes, shorter than its header")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(path, f"its header claims {n} bytes in a file of {size} (truncated or damaged)")
        raw = f.read(n)
    if len(raw) != n:
        raise _bad(path, "it changed while its header was read")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _bad(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"its header is a {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad(path, "its __metadata__ is not an object of strings")
    start = 8 + n
    entries = sorted((_entry(path, name, info, start) for name, info in header.items()), key=_order)
    at = start
    for e in entries:
        if e.begin != at:
            raise _bad(
                path, f"tensor {e.name!r} starts at byte {e.begin - start} of the buffer, not {at - start}"
            )
        at = e.end
    if at != size:
        raise _bad(path, f"its tensors end at byte {at} of a {size}-byte file (truncated or damaged)")
    return Header(path, entries, metadata, size)


def _order(e: Entry) -> tuple[int, int]:
    return (e.begin, e.end)


def _entry(path: Path, name: str, info: Any, start: int) -> Entry:
    if not isinstance(info, dict):
        raise _bad(path, f"tensor {name!r}: its entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _bad(path, f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise _bad(
            path,
            f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for {dtype} {shape} (expected {want})",
        )
    return Entry(name, dtype, tuple(shape), start + offsets[0], start + offsets[1])


def read_bytes(f: BinaryIO, path: Path, begin: int, count: int) -> Any:
    """``count`` bytes of ``f`` from absolute offset ``begin`` as a uint8 array; a short read (the
    file shrank since its header was read) is an ``OSError`` naming ``path``."""
    import numpy as np

    out = np.empty(count, dtype=np.uint8)
    f.seek(begin)
    got = f.readinto(memoryview(out)) if count else 0
    while got < count:  # readinto may return less than asked before the end of the file
        more = f.readinto(memoryview(out)[got:])
        if not more:
            raise OSError(f"reading {str(path)!r}: {count - got} of its bytes are missing (it shrank)")
        got += more
    return out


class Writer:
    """A safetensors file written in one pass: the header from the planned ``(name, dtype, shape)``
    list first, then each tensor's bytes in that order through :meth:`write` (in as many pieces as
    the caller likes); :meth:`close` checks every byte arrived."""

    def __init__(
        self, path: Path, planned: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
    ):
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.sizes: list[tuple[str, int]] = []
        at = 0
        for name, dtype, shape in planned:
            nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
            self.sizes.append((name, nbytes))
            at += nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the buffer starts 8-byte aligned, as safetensors writes it
        self.path = path
        self.nbytes = 8 + len(text) + at
        self._f = open(path, "xb")  # noqa: SIM115 (closed by close())
        self._f.write(struct.pack("<Q", len(text)) + text)
        self._index = 0
        self._left = self.sizes[0][1] if self.sizes else 0

    def write(self, name: str, data: Any) -> None:
        """Append ``data`` (bytes-like, C-contiguous) to tensor ``name``, the one being written."""
        view = memoryview(data).cast("B")
        while self._index < len(self.sizes) and self._left == 0 and self.sizes[self._index][0] != name:
            self._next()
        expected = self.sizes[self._index][0] if self._index < len(self.sizes) else None
        if name != expected or len(view) > self._left:
            raise RuntimeError(
                f"{self.path}: {len(view)} bytes for {name!r} out of order (writing {expected!r})"
            )
        self._f.write(view)
        self._left -= len(view)

    def _next(self) -> None:
        self._index += 1
        self._left = self.sizes[self._index][1] if self._index < len(self.sizes) else 0

    def close(self) -> None:
        """Close the file; a tensor short of bytes is a ``RuntimeError`` (a bug in the caller)."""
        while self._index < len(self.sizes) and self._left == 0:
            self._next()
        self._f.close()
        if self._index < len(self.sizes):
            raise RuntimeError(f"{self.path}: tensor {self.sizes[self._index][0]!r} was not written in full")

    def abort(self) -> None:
        self._f.close()


def copy_tensor(src: BinaryIO, path: Path, entry: Entry, writer: Writer, name: str | None = None) -> None:
    """Copy ``entry``'s bytes from ``src`` into ``writer`` unchanged, :data:`COPY_CHUNK` at a time."""
    for at in range(entry.begin, entry.end, COPY_CHUNK):
        count = min(COPY_CHUNK, entry.end - at)
        writer.write(name or entry.name, read_bytes(src, path, at, count))
    if entry.nbytes == 0:
        writer.write(name or entry.name, b"")


def check_written(path: Path, planned: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """Open ``path`` with safetensors' own reader and compare its tensors' names, dtypes and shapes
    with ``planned`` (no tensor is read): ``RuntimeError`` on a difference (a bug of this writer)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        got = {}
        for name in f.keys():
            piece = f.get_slice(name)
            got[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    want = {name: (dtype, tuple(shape)) for name, dtype, shape in planned}
    if got != want:
        raise RuntimeError(f"{path}: safetensors reads back other tensors than were written")
