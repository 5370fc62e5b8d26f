"""``python -m fastdeploy_paddlefleet.convert ARGS``: ``fdfleet convert ARGS`` (the CLI's exit codes
and its guard of stdout and stderr)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from ..cli import main as cli_main

    return cli_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
