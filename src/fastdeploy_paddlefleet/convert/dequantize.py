"""``dequantize``: a quantized checkpoint directory -> a bfloat16 (or float32) copy the plugin serves.

Planned in full before a byte is written (:func:`plan_dequantize`: config, index, every shard's
header, every quantized pair and its shapes, every other file), then written shard by shard, one
tensor (or one slice of one) at a time into a temporary sibling of the target, which is swapped in
when complete (``serving.modeldir.write_dir``). Rules: ``docs/convert.md``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..plan.fields import open_regular, read_json_file
from ..serving.checks import CONVERTIBLE
from ..serving.modeldir import ModelDirWriteError, check_target, write_dir
from .formats import MXFP4_BLOCK, MXFP4_BLOCK_BYTES
from .safetensors_io import (
    COPY_CHUNK,
    Entry,
    Writer,
    check_written,
    copy_tensor,
    read_bytes,
    read_header,
)

logger = logging.getLogger(__name__)

#: ``--dtype`` -> the safetensors dtype written for a dequantized tensor
DTYPES = {"bf16": "BF16", "fp32": "F32"}
#: the ``quant_method`` values this converts (the refusal at load time names the converter for them)
METHODS = CONVERTIBLE
CONFIG, INDEX = "config.json", "model.safetensors.index.json"
#: float32 elements one decode step holds (the memory bound: ``docs/convert.md``)
CHUNK_ELEMENTS = 4 * 2**20
MXFP4_BLOCKS, MXFP4_SCALES, FP8_SCALE = "_blocks", "_scales", "_scale_inv"


@dataclass(frozen=True)
class Job:
    """One output tensor: ``kind`` ``copy`` (``source`` unchanged), ``mxfp4`` (``source`` the
    blocks, ``scale`` the scales) or ``fp8`` (``source`` the weight, ``scale`` its scale_inv)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    source: Entry
    source_path: Path
    scale: Entry | None = None
    scale_path: Path | None = None


@dataclass
class Plan:
    """Everything to write: ``shards`` (file name -> its jobs in order), the new config and index
    (``None``: none is written), the other files to copy, the subdirectories left out."""

    src: Path
    method: str
    dtype: str
    config: dict[str, Any]
    shards: dict[str, list[Job]]
    metadata: dict[str, dict[str, str] | None]
    index: dict[str, Any] | None
    files: list[str]
    skipped: list[str]
    bytes_in: int
    block: tuple[int, int] | None = None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for jobs in self.shards.values():
            for job in jobs:
                out[job.kind] = out.get(job.kind, 0) + 1
        return out

    def bytes_out(self) -> int:
        """The tensors' bytes (the index's ``total_size``)."""
        return sum(math.prod(j.shape) * _itemsize(j.dtype) for jobs in self.shards.values() for j in jobs)


@dataclass
class ConvertReport:
    """What :func:`dequantize_checkpoint` wrote (``--json`` prints :meth:`to_dict`)."""

    source: str
    path: str
    quant_method: str
    dtype: str
    converted: dict[str, int]
    copied: int
    dropped: int
    bytes_in: int
    bytes_out: int
    shards: list[str]
    files: list[str]
    skipped: list[str]
    nonfinite: int = 0
    kept: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _itemsize(dtype: str) -> int:
    from .safetensors_io import DTYPE_BYTES

    return DTYPE_BYTES[dtype]


def _source_dir(src: str | os.PathLike) -> Path:
    if src is None or not str(os.fspath(src)).strip():
        raise ValueError(f"the source checkpoint must name a directory, got {src!r}")
    path = Path(os.path.abspath(src))
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ValueError(f"source checkpoint {str(path)!r} {what} (give the model directory)")
    return path


