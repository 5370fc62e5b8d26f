"""``fdfleet``: the command-line front end.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``
and ``run(args) -> int``; this module only dispatches, so ``fdfleet plan``
never imports paddle, torch or triton.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

SUBCOMMANDS = ("plan", "verify")


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fdfleet", description="Serve PaddleFleet models in FastDeploy: inspect plans, verify parity."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..envs import log_level

    # paddle warns at import about a compiler cache that only extension builds use
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    try:
        logging.basicConfig(level=log_level(), format="%(levelname)s %(name)s: %(message)s")
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except (CliError, ValueError, TypeError, FileNotFoundError, OSError) as e:
        print(f"fdfleet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
