"""``fdfleet modeldir``: write a minifleet preset as a model directory FastDeploy can serve.

``config.json`` + ``model.safetensors``, all or nothing (``serving.modeldir``). Exit codes: 0
written, 2 a refused target or preset (named), 74 the write failed (a full disk: the target was
left as it was), 130 interrupted (the target was left as it was).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..presets import minifleet_presets
from . import INTERRUPTED, IO_ERROR, CliError, int_arg

#: what the write may produce (``serving.modeldir.DTYPES``; repeated so ``fdfleet --help`` imports no numpy)
DTYPES = ("float32", "bfloat16", "float16")
OURS = ("config.json", "model.safetensors")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "modeldir",
        help="write a minifleet preset as a FastDeploy model directory (config.json + weights)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("preset", help=f"minifleet preset name ({', '.join(minifleet_presets())})")
    p.add_argument(
        "path",
        help="directory to write (must not exist or be empty, unless --force; a link is written through)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--seed", type=int_arg(0, 2**32 - 1), default=0, help="seed of the weights (default 0)")
    p.add_argument(
        "--force",
        action="store_true",
        help=f"in a non-empty directory, replace {' and '.join(OURS)} (once complete) and keep every other "
        "file; refused for the current directory, the home directory and a filesystem root",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: Any) -> int:
    from ..serving.modeldir import OURS as written
    from ..serving.modeldir import ModelDirWriteError, write_model_dir

    try:
        out = write_model_dir(args.preset, args.path, dtype=args.dtype, seed=args.seed, force=args.force)
    except ModelDirWriteError as e:
        raise CliError(str(e), exit_code=IO_ERROR) from e
    except KeyboardInterrupt:
        print(f"fdfleet: interrupted: {args.path!r} was left as it was", file=sys.stderr)
        return INTERRUPTED
    kept = sorted(p.name for p in out.iterdir() if p.name not in written)
    if args.json:
        report = {"path": str(out), "files": list(written), "kept": kept}
        print(json.dumps({**report, "dtype": args.dtype, "seed": args.seed}))
    else:
        print(f"wrote {out} ({', '.join(written)})" + (f"; kept {', '.join(kept)}" if kept else ""))
    return 0
