"""``fdfleet``: the command-line front end.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
and ``run(args) -> int``; this module only dispatches, so ``fdfleet plan``
never imports paddle, torch or triton.

Every bad input ends the same way: one line ``fdfleet: error: ...`` on stderr
naming the flag, field, file or variable, and exit code 2 (argparse's usage
errors included); an unexpected exception (a bug) prints one line and exits
70. Before any command runs (``--version`` included; ``--help`` still prints), every ``FDFLEET_*``
switch is parsed (``envs.check_all``), so a bad value is refused by every command, not
only by the one that reads it. A missing optional dependency names the extra
that brings it.

The process edges, each one line on stderr: Ctrl-C exits 130
(``fdfleet: interrupted``); a stdout that is closed before the command starts
(``fdfleet plan tiny >&-``) exits 2; a reader that closes the pipe early
(``fdfleet plan tiny | head -0``) exits 141 (128 + SIGPIPE, what a shell
reports for a process killed by the signal); a write to stdout that fails
otherwise (a full disk: ``ENOSPC``) exits 74 (``EX_IOERR``), naming stdout and
the error; the same for stderr (nothing can be said then, the exit code tells). One guard in
:func:`main` does this for every command. ``fdfleet --version`` (``--json`` too) prints the package
version. Exit codes: :data:`EXIT_CODES` (``fdfleet --help`` prints them).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from .. import __version__

SUBCOMMANDS = ("plan", "verify", "modeldir", "convert")
#: exit code of an unexpected exception (a bug); bad input exits 2, a failed verify 1
INTERNAL_ERROR = 70
#: Ctrl-C (128 + SIGINT), a reader that closed the pipe (128 + SIGPIPE), a failed write (sysexits EX_IOERR)
INTERRUPTED, BROKEN_PIPE, IO_ERROR = 130, 141, 74
EXIT_CODES = (
    "exit codes: 0 done, 1 verify found a difference, 2 bad input (named on stderr; a bad FDFLEET_* "
    "value, a model too large for memory included), 70 internal error (a bug), 74 a failed write "
    "(stdout or stderr could not be written, e.g. disk full; modeldir or convert could not read or write "
    "their files), "
    "130 interrupted (Ctrl-C), 141 the reader closed the pipe"
)

#: top-level module of an optional dependency -> the extra of this package that installs it
EXTRAS: dict[str, str] = {
    "paddle": "cpu",
    "tqdm": "verify",
    "safetensors": "verify",
    "paddleformers": "paddleformers",
    "triton": "kernels",
    "torch": "torch",
}
#: what to say beside the extra (paddle: beside FastDeploy it comes with paddlepaddle-gpu, never the extra)
EXTRA_NOTES: dict[str, str] = {
    "paddle": "; beside FastDeploy install paddlepaddle-gpu from Paddle's index instead, never the CPU build",
}

logger = logging.getLogger(__name__)


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, exit code ``exit_code`` (2: bad input;
    74 for a failed write, e.g. ``fdfleet modeldir`` on a full disk)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def about(flag: str | None, value: str | None, error: Exception) -> CliError:
    """``error`` as a one-line :class:`CliError` that names the ``flag`` and its ``value`` (a file,
    a preset: ``--config x.json``, or a positional ``SOURCE`` with ``flag`` None) it is about;
    a value the message already names is not repeated."""
    message = " ".join(str(error).split()) or type(error).__name__
    named = value is not None and value in message
    where = " ".join(part for part in (flag, None if named else value) if part)
    return CliError(f"{where}: {message}" if where else message)


class StdoutError(Exception):
    """Writing to stdout or stderr (``stream``) failed for another reason than a closed pipe (a full
    disk: ``ENOSPC``, an I/O error: ``EIO``): exit 74."""

    def __init__(self, error: OSError, stream: str = "stdout"):
        self.stream = stream
        code = errno.errorcode.get(error.errno or 0, "?")
        super().__init__(
            f"cannot write to {stream}: {error.strerror or error} [{code}]; the output is incomplete"
        )


class _Stdout:
    """``sys.stdout`` (or ``sys.stderr``: ``stream``) for the duration of a command: a failed write or
    flush becomes a :class:`StdoutError` naming the stream (a closed stdout pipe stays
    ``BrokenPipeError``; on stderr, where nothing could say so, it is a failed write too)."""

    def __init__(self, raw: Any, stream: str = "stdout"):
        self._raw = raw
        self._stream = stream
        #: the first failure, kept: a caller that swallows it (argparse's help) does not hide it
        self.error: Exception | None = None

    def _guard(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except OSError as e:
            if isinstance(e, BrokenPipeError) and self._stream == "stdout":
                self.error = self.error or e
                raise
            failure = StdoutError(e, self._stream)
            self.error = self.error or failure
            raise failure from e

    def done(self) -> None:
        """Flush, then raise the first failure of this stream, even one its writer swallowed."""
        try:
            self.flush()
        finally:
            if self.error is not None:
                raise self.error

    def write(self, text: str) -> int:
        return self._guard(lambda: self._raw.write(text))

    def flush(self) -> None:
        self._guard(self._raw.flush)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._raw, name)


def _stdout_closed() -> bool:
    """Whether file descriptor 1 was closed before we started (``>&-``): Python then sets
    ``sys.stdout`` to None."""
    if sys.stdout is None:
        return True
    try:
        os.fstat(sys.stdout.fileno())
    except OSError as e:  # io.UnsupportedOperation (captured output, no descriptor) is an OSError too
        return e.errno == errno.EBADF
    except ValueError:  # a closed file object
        return True
    return False


def missing_extra(error: ModuleNotFoundError, what: str) -> CliError | None:
    """A :class:`CliError` naming the extra to install when ``error`` is an optional dependency
    (``None`` for anything else, e.g. a module of this package)."""
    root = (error.name or "").split(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return None
    return CliError(
        f"{what} needs {root!r}, which is not installed: install this package's {extra!r} extra "
        f"(from a source checkout: pip install -e '.[{extra}]'){EXTRA_NOTES.get(root, '')}"
    )


def int_arg(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an int in ``[low, high]`` (argparse names the flag on error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_arg(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bracket = "(" if low_open else "["
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {bracket}{_num(low)}, {_num(high)}], got {text!r}"
            )
        return value

    parse.__name__ = "float"
    return parse


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fdfleet",
        description="Serve PaddleFleet models in FastDeploy: inspect plans, verify parity, "
        "write model directories, convert checkpoints.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="store_true", help="print the package version and exit")
    parser.add_argument(
        "--json",
        dest="version_json",
        action="store_true",
        help="print one JSON object (--version, or the command)",
    )
    # not required: `fdfleet --version` has no command (main names a missing one)
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def version_info() -> dict[str, str]:
    """What ``fdfleet --version`` prints: the distribution name and this package's version."""
    return {"name": "fastdeploy-paddlefleet", "version": __version__}


