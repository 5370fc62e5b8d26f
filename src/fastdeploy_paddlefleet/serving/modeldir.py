"""Write an embedded minifleet preset as a model directory FastDeploy can serve.

FastDeploy reads a model directory's ``config.json`` itself (``ModelConfig``: it
requires a ``dtype`` or ``torch_dtype`` field, takes ``architectures`` for the
registry lookup) and its v1 loader streams the weights of ``*.safetensors`` files
into ``model.load_weights``. A preset JSON has neither, so::

    fdfleet modeldir tiny /tmp/tiny --dtype float32 [--seed 0] [--json] [--force]

(``python -m fastdeploy_paddlefleet.serving.modeldir ...`` runs the same command)

writes ``config.json`` (the preset plus ``dtype``, ``seed``, ``torch_dtype`` absent,
FastDeploy's ``max_model_len``-related ``max_position_embeddings`` kept) and
``model.safetensors`` (the minifleet weights for ``seed``; names are the model's own,
as ``PaddleFleetForCausalLM.set_state_dict`` takes them). Only minifleet presets
(``tiny``, ``tiny-mla``) can be written: the others describe real models without weights.

All or nothing, and nothing deleted that this did not write: the files are written into a temporary
sibling directory (``.<name>.tmp-*``) and moved into place only when complete, each under a name
that must still be free (a hard link, which fails on an existing name): a target that exists and is
not empty is refused, also when it became non-empty during the write, and then left as it was.
``--force`` (``force=True``) replaces only this writer's own files (``config.json``,
``model.safetensors``) in a non-empty directory and keeps every other file there; it refuses the
current directory, the home directory and a filesystem root. A symbolic link to a directory is
written through (the link stays). Files ``0644``. A failure (a full disk, Ctrl-C) leaves the target
as it was, removes the temporary directory and names the path: a failed write (any ``OSError``,
safetensors' own ``SafetensorError``) raises :class:`ModelDirWriteError` (an ``OSError``; the CLI exits
74), a refused target ``ValueError`` (exit 2); Ctrl-C exits 130 with one line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
FILE_MODE = 0o644
DIR_MODE = 0o755


#: the files this writer makes (all ``--force`` replaces)
OURS = ("config.json", "model.safetensors")


class ModelDirWriteError(OSError):
    """Writing a model directory failed (a full disk, an I/O error, safetensors' own error); the
    target was left as it was. ``errno`` is the cause's (``None`` when it had none); the message names
    the path and the cause."""

    def __init__(self, path: Path, cause: BaseException, doing: str = "writing"):
        why = getattr(cause, "strerror", None) or " ".join(str(cause).split()) or type(cause).__name__
        self.message = f"{doing} {str(path)!r} failed ({why}); the path was left as it was"
        super().__init__(getattr(cause, "errno", None), self.message)
        self.path = str(path)

    def __str__(self) -> str:
        return self.message


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: ``OSError``, and safetensors' ``SafetensorError`` (not an OSError)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # an older safetensors: its error type lives elsewhere or not at all
        return (OSError,)
    return (OSError, SafetensorError)


def check_target(path: str | os.PathLike, force: bool, ours: str = " and ".join(OURS)) -> Path:
    """The checked target: a non-empty path that is no file and, unless ``force``, no non-empty
    directory; with ``force`` not the current directory, the home directory or a filesystem root. A
    symbolic link is followed (written through). ``ValueError`` naming it (and ``ours``, what
    ``--force`` would replace)."""
    if path is None or not str(os.fspath(path)).strip():
        raise ValueError(f"the model directory path must name a directory, got {path!r}")
    try:
        out = Path(os.path.abspath(path))  # "." and "x/.." get a real name and parent
        if out.is_symlink():
            out = Path(os.path.realpath(out))  # write through the link, never replace it
    except OSError as e:  # a relative path in a working directory that was removed
        raise ValueError(f"cannot resolve the model directory {str(path)!r}: {e}") from e
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is not a directory; refusing to replace it")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(
                f"{_not_empty(out)}; nothing was written: pass --force (force=True) to replace "
                f"{ours} there (other files are kept)"
            )
        real = out.resolve()
        for what, place in (("the current directory", Path.cwd()), ("the home directory", Path.home())):
            if real == place.resolve():
                raise ValueError(f"{str(out)!r} is {what}: --force refuses it; name a directory of its own")
        if real.parent == real:
            raise ValueError(f"{str(out)!r} is a filesystem root: --force refuses it")
    return out


def _not_empty(out: Path) -> str:
    names = sorted(p.name for p in out.iterdir())
    return f"{str(out)!r} is not empty ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"


def _write_files(tmp: Path, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _place_new(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` only if ``dst`` is free: a hard link fails on an existing name (a rename
    would replace it); where links are not supported, a rename after an existence check."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:
        if dst.exists() or dst.is_symlink():
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from None
        src.rename(dst)
        return
    src.unlink()


def _swap_in(tmp: Path, out: Path, force: bool) -> None:
    """Move the complete ``tmp``'s files into ``out`` (created if absent; an empty directory stays).

    * without ``force``: every file under a name that must still be free; a name taken meanwhile
      (``out`` became non-empty during the write) takes the moved ones out again and refuses, naming
      ``out``: nothing there is touched;
    * with ``force``: this writer's files replace their namesakes (moved aside first, put back if a
      move fails); every other file of ``out`` stays.
    """
    created = not out.exists()
    out.mkdir(exist_ok=True)
    names = sorted(f.name for f in tmp.iterdir())
    if not force:
        if any(out.iterdir()):
            raise ValueError(f"{_not_empty(out)}: it filled up during the write; nothing was written there")
        moved: list[Path] = []
        try:
            for name in names:
                _place_new(tmp / name, out / name)
                moved.append(out / name)
        except FileExistsError:
            for f in moved:
                f.unlink(missing_ok=True)  # only what this write put there
            raise ValueError(
                f"{_not_empty(out)}: it filled up during the write; nothing was written there"
            ) from None
        except BaseException:
            for f in moved:
                f.unlink(missing_ok=True)
            if created:
                _remove_empty([out])
            raise
        tmp.rmdir()
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    set_aside: list[str] = []
    placed: list[str] = []
    try:
        for name in names:
            if (out / name).exists() or (out / name).is_symlink():
                (out / name).rename(aside / name)
                set_aside.append(name)
            (tmp / name).rename(out / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            (out / name).unlink(missing_ok=True)
        for name in set_aside:
            (aside / name).rename(out / name)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    tmp.rmdir()


def write_model_dir(
    preset: str | dict[str, Any],
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a minifleet preset (name or dict) to ``path``.

    ``path`` may not exist or be empty (also when the write ends: a directory that filled up meanwhile
    is refused and left as it is); with ``force`` this writer's two files replace theirs in a
    non-empty directory, once complete, and every other file stays (module docstring). Any failure
    leaves ``path`` as it was (``OSError`` or ``ValueError`` naming it).
    """
    import numpy as np

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
    out = check_target(path, force)
    config.pop("_comment", None)
    config.pop("torch_dtype", None)  # FastDeploy refuses a config with both
    config.update(dtype=dtype, seed=seed)
    model = build_minifleet(config, seed=seed, dtype="float32")
    tensors = {}
    for name, value in model.state_dict().items():
        array = value.numpy()
        tensors[name] = array.astype(np.float32) if dtype == "float32" else array  # bf16: loader casts
    return write_dir(out, lambda tmp: _write_files(tmp, config, tensors), force=force)


