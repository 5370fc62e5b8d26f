"""Where a benchmark script writes, and how: shared by every script in ``benchmarks/`` and ``probes/``.

* The committed results (``benchmarks/results/``) are written only when ``--out`` names a path there,
  and never by a smoke run; without ``--out`` a run writes into a fresh temporary directory and says
  where.
* An ``--out`` / ``--plot`` whose extension does not match what is written (``results.png`` for
  JSON) is refused, naming the flag and the path.
* **A script replaces only what it made.** An existing file is replaced (or appended to) only when it
  is this script's own output: a JSON / JSON-lines file whose (first) record carries
  ``"fdfleet-benchmark": "<script>"`` (:func:`mark`; text files: a first line ``<comment>
  fdfleet-benchmark: <script>``), a file in ``benchmarks/results/``, or a plot beside such a data
  file; else the user passes ``--force``. Otherwise :class:`Refused` (the script exits 2 naming the
  path and ``--force``) before any work (:func:`claim`), and again just before the rename: a file
  that appeared or changed during the run is not clobbered either.
* Writes are all or nothing: :func:`replacing` hands out a temporary sibling of the target and
  renames it over the target only when the block finishes; a failure (an exception, Ctrl-C) removes
  it and leaves the previous file as it was. A symlink is written through (its target gets the
  content, the link stays a link). Files are ``0644``.
* Files a script reads back (``--plot-only``, ``--merge``, ``--replot``, ...) go through
  :func:`read_json` / :func:`read_jsonl`: a missing file, a directory, an empty file or one that is
  not JSON (lines) of the expected shape is :class:`Refused` in one line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
FILE_MODE = 0o644
#: the key (JSON) or first-line tag (text) that marks a file as a benchmark script's own output
MARK = "fdfleet-benchmark"
#: the most of a file :func:`own_output` reads to find the mark in a whole-file JSON document
_MARK_READ_LIMIT = 256 * 2**20


class Refused(ValueError):
    """A path a script will not write or cannot read: its ``main`` prints it on one line and exits 2."""


def fail(e: BaseException) -> int:
    """Print ``e`` as the script's one error line and return the exit status 2."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def give_up(fh: RecordFile | None, path: str | os.PathLike | None, existed: bool, problem: str) -> int:
    """Close ``fh`` (from :func:`open_records` on ``path``) unused, remove the file when this run made
    it (``existed`` false and still empty), print ``problem`` as the one error line: exit status 2."""
    if fh is not None:
        fh.close()
        if not existed and path is not None and os.path.isfile(path) and os.path.getsize(path) == 0:
            os.remove(path)
    print(f"error: {problem}", file=sys.stderr)
    return 2


def device_problem(script: str, cpu_flag: str | None = None) -> str | None:
    """What keeps ``script`` (a GPU benchmark) from running here, in one line naming what it needs,
    or ``None``. ``cpu_flag``: the flag that runs it on a CPU under Triton's interpreter
    (``TRITON_INTERPRET=1``, read when the kernels are decorated, so it must be set before the start);
    pass it only when that flag is given."""
    try:
        import torch
    except ImportError:
        return f"{script} needs torch and triton: pip install -e '.[bench]'"
    if torch.cuda.is_available():
        return None
    if cpu_flag is None:
        return f"{script} needs a CUDA GPU (torch sees none)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"{script} {cpu_flag} without a CUDA GPU needs Triton's CPU interpreter: "
            f"run it as TRITON_INTERPRET=1 python {script} {cpu_flag}"
        )
    return None


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


def mark(record: dict, script: str) -> dict:
    """``record`` with this script's mark first: what makes the file it goes into the script's own."""
    return {MARK: script, **record}


def mark_line(script: str, comment: str = "//") -> str:
    """The first line of a text file a script writes (e.g. a ``.sass`` dump): its mark."""
    return f"{comment} {MARK}: {script}\n"


def _carries_mark(value: Any, script: str) -> bool:
    if isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, dict) and value.get(MARK) == script


def own_output(path: str | os.PathLike, script: str) -> bool:
    """Whether ``path`` is ``script``'s own output: in ``benchmarks/results/``, or its first line is a
    JSON record (or its whole text a JSON object / list of objects) carrying ``MARK: script``, or its
    first line is a text mark (:func:`mark_line`)."""
    if in_results(path):
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline(1 << 20)
            try:
                if _carries_mark(json.loads(first), script):
                    return True
            except ValueError:
                pass
            if first.rstrip("\n").endswith(f"{MARK}: {script}") and len(first) < 200:
                return True
            if os.fstat(f.fileno()).st_size > _MARK_READ_LIMIT:
                return False
            f.seek(0)
            return _carries_mark(json.loads(f.read()), script)
    except (OSError, ValueError):
        return False


