"""Where a benchmark script writes, and how: shared by ``headwise_sim.py`` and ``attention.py``.

* The committed results (``benchmarks/results/``) are written only when ``--out`` names a path there,
  and never by a smoke run; without ``--out`` a run writes into a fresh temporary directory and says
  where.
* An ``--out`` / ``--plot`` whose extension does not match what is written (``results.png`` for
  JSON) is refused, naming the flag and the path.
* Writes are all or nothing: :func:`replacing` hands out a temporary sibling of the target and
  renames it over the target only when the block finishes; a failure (an exception, Ctrl-C) removes
  it and leaves the previous file as it was. Files are ``0644``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
FILE_MODE = 0o644


def in_results(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies in the committed results directory."""
    resolved = Path(path).resolve()
    return resolved == RESULTS_DIR or RESULTS_DIR in resolved.parents


def check_suffix(path: Path, suffixes: tuple[str, ...], flag: str, what: str) -> None:
    """``ValueError`` unless ``path`` ends in one of ``suffixes`` (case-insensitive)."""
    if path.suffix.lower() not in suffixes:
        got = path.suffix or "no extension"
        raise ValueError(
            f"{flag} {str(path)!r} has {got}, but this file is {what} ({', '.join(suffixes)}); "
            "refusing to write it"
        )


def output_path(
    out: str | os.PathLike | None,
    *,
    name: str,
    suffixes: tuple[str, ...],
    what: str,
    smoke: bool,
    flag: str = "--out",
) -> Path:
    """The data file a run writes: ``out`` as given (extension checked; never the committed results
    from a smoke run), else ``name`` in a fresh temporary directory. ``ValueError`` naming ``flag``."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="fdfleet-bench-")) / name
    if not str(os.fspath(out)).strip():
        raise ValueError(f"{flag} must name a file, got {str(out)!r}")
    path = Path(out)
    check_suffix(path, suffixes, flag, what)
    if smoke and in_results(path):
        raise ValueError(
            f"{flag} {str(path)!r} is in the committed results ({RESULTS_DIR}): "
            "a smoke run never writes there"
        )
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; name a file")
    return path


def plot_path(plot: str | os.PathLike | None, out: Path, *, smoke: bool, flag: str = "--plot") -> Path:
    """The plot a run draws: ``plot`` as given (checked like :func:`output_path`), else ``out`` with
    ``.png``."""
    if plot is None:
        return out.with_suffix(".png")
    return output_path(plot, name="", suffixes=PLOT_SUFFIXES, what="a plot", smoke=smoke, flag=flag)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (same extension, so plotting libraries pick the format);
    on success it becomes ``path`` (mode ``0644``, one rename), on any failure it is removed and
    ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.tmp-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def parse_tags(items: list[str]) -> dict:
    """``--tag KEY=VALUE`` pairs as a dict (digits become ints): what a script adds to every record it
    writes. ``ValueError`` naming a pair without ``=`` or key."""
    tags: dict = {}
    for t in items:
        key, sep, val = t.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag wants KEY=VALUE, got {t!r}")
        tags[key] = int(val) if val.isdigit() else val
    return tags


def choose(csv: str, known, what: str) -> list[str]:
    """The names of a comma list (``--cases a,b``), each one of ``known``; ``ValueError`` naming the unknown
    ones and the known ones."""
    names = [n for n in csv.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown {what} {bad} (known: {sorted(known)})")
    return names