def write_dir(out: Path, fill: Callable[[Path], None], *, force: bool = False) -> Path:
    """All or nothing: ``fill(tmp)`` writes the files into a temporary sibling of ``out`` (mode
    ``0755``), which are then moved into ``out`` by :func:`_swap_in` (``force``: namesakes replaced,
    every other file kept) and set to ``0644``. ``out`` is a :func:`check_target` result. Any
    failure removes the sibling and the parents this created, leaves ``out`` as it was and is
    re-raised; a failed write (``OSError``, safetensors' error) as :class:`ModelDirWriteError`
    naming ``out``."""
    made = _missing_parents(out)  # created here, removed again if the write fails
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        _remove_empty(made)
        raise ModelDirWriteError(out, e, doing="creating the model directory") from e
    failed = _write_errors()
    try:
        tmp.chmod(DIR_MODE)
        fill(tmp)
        for f in tmp.iterdir():
            f.chmod(FILE_MODE)
        _swap_in(tmp, out, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        if isinstance(e, failed):
            raise ModelDirWriteError(out, e) from e
        raise
    return out


def _missing_parents(out: Path) -> list[Path]:
    """``out``'s ancestors that do not exist yet, nearest first."""
    missing = []
    for parent in out.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for d in dirs:  # nearest first: each is empty once its child is gone
        try:
            d.rmdir()
        except OSError:
            return


def main(argv: list[str] | None = None) -> int:
    """``python -m fastdeploy_paddlefleet.serving.modeldir ARGS``: ``fdfleet modeldir ARGS`` (the CLI's
    exit codes and its guard of stdout and stderr)."""
    from ..cli import main as cli_main

    return cli_main(["modeldir", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
