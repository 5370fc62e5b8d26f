"""Verify cases on a checkpoint directory: ``fdfleet verify --model DIR``.

The check a user runs before serving: the model in ``DIR`` (``config.json`` plus
``*.safetensors``) is built twice on the checkpoint's real weights, one copy left
with its own eager attention and one patched onto the paged path, and
``runner.verify.run_verify`` compares them as for the embedded model. Two kinds
of directory:

* a minifleet model directory (``model_type: minifleet``), as
  ``python -m fastdeploy_paddlefleet.serving.modeldir`` writes it: the weights
  are the model's own names, loaded with ``serving.weights.assign_weights``
  into two models built from different seeds (so a weight the checkpoint lacks
  would show up as a difference; it is refused before that);
* a PaddleFormers checkpoint of an architecture in
  ``paddleformers_case.ARCHITECTURES`` (what ``save_pretrained`` writes): both
  copies are PaddleFormers' own ``from_pretrained`` (its name and layout
  conversions), made under different seeds; a tensor the two disagree on was
  not in the checkpoint and is refused by name.

Every error names the directory (and the file or field): a missing directory,
no ``config.json``, no ``*.safetensors``, weights the model has and the
checkpoint lacks, a ``model_type`` it cannot build.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..backends.base import AttentionBackend
from ..plan.fields import regular_file_size
from .verify import VerifyCase, progress_bar

MINIFLEET = "minifleet"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of ``model_dir``, after checking that it is a directory with a
    ``config.json``; ``ValueError`` naming the directory otherwise."""
    d = Path(model_dir)
    if not d.exists():
        raise ValueError(f"model directory {str(model_dir)!r}: no such directory")
    if not d.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r}: not a directory (give the folder itself)")
    if not (d / "config.json").is_file():
        raise ValueError(f"model directory {str(model_dir)!r}: no config.json in it")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model directory {str(model_dir)!r}: no *.safetensors weights in it "
            "(write one with save_pretrained or python -m fastdeploy_paddlefleet.serving.modeldir)"
        )
    for path in files:
        check_safetensors_size(path)
    return files


#: safetensors' own cap on a file's JSON header (its ``MAX_HEADER_SIZE``)
MAX_SAFETENSORS_HEADER = 100_000_000


def check_safetensors_size(path: Path) -> None:
    """Before a tensor is read: ``path`` is a regular file (no FIFO, socket or device) whose 8-byte
    header length fits safetensors' cap and the file; ``ValueError`` naming the file otherwise."""
    import struct

    size = regular_file_size(path, "weights file")
    if size < 8:
        raise ValueError(
            f"weights file {str(path)!r}: not a readable safetensors file: {size} bytes, "
            "shorter than its header"
        )
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    if header > MAX_SAFETENSORS_HEADER or 8 + header > size:
        raise ValueError(
            f"weights file {str(path)!r}: not a readable safetensors file: its header claims {header} "
            f"bytes in a file of {size} (truncated or damaged)"
        )


