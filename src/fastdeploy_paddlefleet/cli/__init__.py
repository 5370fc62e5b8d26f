"""``fdfleet``: the command-line front end.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
and ``run(args) -> int``; this module only dispatches, so ``fdfleet plan``
never imports paddle, torch or triton.

Every bad input ends the same way: one line ``fdfleet: error: ...`` on stderr
naming the flag, field, file or variable, and exit code 2 (argparse's usage
errors included); an unexpected exception (a bug) prints one line and exits
70. Before any command runs, every ``FDFLEET_*`` switch is
parsed (``envs.check_all``), so a bad value is refused by every command, not
only by the one that reads it. A missing optional dependency names the extra
that brings it.

The process edges, each one line on stderr: Ctrl-C exits 130
(``fdfleet: interrupted``); a stdout that is closed before the command starts
(``fdfleet plan tiny >&-``) exits 2; a reader that closes the pipe early
(``fdfleet plan tiny | head -0``) exits 141 (128 + SIGPIPE, what a shell
reports for a process killed by the signal); a write to stdout that fails
otherwise (a full disk: ``ENOSPC``) exits 74 (``EX_IOERR``), naming stdout and
the error. ``fdfleet --version`` (``--json`` too) prints the package version.
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

SUBCOMMANDS = ("plan", "verify")
#: exit code of an unexpected exception (a bug); bad input exits 2, a failed verify 1
INTERNAL_ERROR = 70
#: Ctrl-C (128 + SIGINT), a reader that closed the pipe (128 + SIGPIPE), a failed write (sysexits EX_IOERR)
INTERRUPTED, BROKEN_PIPE, IO_ERROR = 130, 141, 74
EXIT_CODES = (
    "exit codes: 0 done, 1 verify found a difference, 2 bad input (named on stderr), 70 internal error "
    "(a bug), 74 stdout could not be written (e.g. disk full), 130 interrupted (Ctrl-C), 141 the reader "
    "closed the pipe"
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
    """A user-facing error: printed as one line on stderr, exit code 2."""


def about(flag: str | None, value: str | None, error: Exception) -> CliError:
    """``error`` as a one-line :class:`CliError` that names the ``flag`` and its ``value`` (a file,
    a preset: ``--config x.json``, or a positional ``SOURCE`` with ``flag`` None) it is about;
    a value the message already names is not repeated."""
    message = " ".join(str(error).split()) or type(error).__name__
    named = value is not None and value in message
    where = " ".join(part for part in (flag, None if named else value) if part)
    return CliError(f"{where}: {message}" if where else message)


class StdoutError(Exception):
    """Writing to stdout failed for another reason than a closed pipe (a full disk: ``ENOSPC``)."""

    def __init__(self, error: OSError):
        code = errno.errorcode.get(error.errno or 0, "?")
        super().__init__(
            f"cannot write to stdout: {error.strerror or error} [{code}]; the output is incomplete"
        )


class _Stdout:
    """``sys.stdout`` for the duration of a command: a failed write or flush becomes a
    :class:`StdoutError` naming stdout (a closed pipe stays ``BrokenPipeError``)."""

    def __init__(self, raw: Any):
        self._raw = raw

    def _guard(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e) from e

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
        description="Serve PaddleFleet models in FastDeploy: inspect plans, verify parity.",
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
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to redirect
        pass


def main(argv: list[str] | None = None) -> int:
    from ..envs import check_all, log_level

    # paddle warns at import about a compiler cache that only extension builds use
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    # torch (the references, the interpreter) warns at import about a GPU-monitoring package
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    if _stdout_closed():
        print(
            "fdfleet: error: stdout is closed (file descriptor 1): nothing can be printed; "
            "redirect it instead (> FILE or > /dev/null)",
            file=sys.stderr,
        )
        return 2
    args = None
    raw_stdout = sys.stdout
    sys.stdout = _Stdout(raw_stdout)
    try:
        logging.basicConfig(level=log_level(), format="%(levelname)s %(name)s: %(message)s")
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            code = _print_version(args.version_json)
        elif args.command is None:
            parser.error("the following arguments are required: command (plan or verify), or --version")
        else:
            if args.version_json:  # `fdfleet --json plan tiny` means the command's own --json
                args.json = True
            check_all()  # a bad FDFLEET_* value is refused by every command
            code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `fdfleet plan ... | head -0`: the reader went away before the end
        _quiet_stdout()
        print(
            "fdfleet: stdout was closed by its reader (broken pipe); the output is cut short", file=sys.stderr
        )
        return BROKEN_PIPE
    except StdoutError as e:  # a full disk
        _quiet_stdout()  # what is still buffered would fail again at exit
        print(f"fdfleet: error: {e}", file=sys.stderr)
        return IO_ERROR
    except KeyboardInterrupt:
        print("fdfleet: interrupted", file=sys.stderr)
        return INTERRUPTED
    except ModuleNotFoundError as e:
        err = missing_extra(e, f"fdfleet {getattr(args, 'command', '')}".rstrip())
        if err is None:  # a module of this package: a bug
            return _internal_error(e)
        print(f"fdfleet: error: {err}", file=sys.stderr)
        return 2
    except (CliError, ValueError, TypeError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__  # one line
        print(f"fdfleet: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not a bad input
        return _internal_error(e)
    finally:
        sys.stdout = raw_stdout


def _internal_error(e: BaseException) -> int:
    """One line for an unexpected exception (a bug); the traceback goes to the debug log."""
    logger.debug("internal error", exc_info=e)
    message = " ".join(str(e).split())
    print(
        f"fdfleet: internal error: {type(e).__name__}: {message} "
        "(FDFLEET_LOG_LEVEL=DEBUG shows the traceback; please report it)",
        file=sys.stderr,
    )
    return INTERNAL_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