def quant_settings(config: dict[str, Any], where: str) -> tuple[str, tuple[int, int] | None]:
    """``(quant_method, fp8 block or None)`` of a config's ``quantization_config``; ``ValueError``
    naming the field for no config, an unknown method or fp8 settings other than DeepSeek-V3's."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or not qc:
        raise ValueError(
            f"{where}: config.json has no quantization_config: nothing to dequantize (serve it as it is)"
        )
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ValueError(
            f"{where}: quantization_config.quant_method {method!r} is not a format the converter knows "
            f"(it dequantizes {', '.join(repr(m) for m in METHODS)})"
        )
    if method == "mxfp4":
        return method, None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: quantization_config.fmt {fmt!r}: only 'e4m3' (float8_e4m3fn) is read")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"{where}: quantization_config.activation_scheme {scheme!r}: only 'dynamic' (no stored "
            "activation scales) is converted"
        )
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise ValueError(
            f"{where}: quantization_config.weight_block_size {block!r} is not two positive integers "
            "(per-block FP8 such as DeepSeek-V3's [128, 128] is converted, per-tensor FP8 is not)"
        )
    return method, (block[0], block[1])


def _shard_names(src: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The weight files and the index (``None`` without one): the index's files, which must be
    plain names in ``src`` and be every ``*.safetensors`` there."""
    found = sorted(
        p.name for p in src.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith(".")
    )
    index_path = src / INDEX
    if not index_path.exists():
        if not found:
            raise ValueError(f"source checkpoint {str(src)!r}: no *.safetensors weights in it")
        return found, None
    index = read_json_file(index_path, "index file")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map is not an object of file names")
    named = sorted(set(weight_map.values()))
    for name in named:
        if name != Path(name).name or name in ("", ".", ".."):
            raise ValueError(f"{index_path}: weight_map names {name!r}, not a file of this directory")
    if named != found:
        extra, missing = sorted(set(found) - set(named)), sorted(set(named) - set(found))
        raise ValueError(
            f"{index_path}: its weight_map does not name the directory's weight files "
            f"(missing there: {missing[:3]}, not in it: {extra[:3]})"
        )
    return named, index