def tensor_names(files: list[Path]) -> set[str]:
    """Every tensor name in ``files`` (headers only; no tensor is read)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                names.update(f.keys())
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{path}: not a readable safetensors file: {e}") from None
    return names


def _require(names: set[str], wanted: set[str], model_dir: str | Path, strip: str = "") -> None:
    """Refuse a checkpoint that lacks weights the model has (``strip``: an optional name prefix)."""
    missing = sorted(n for n in wanted if n not in names and f"{strip}{n}" not in names)
    if missing:
        raise ValueError(
            f"model directory {str(model_dir)!r}: the checkpoint lacks {len(missing)} of the model's "
            f"{len(wanted)} weights, e.g. {missing[:3]}: not a checkpoint of this config"
        )


def _minifleet_case(
    model_dir: Path, raw: dict[str, Any], files: list[Path], backend: Any, seed: int, progress: bool = False
) -> Any:
    from safetensors.paddle import load_file  # not numpy's: it has no bfloat16

    from ..minifleet import build_minifleet, make_config
    from ..plan import plan_from_config
    from ..plan.weights import check_fits
    from ..serving.weights import assign_weights
    from .fleet_case import fleet_case

    cfg = make_config(raw)
    # two float32 instances and the checkpoint's tensors while they are assigned
    check_fits(cfg, copies=3, dtype="float32", what=f"model directory {str(model_dir)!r}")
    # different seeds: only the checkpoint's weights can make the two agree
    native, paged = build_minifleet(cfg, seed=seed), build_minifleet(cfg, seed=seed + 1)
    _require(tensor_names(files), set(native.state_dict()), model_dir, strip="model.")
    bar = progress_bar(len(files), f"load {model_dir.name}", progress, unit="file")
    for path in files:
        tensors = load_file(str(path))
        for model in (native, paged):
            assign_weights(model, tensors)
        bar.update(1)
    bar.close()
    extras = {"host": "minifleet", "model_dir": str(model_dir), "weights": [p.name for p in files]}
    return fleet_case(f"checkpoint:{model_dir.name}", native, paged, plan_from_config(cfg), backend, extras)


@contextlib.contextmanager
def read_only_view(model_dir: Path) -> Iterator[Path]:
    """A temporary directory of symbolic links to ``model_dir``'s ``*.json`` and ``*.safetensors``
    (nothing a loader generates: writing through a link would change the user's file)."""
    with tempfile.TemporaryDirectory(prefix="fdfleet-checkpoint-") as tmp:
        view = Path(tmp)
        for path in sorted(model_dir.iterdir()):
            if path.is_file() and path.suffix in (".json", ".safetensors"):
                os.symlink(path.resolve(), view / path.name)
        yield view


def _unloaded(a: Any, b: Any) -> list[str]:
    """Names of the non-constant tensors that differ between two loads of one checkpoint made under
    different seeds: what the checkpoint did not hold (left at its random initialisation)."""
    import numpy as np

    sa, sb = a.state_dict(), b.state_dict()
    differ = []
    for name, ta in sa.items():
        x, y = ta.numpy(), sb[name].numpy()
        if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
            differ.append(name)
    return sorted(differ)


def _paddleformers_case(model_dir: Path, arch: str, files: list[Path], backend: Any, seed: int) -> Any:
    import paddle
    from paddleformers.transformers import AutoModelForCausalLM

    from ..plan import plan_from_config
    from ..plan.weights import check_fits
    from .paddleformers_case import (
        WORKAROUNDS,
        ensure_paddlefleet_ops,
        fix_gpt_oss_moe,
        load_arch_config,
        make_case,
    )

    config = load_arch_config(arch, model_dir)
    check_fits(config, copies=2, dtype="float32", what=f"model directory {str(model_dir)!r}")  # two loads
    if arch == "deepseek_v3":
        ensure_paddlefleet_ops()
    tensor_names(files)  # a damaged file is named before PaddleFormers reads it
    models = []
    # PaddleFormers' own loader (its name and layout conversions), twice under different seeds: a
    # tensor the two loads disagree on came from the random initialisation, not the checkpoint.
    # It writes a flex-ckpt metadata file next to the weights it loads: it reads a private view
    # (links to the user's files), so that the checkpoint directory is never written to.
    with read_only_view(model_dir) as view:
        for s in (seed, seed + 1):
            paddle.seed(s)
            cfg = copy.deepcopy(config)
            models.append(AutoModelForCausalLM.from_pretrained(str(view), config=cfg, dtype="float32"))
    native, twin = models
    unloaded = _unloaded(native, twin)
    if unloaded:
        raise ValueError(
            f"model directory {str(model_dir)!r}: the checkpoint lacks {len(unloaded)} of the model's "
            f"weights (left at their random initialisation), e.g. {unloaded[:3]}"
        )
    for model in (native, twin):
        model.eval()
        if arch == "gpt_oss":
            fix_gpt_oss_moe(model)
    extras = {
        "host": "paddleformers",
        "arch": arch,
        "model_dir": str(model_dir),
        "weights": [p.name for p in files],
        "workarounds": WORKAROUNDS.get(arch, []),
    }
    return make_case(f"checkpoint:{model_dir.name}", native, twin, plan_from_config(config), backend, extras)


def build_checkpoint_case(
    model_dir: str | Path,
    backend: str | AttentionBackend = "reference",
    seed: int = 0,
    progress: bool = False,
) -> VerifyCase:
    """A ``VerifyCase`` on the checkpoint in ``model_dir`` (module doc): its real weights, its own
    eager forward against the patched paged path. ``seed`` seeds only what the checkpoint does
    not hold (the patched copy's initial weights, then overwritten). ``progress``: a tqdm bar on
    stderr over the weight files while a minifleet directory loads (PaddleFormers' loader has its own)."""
    from ..plan import load_config, plan_from_config
    from .paddleformers_case import ARCHITECTURES

    files = checkpoint_files(model_dir)
    d = Path(model_dir)
    raw = load_config(d)  # size-capped read; errors name the file
    plan_from_config(raw)  # invalid fields (and a model_type that is not a string) named before a build
    model_type = raw.get("model_type")
    if model_type == MINIFLEET:
        return _minifleet_case(d, raw, files, backend, seed, progress)
    if model_type in ARCHITECTURES:
        return _paddleformers_case(d, model_type, files, backend, seed)
    raise ValueError(
        f"model directory {str(model_dir)!r}: model_type {model_type!r} cannot be built here: --model "
        f"verifies minifleet model directories (python -m fastdeploy_paddlefleet.serving.modeldir) and "
        f"PaddleFormers checkpoints of {', '.join(ARCHITECTURES)}"
    )


__all__ = ["build_checkpoint_case", "check_safetensors_size", "checkpoint_files", "tensor_names"]