def _identity(path: Path) -> tuple | None:
    """What tells one file from another at ``path`` (following links): ``None`` if nothing is there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class Claim:
    """A path a script may write (:func:`claim`): ``path`` as given, ``target`` the file the bytes go
    to (a symlink's target), and the identity of what was there when it was checked."""

    path: Path
    target: Path
    script: str
    force: bool
    flag: str
    seen: tuple | None

    def refusal(self, why: str) -> Refused:
        return Refused(
            f"{self.flag} {str(self.path)!r} {why} and is not {self.script}'s output (no "
            f'"{MARK}": "{self.script}" mark, not in benchmarks/results/); pass --force to replace it'
        )

    def check_again(self) -> None:
        """Just before the rename: what is at the target now is what was approved, or this script's."""
        now = _identity(self.target)
        if self.force or now is None or now == self.seen or own_output(self.target, self.script):
            return
        raise self.refusal("appeared or changed during the run")


def claim(
    path: str | os.PathLike,
    *,
    script: str,
    force: bool = False,
    flag: str = "--out",
    beside: str | os.PathLike | None = None,
) -> Claim:
    """Check, before any work, that ``script`` may replace ``path``: nothing is there, or it is the
    script's own output (:func:`own_output`; a plot: also when ``beside``, the data file it is drawn
    from, is), or ``force``. :class:`Refused` naming ``flag``, the path and ``--force`` otherwise, or
    when ``path`` is a directory."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.is_dir():
        raise Refused(f"{flag} {str(path)!r} is a directory; name a file")
    seen = _identity(target)
    c = Claim(path, target, script, force, flag, seen)
    if seen is None or force or own_output(target, script):
        return c
    if beside is not None and Path(beside).exists() and own_output(beside, script):
        return c
    raise c.refusal("exists")


@contextlib.contextmanager
def replacing(c: Claim) -> Iterator[Path]:
    """Yield a temporary sibling of ``c.target`` (same extension, so plotting libraries pick the
    format); on success it becomes the target (mode ``0644``, one rename; a symlink given as the path
    stays a link to it) after :meth:`Claim.check_again`; on any failure it is removed and the target
    is untouched."""
    target = c.target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.tmp-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, FILE_MODE)
        c.check_again()
        if _identity(target) is None:
            try:  # nothing there: create without clobbering one that appears at this very moment
                os.link(tmp, target)
            except FileExistsError:
                c.check_again()
            except OSError:  # no hard links here: the rename below
                pass
            else:
                os.unlink(tmp)
                return
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class RecordFile:
    """JSON lines into an open text file, each record with the script's mark (:func:`mark`)."""

    def __init__(self, fh: TextIO, script: str) -> None:
        self.fh, self.script = fh, script

    def record(self, rec: dict) -> None:
        self.fh.write(json.dumps(mark(rec, self.script)) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def open_records(
    path: str | os.PathLike | None, *, script: str, force: bool = False, flag: str = "--out"
) -> RecordFile | None:
    """A :class:`RecordFile` appending to ``path`` (``None``: no file). An existing file must be
    ``script``'s own output (an empty one is not), else ``force``: :class:`Refused` naming the path and
    ``--force``, before any work. A symlink is appended through."""
    if path is None:
        return None
    c = claim(path, script=script, force=force, flag=flag)
    if c.seen is not None and c.seen[2] == 0 and not force:  # an empty file: the user's, not ours
        raise c.refusal("exists")
    c.target.parent.mkdir(parents=True, exist_ok=True)
    return RecordFile(open(c.target, "a", encoding="utf-8"), script)  # noqa: SIM115 - the caller closes


def force_help(what: str) -> str:
    """The ``--force`` help line: what it lets the script replace."""
    return (
        f"replace (or append to) {what} even when it is not this script's output (no "
        f'"{MARK}" mark of this script, not in benchmarks/results/); without it such a file is '
        "refused (exit 2) and left as it is"
    )


# ---- files a script reads back -------------------------------------------------------------------


def _read_text(path: str | os.PathLike, flag: str) -> str:
    p = Path(path)
    if not p.exists():
        raise Refused(f"{flag} {str(p)!r}: no such file")
    if p.is_dir():
        raise Refused(f"{flag} {str(p)!r} is a directory, not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Refused(f"{flag} {str(p)!r} cannot be read ({type(e).__name__}: {e})") from None
    if not text.strip():
        raise Refused(f"{flag} {str(p)!r} is empty")
    return text


def _shape(value: Any, want: type, keys: tuple[str, ...]) -> str | None:
    """What is wrong with ``value`` against ``want`` (dict or list of dicts) and its ``keys``."""
    if not isinstance(value, want):
        return f"expected a JSON {'object' if want is dict else 'list'}, got {type(value).__name__}"
    items = [value] if want is dict else value
    for i, item in enumerate(items):
        where = "" if want is dict else f"item {i}: "
        if not isinstance(item, dict):
            return f"{where}expected an object, got {type(item).__name__}"
        missing = [k for k in keys if k not in item]
        if missing:
            return f"{where}missing key(s) {', '.join(missing)}"
    return None


def read_json(
    path: str | os.PathLike,
    flag: str,
    *,
    want: type = dict,
    keys: tuple[str, ...] = (),
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """The JSON document ``path`` (an object, or with ``want=list`` a list of objects, each with
    ``keys``); ``check(value)`` may name anything else wrong with it. :class:`Refused` in one line
    naming ``flag``, the file and what is wrong."""
    text = _read_text(path, flag)
    try:
        value = json.loads(text)
    except ValueError as e:
        raise Refused(f"{flag} {str(path)!r} is not JSON ({e})") from None
    why = _shape(value, want, keys) or (check(value) if check is not None else None)
    if why:
        raise Refused(f"{flag} {str(path)!r} is not what this script writes: {why}")
    return value


def read_jsonl(path: str | os.PathLike, flag: str, *, keys: tuple[str, ...] = ()) -> list[dict]:
    """The JSON-lines file ``path``: one object per non-blank line, each with ``keys``.
    :class:`Refused` in one line naming ``flag``, the file, and the first bad line."""
    records = []
    for n, line in enumerate(_read_text(path, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise Refused(f"{flag} {str(path)!r} line {n} is not JSON ({e})") from None
        why = _shape(rec, dict, keys)
        if why:
            raise Refused(f"{flag} {str(path)!r} line {n} is not what this script writes: {why}")
        records.append(rec)
    return records


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
