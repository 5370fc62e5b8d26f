"""Write an embedded minifleet preset as a model directory FastDeploy can serve.

FastDeploy reads a model directory's ``config.json`` itself (``ModelConfig``: it
requires a ``dtype`` or ``torch_dtype`` field, takes ``architectures`` for the
registry lookup) and its v1 loader streams the weights of ``*.safetensors`` files
into ``model.load_weights``. A preset JSON has neither, so::

    python -m fastdeploy_paddlefleet.serving.modeldir tiny /tmp/tiny --dtype float32 [--seed 0] [--json]

writes ``config.json`` (the preset plus ``dtype``, ``seed``, ``torch_dtype`` absent,
FastDeploy's ``max_model_len``-related ``max_position_embeddings`` kept) and
``model.safetensors`` (the minifleet weights for ``seed``; names are the model's own,
as ``PaddleFleetForCausalLM.set_state_dict`` takes them). Only minifleet presets
(``tiny``, ``tiny-mla``) can be written: the others describe real models without weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def write_model_dir(
    preset: str | dict[str, Any], path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a minifleet preset (name or dict) to ``path``."""
    import numpy as np
    from safetensors.numpy import save_file

    from ..minifleet import build_minifleet
    from ..presets import load_preset

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    config = dict(load_preset(preset) if isinstance(preset, str) else preset)
    if config.get("model_type") != "minifleet":
        raise ValueError(
            f"only minifleet presets can be written as a model directory, got model_type "
            f"{config.get('model_type')!r}"
        )
    config.pop("_comment", None)
    config.pop("torch_dtype", None)  # FastDeploy refuses a config with both
    config.update(dtype=dtype, seed=seed)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = build_minifleet(config, seed=seed, dtype="float32")
    tensors = {}
    for name, value in model.state_dict().items():
        array = value.numpy()
        tensors[name] = array.astype(np.float32) if dtype == "float32" else array  # bf16: loader casts
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastdeploy_paddlefleet.serving.modeldir",
        description="Write a minifleet preset as a FastDeploy model directory (config.json + weights).",
    )
    parser.add_argument("preset", help="minifleet preset name (tiny, tiny-mla)")
    parser.add_argument("path", help="directory to write")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        out = write_model_dir(args.preset, args.path, dtype=args.dtype, seed=args.seed)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"path": str(out), "files": files, "dtype": args.dtype, "seed": args.seed}))
    else:
        print(f"wrote {out} ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