def _print_version(as_json: bool) -> int:
    info = version_info()
    print(json.dumps(info) if as_json else f"fdfleet ({info['name']}) {info['version']}")
    return 0


def _quiet_stdout() -> None:
    """The reader closed stdout: point it at /dev/null so the interpreter's final flush is silent."""
    _quiet(sys.stdout)


def _quiet(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (a closed pipe, a full disk): what is still
    buffered there is dropped silently at exit instead of failing again ("Exception ignored")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured output): nothing to do
        pass


def _say(line: str) -> bool:
    """Print ``line`` on stderr (the real one); ``False`` when stderr itself cannot be written (then
    it is pointed at /dev/null, so that the interpreter's last flush cannot fail too)."""
    stream = sys.stderr
    raw = getattr(stream, "_raw", stream)
    try:
        print(line, file=raw, flush=True)
        return True
    except OSError:
        _quiet(raw)
        return False


def _load_envs() -> tuple[Any, ValueError | None]:
    """The ``envs`` module and the error its import (or a later parse) raised for a bad value."""
    try:
        from .. import envs
    except ValueError as e:  # the import parses every switch: a bad value raises there
        return None, e
    try:
        envs.check_all()  # again: the environment may have changed since the import (tests)
    except ValueError as e:
        return envs, e
    return envs, None