def plan_dequantize(src: str | os.PathLike, dtype: str = "bf16") -> Plan:
    """Read and check everything of the checkpoint in ``src`` that the write needs, read no tensor.

    ``ValueError`` naming the file, field or tensor: no directory, no ``config.json``, no or an
    unknown ``quantization_config``, an index that does not match the files, a damaged header, a
    quantized tensor without its partner or with shapes that do not fit (``docs/convert.md``), a
    float8 tensor left unconverted, an entry that is no regular file."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    root = _source_dir(src)
    config = read_json_file(root / CONFIG)
    method, block = quant_settings(config, str(root))
    shard_names, index = _shard_names(root)
    headers = {name: read_header(root / name) for name in shard_names}
    where: dict[str, str] = {}
    for shard, header in headers.items():
        for entry in header.entries:
            if entry.name in where:
                raise ValueError(
                    f"source checkpoint {str(root)!r}: tensor {entry.name!r} is in both {where[entry.name]} "
                    f"and {shard}"
                )
            where[entry.name] = shard
    if index is not None and index["weight_map"] != where:
        wrong = sorted(
            n for n in set(where) | set(index["weight_map"]) if index["weight_map"].get(n) != where.get(n)
        )
        raise ValueError(
            f"{root / INDEX}: weight_map does not say where the tensors are, e.g. {wrong[:3]} "
            "(a stale index, or shards of another checkpoint)"
        )

    def entry(name: str) -> tuple[Entry, Path]:
        return headers[where[name]].by_name[name], root / where[name]

    out_dtype = DTYPES[dtype]
    pair = _mxfp4_job if method == "mxfp4" else _fp8_job
    partner = MXFP4_SCALES if method == "mxfp4" else FP8_SCALE
    shards: dict[str, list[Job]] = {}
    for shard, header in headers.items():
        jobs = []
        for e in header.entries:
            if e.name.endswith(partner):
                _partner_of(e, where, method)  # dropped, once its tensor is known to exist
                continue
            job = pair(e, root / shard, entry, where, out_dtype, block)
            jobs.append(job)
        if jobs:
            shards[shard] = jobs
    kinds = sorted({j.kind for jobs in shards.values() for j in jobs} - {"copy"})
    if not kinds:
        raise ValueError(
            f"source checkpoint {str(root)!r}: quant_method {method!r} but no quantized tensor in it "
            f"(no {'*_blocks' if method == 'mxfp4' else '*_scale_inv'})"
        )
    files, skipped = _other_files(root, set(shard_names))
    new_config = {k: v for k, v in config.items() if k != "quantization_config"}
    plan = Plan(
        src=root,
        method=method,
        dtype=dtype,
        config=new_config,
        shards=shards,
        metadata={shard: headers[shard].metadata for shard in shards},
        index=None,
        files=files,
        skipped=skipped,
        bytes_in=sum(h.size for h in headers.values()),
        block=block,
    )
    if index is not None or len(shards) > 1:
        meta = index.get("metadata") if index is not None else None
        meta = dict(meta) if isinstance(meta, dict) else {}
        meta["total_size"] = plan.bytes_out()
        weight_map = {j.name: shard for shard, jobs in shards.items() for j in jobs}
        plan.index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return plan


def _partner_of(e: Entry, where: dict[str, str], method: str) -> None:
    """A scale tensor (``X_scales`` / ``X_scale_inv``) without its ``X_blocks`` / ``X`` is refused."""
    if method == "mxfp4":
        base = e.name[: -len(MXFP4_SCALES)] + MXFP4_BLOCKS
    else:
        base = e.name[: -len(FP8_SCALE)]
    if base not in where:
        raise ValueError(f"tensor {e.name!r} has no {base!r} beside it: a scale of nothing")


def _mxfp4_job(e: Entry, path: Path, entry: Callable, where: dict, out_dtype: str, block: Any) -> Job:
    """``X_blocks`` uint8 ``[E, R, G, 16]`` + ``X_scales`` uint8 ``[E, R, G]`` -> ``X`` ``[E, G * 32, R]``
    (transformers' dequantized layout: the decoded ``[E, R, G * 32]`` with its last two axes swapped)."""
    if not e.name.endswith(MXFP4_BLOCKS):
        _refuse_float8(e)
        return Job(e.name, "copy", e.dtype, e.shape, e, path)
    scales_name = e.name[: -len(MXFP4_BLOCKS)] + MXFP4_SCALES
    if scales_name not in where:
        raise ValueError(f"tensor {e.name!r} has no {scales_name!r} beside it (MXFP4 needs both)")
    scales, scales_path = entry(scales_name)
    if e.dtype != "U8" or scales.dtype != "U8":
        raise ValueError(
            f"MXFP4 tensors {e.name!r} ({e.dtype}) and {scales_name!r} ({scales.dtype}) must be U8"
        )
    if len(e.shape) != 4 or e.shape[-1] != MXFP4_BLOCK_BYTES or scales.shape != e.shape[:-1]:
        raise ValueError(
            f"MXFP4 tensors {e.name!r} {list(e.shape)} and {scales_name!r} {list(scales.shape)}: expected "
            f"[E, R, G, {MXFP4_BLOCK_BYTES}] blocks and [E, R, G] scales (gpt-oss experts)"
        )
    experts, rows, groups, _ = e.shape
    name = e.name[: -len(MXFP4_BLOCKS)]
    if name in where:
        raise ValueError(f"tensor {name!r} exists beside {e.name!r}: the checkpoint holds it twice")
    return Job(name, "mxfp4", out_dtype, (experts, groups * MXFP4_BLOCK, rows), e, path, scales, scales_path)


def _fp8_job(e: Entry, path: Path, entry: Callable, where: dict, out_dtype: str, block: Any) -> Job:
    """``X`` float8_e4m3fn ``[M, N]`` + ``X_scale_inv`` float32 ``[ceil(M / bm), ceil(N / bn)]`` -> ``X``
    ``[M, N]``."""
    scale_name = e.name + FP8_SCALE
    if scale_name not in where:
        _refuse_float8(e)
        return Job(e.name, "copy", e.dtype, e.shape, e, path)
    scale, scale_path = entry(scale_name)
    if e.dtype != "F8_E4M3":
        raise ValueError(
            f"tensor {e.name!r} has {scale_name!r} but is {e.dtype}, not F8_E4M3 (float8_e4m3fn)"
        )
    bm, bn = block
    if len(e.shape) != 2:
        raise ValueError(f"FP8 tensor {e.name!r} has shape {list(e.shape)}: block scales need [M, N]")
    want = (-(-e.shape[0] // bm), -(-e.shape[1] // bn))
    if scale.dtype != "F32" or scale.shape != want:
        raise ValueError(
            f"{scale_name!r} is {scale.dtype} {list(scale.shape)}: {e.name!r} {list(e.shape)} in "
            f"{bm}x{bn} blocks needs F32 {list(want)}"
        )
    return Job(e.name, "fp8", out_dtype, e.shape, e, path, scale, scale_path)


def _refuse_float8(e: Entry) -> None:
    if e.dtype.startswith("F8_"):
        raise ValueError(
            f"tensor {e.name!r} is {e.dtype} with no scale beside it: the plugin cannot serve float8 "
            "weights and the converter has no rule for this one"
        )


def _other_files(root: Path, shards: set[str]) -> tuple[list[str], list[str]]:
    """``(files copied as they are, subdirectories left out)``: every other entry of ``root`` but
    hidden ones; anything that is neither a regular file (links followed) nor a directory is refused."""
    import stat

    files, skipped = [], []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name in shards or p.name in (CONFIG, INDEX):
            continue
        try:
            mode = p.stat().st_mode
        except OSError as e:
            raise ValueError(f"{p}: cannot read: {e.strerror or e}") from None
        if stat.S_ISDIR(mode):
            skipped.append(p.name)
        elif stat.S_ISREG(mode):
            files.append(p.name)
        else:
            open_regular(p, "file")  # raises, naming what it is
    return files, skipped


def dequantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str = "bf16",
    force: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Write a dequantized copy of the checkpoint in ``src`` to ``dst`` (``docs/convert.md``).

    ``dst`` must not exist or be empty; with ``force`` the files this writes replace their namesakes
    there and every other file stays. All or nothing (``serving.modeldir.write_dir``): any failure
    leaves ``dst`` as it was. ``ValueError`` for a bad input (named); ``ModelDirWriteError`` (an
    ``OSError``) for a failed read or write, a filesystem too small for the output included."""
    import numpy  # noqa: F401  (both before anything is read: a missing one names its extra)
    import safetensors  # noqa: F401

    plan = plan_dequantize(src, dtype)
    out = check_target(dst, force, "the converted checkpoint's files of the same names")
    if out.resolve() == plan.src.resolve():
        raise ValueError(f"the target {str(out)!r} is the source checkpoint: name another directory")
    _check_room(out, plan)
    counter = {"nonfinite": 0}
    write_dir(out, lambda tmp: _write(tmp, plan, progress, counter), force=force)
    counts = plan.counts()
    report = ConvertReport(
        source=str(plan.src),
        path=str(out),
        quant_method=plan.method,
        dtype=dtype,
        converted={k: v for k, v in counts.items() if k != "copy"},
        copied=counts.get("copy", 0),
        dropped=sum(v for k, v in counts.items() if k != "copy"),  # one scale tensor per converted one
        bytes_in=plan.bytes_in,
        bytes_out=sum((out / s).stat().st_size for s in plan.shards),
        shards=sorted(plan.shards),
        files=plan.files,
        skipped=plan.skipped,
        nonfinite=counter["nonfinite"],
    )
    written = {*plan.shards, CONFIG, *plan.files, *([INDEX] if plan.index is not None else [])}
    report.kept = sorted(p.name for p in out.iterdir() if p.name not in written)
    if report.nonfinite:
        logger.warning(
            "%d dequantized values are NaN or infinite (NaN codes, E8M0 scales of 255 or results past the "
            "output dtype's range in %s): check the source",
            report.nonfinite,
            plan.src,
        )
    if plan.skipped:
        logger.warning("not copied (subdirectories): %s", ", ".join(plan.skipped))
    return report


def _check_room(out: Path, plan: Plan) -> None:
    """Refuse at once (``ModelDirWriteError``, ``ENOSPC``) when the target's filesystem has less
    free space than the shards and copied files need."""
    need = plan.bytes_out() + sum((plan.src / f).stat().st_size for f in plan.files)
    probe = next((p for p in (out, *out.parents) if p.exists()), None)
    if probe is None:
        return
    free = shutil.disk_usage(probe).free
    if free < need:
        cause = OSError(
            errno.ENOSPC,
            f"the converted checkpoint needs {need} bytes, the filesystem has {free} free",
        )
        raise ModelDirWriteError(out, cause, doing="converting into")


def _write(tmp: Path, plan: Plan, progress: bool, counter: dict[str, int]) -> None:
    """Write every output file of ``plan`` into ``tmp``."""
    from ..runner.verify import progress_bar

    total = sum(len(jobs) for jobs in plan.shards.values())
    bar = progress_bar(total, "dequantize", progress, unit="tensor")
    opened: dict[Path, BinaryIO] = {}
    try:
        for shard, jobs in plan.shards.items():
            planned = [(j.name, j.dtype, j.shape) for j in jobs]
            writer = Writer(tmp / shard, planned, plan.metadata.get(shard) or {"format": "pt"})
            try:
                for job in jobs:
                    _write_job(job, writer, plan, opened, counter)
                    bar.update(1)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            check_written(tmp / shard, planned)
        if plan.index is not None:
            (tmp / INDEX).write_text(json.dumps(plan.index, indent=2) + "\n", encoding="utf-8")
        (tmp / CONFIG).write_text(json.dumps(plan.config, indent=2) + "\n", encoding="utf-8")
        for name in plan.files:
            _copy_file(plan.src / name, tmp / name)
    finally:
        bar.close()
        for f in opened.values():
            f.close()


def _source(path: Path, opened: dict[Path, BinaryIO]) -> BinaryIO:
    if path not in opened:
        opened[path], _ = open_regular(path, "weights file")
    return opened[path]


def _write_job(
    job: Job, writer: Writer, plan: Plan, opened: dict[Path, BinaryIO], counter: dict[str, int]
) -> None:
    src = _source(job.source_path, opened)
    if job.kind == "copy":
        copy_tensor(src, job.source_path, job.source, writer, job.name)
        return
    scale_src = _source(job.scale_path, opened)
    pieces = (
        _mxfp4_pieces(job, src, scale_src) if job.kind == "mxfp4" else _fp8_pieces(job, src, scale_src, plan)
    )
    for values in pieces:
        writer.write(job.name, _encode(values, job.dtype, counter))


def _encode(values: Any, dtype: str, counter: dict[str, int]) -> Any:
    """float32 ``values`` as the output ``dtype``'s bytes; NaN and infinite results counted (after
    rounding: a float32 past bfloat16's range is infinite there)."""
    import numpy as np

    from .formats import to_bf16_bits

    if dtype == "BF16":
        out = to_bf16_bits(values)
        counter["nonfinite"] += int(np.count_nonzero((out & 0x7F80) == 0x7F80))  # exponent all ones
        return out.astype("<u2", copy=False)  # safetensors is little-endian
    out = np.ascontiguousarray(values, dtype="<f4")
    counter["nonfinite"] += int(out.size - np.count_nonzero(np.isfinite(out)))
    return out


def _mxfp4_pieces(job: Job, blocks_src: BinaryIO, scales_src: BinaryIO) -> Any:
    """The output ``[E, C, R]`` (``C = G * 32``) in pieces of whole output rows: per expert, its
    packed bytes ``[R, G, 16]`` and scales ``[R, G]`` are read once, then ``g`` groups at a time are
    decoded to ``[R, g * 32]`` and transposed to rows ``[g * 32, R]`` of the output."""
    from .formats import mxfp4_rows

    experts, rows, groups, _ = job.source.shape
    per_expert = rows * groups * MXFP4_BLOCK_BYTES
    step = max(1, CHUNK_ELEMENTS // max(1, rows * MXFP4_BLOCK))
    for ex in range(experts):
        packed = read_bytes(blocks_src, job.source_path, job.source.begin + ex * per_expert, per_expert)
        packed = packed.reshape(rows, groups, MXFP4_BLOCK_BYTES)
        scales = read_bytes(scales_src, job.scale_path, job.scale.begin + ex * rows * groups, rows * groups)
        scales = scales.reshape(rows, groups)
        for g0 in range(0, groups, step):
            g1 = min(groups, g0 + step)
            yield mxfp4_rows(packed[:, g0:g1], scales[:, g0:g1]).T  # [(g1 - g0) * 32, R]


def _fp8_pieces(job: Job, weight_src: BinaryIO, scale_src: BinaryIO, plan: Plan) -> Any:
    """The output ``[M, N]`` in bands of whole row blocks (at most about :data:`CHUNK_ELEMENTS`)."""
    import numpy as np

    from .formats import e4m3fn_table, fp8_block_rows

    bm, bn = plan.block
    m, n = job.shape
    scales = read_bytes(scale_src, job.scale_path, job.scale.begin, job.scale.nbytes)
    scales = scales.view(np.dtype("<f4")).reshape(job.scale.shape).astype(np.float32)
    table = e4m3fn_table()
    band = max(1, CHUNK_ELEMENTS // max(1, n * bm)) * bm
    for r0 in range(0, m, band):
        r1 = min(m, r0 + band)
        raw = read_bytes(weight_src, job.source_path, job.source.begin + r0 * n, (r1 - r0) * n)
        yield fp8_block_rows(raw.reshape(r1 - r0, n), scales[r0 // bm : -(-r1 // bm)], (bm, bn), table)


def _copy_file(src: Path, dst: Path) -> None:
    """Copy a regular file byte for byte, :data:`COPY_CHUNK` at a time; one that changed size while
    being copied is an ``OSError`` naming it."""
    f, size = open_regular(src, "file")
    copied = 0
    with f, open(dst, "xb") as out:
        while chunk := f.read(COPY_CHUNK):
            out.write(chunk)
            copied += len(chunk)
    if copied != size:
        raise OSError(f"reading {str(src)!r}: {copied} bytes where it had {size} (it changed while copied)")
