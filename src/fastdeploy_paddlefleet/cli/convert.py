"""``fdfleet convert dequantize SRC DST``: a quantized checkpoint as one the plugin serves.

gpt-oss MXFP4 and DeepSeek-V3 block-FP8 checkpoints are written as bfloat16 (or float32) copies:
``config.json`` without ``quantization_config``, every other tensor and file unchanged, all or
nothing (``convert.dequantize``, ``docs/convert.md``). Exit codes: 0 written, 2 a bad source or
target (named; an unknown ``quant_method`` included), 74 a read or write failed (a full disk: the
target was left as it was), 130 interrupted (the target was left as it was).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import INTERRUPTED, IO_ERROR, CliError

#: ``--dtype`` choices (``convert.dequantize.DTYPES``; repeated so ``fdfleet --help`` imports no numpy)
DTYPES = ("bf16", "fp32")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a downloaded checkpoint into one the plugin serves (dequantize MXFP4 / FP8)",
        description="Convert a downloaded checkpoint into one the plugin serves.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    d = actions.add_parser(
        "dequantize",
        help="write a bf16 copy of a gpt-oss MXFP4 or DeepSeek-V3 block-FP8 checkpoint",
        description="Write a dequantized copy of a gpt-oss MXFP4 or DeepSeek-V3 block-FP8 checkpoint.",
    )
    d.add_argument(
        "src", metavar="SRC", help="the quantized checkpoint's directory (config.json + *.safetensors)"
    )
    d.add_argument(
        "dst",
        metavar="DST",
        help="directory to write (must not exist or be empty, unless --force; a link is written through)",
    )
    d.add_argument(
        "--dtype", default="bf16", choices=DTYPES, help="dtype of the dequantized tensors (default bf16)"
    )
    d.add_argument(
        "--force",
        action="store_true",
        help="in a non-empty directory, replace the files of the same names (once complete) and keep every "
        "other file; refused for the current directory, the home directory and a filesystem root",
    )
    d.add_argument("--json", action="store_true", help="print a summary as one JSON object")
    d.set_defaults(func=run)
    p.set_defaults(func=_no_action)


def _no_action(args: Any) -> int:
    raise CliError("convert: name an action: dequantize (see fdfleet convert --help)")


def run(args: Any) -> int:
    from ..convert.dequantize import dequantize_checkpoint
    from ..serving.modeldir import ModelDirWriteError

    try:
        import numpy  # noqa: F401  (in no extra of its own: paddle brings it)
    except ModuleNotFoundError:
        raise CliError("fdfleet convert needs numpy, which is not installed: pip install numpy") from None

    try:
        report = dequantize_checkpoint(
            args.src, args.dst, dtype=args.dtype, force=args.force, progress=sys.stderr.isatty()
        )
    except ModelDirWriteError as e:
        raise CliError(str(e), exit_code=IO_ERROR) from e
    except KeyboardInterrupt:
        print(f"fdfleet: interrupted: {args.dst!r} was left as it was", file=sys.stderr)
        return INTERRUPTED
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    converted = ", ".join(f"{n} {kind}" for kind, n in sorted(report.converted.items()))
    print(
        f"wrote {report.path}: {converted} tensor(s) dequantized to {report.dtype}, {report.copied} copied, "
        f"{report.dropped} scale tensor(s) dropped; {len(report.shards)} shard(s), "
        f"{report.bytes_in} -> {report.bytes_out} bytes; config.json without quantization_config"
    )
    if report.files:
        print(f"copied {', '.join(report.files)}")
    if report.kept:
        print(f"kept {', '.join(report.kept)}")
    return 0