def main(argv: list[str] | None = None) -> int:
    """Run one ``fdfleet`` command; the exit code (``EXIT_CODES``). Every outcome is one line on
    stderr at most: stdout or stderr that cannot be written (``ENOSPC``, ``EIO``) exits 74, a reader
    that closed the pipe 141, a bad ``FDFLEET_*`` value 2 (``--help`` still prints)."""
    # paddle warns at import about a compiler cache that only extension builds use
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    # torch (the references, the interpreter) warns at import about a GPU-monitoring package
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    if _stdout_closed():
        _say(
            "fdfleet: error: stdout is closed (file descriptor 1): nothing can be printed; "
            "redirect it instead (> FILE or > /dev/null)"
        )
        return 2
    args = None
    raw_stdout, raw_stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stdout(raw_stdout), _Stdout(raw_stderr, "stderr")
    try:
        try:
            # before envs: its import warns about misspelt FDFLEET_* names, in this format
            configured = bool(logging.getLogger().handlers)  # by a host or a test: left as it is
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            envs, env_error = _load_envs()
            if env_error is None and not configured:
                logging.getLogger().setLevel(envs.log_level())
            parser = build_parser()
            args = parser.parse_args(argv)  # --help prints whatever the environment holds
            if env_error is not None:  # every command refuses a bad FDFLEET_* value, --version too
                raise env_error
            if args.version:
                code = _print_version(args.version_json)
            elif args.command is None:
                commands = " or ".join(SUBCOMMANDS)
                parser.error(f"the following arguments are required: command ({commands}), or --version")
            else:
                if args.version_json:  # `fdfleet --json plan tiny` means the command's own --json
                    args.json = True
                code = int(args.func(args) or 0)
        except SystemExit:  # argparse: --help, a usage error; what it printed must reach its reader
            sys.stdout.done()
            sys.stderr.done()
            raise
        sys.stdout.done()
        sys.stderr.done()
        return code
    except BrokenPipeError:  # `fdfleet plan ... | head -0`: the reader went away before the end
        _quiet_stdout()
        _say("fdfleet: stdout was closed by its reader (broken pipe); the output is cut short")
        return BROKEN_PIPE
    except StdoutError as e:  # a full disk, an I/O error, on stdout or stderr
        # what is still buffered would fail again at exit
        _quiet(raw_stdout if e.stream == "stdout" else raw_stderr)
        _say(f"fdfleet: error: {e}")
        return IO_ERROR
    except KeyboardInterrupt:
        return INTERRUPTED if _say("fdfleet: interrupted") else IO_ERROR
    except ModuleNotFoundError as e:
        err = missing_extra(e, f"fdfleet {getattr(args, 'command', '')}".rstrip())
        if err is None:  # a module of this package: a bug
            return _internal_error(e)
        return 2 if _say(f"fdfleet: error: {err}") else IO_ERROR
    except (CliError, ValueError, TypeError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__  # one line
        code = getattr(e, "exit_code", 2) if isinstance(e, CliError) else 2
        return code if _say(f"fdfleet: error: {message}") else IO_ERROR
    except Exception as e:  # a bug, not a bad input
        return _internal_error(e)
    finally:
        sys.stdout, sys.stderr = raw_stdout, raw_stderr


def _internal_error(e: BaseException) -> int:
    """One line for an unexpected exception (a bug); the traceback goes to the debug log."""
    logger.debug("internal error", exc_info=e)
    message = " ".join(str(e).split())
    said = _say(
        f"fdfleet: internal error: {type(e).__name__}: {message} "
        "(FDFLEET_LOG_LEVEL=DEBUG shows the traceback; please report it)"
    )
    return INTERNAL_ERROR if said else IO_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
