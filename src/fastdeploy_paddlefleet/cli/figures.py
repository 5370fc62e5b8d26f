"""The ``fdfleet plan`` figures quoted in README and the docs, generated from the plan's own functions
(stdlib only).

Every table or sentence of plan figures in ``README.md``, ``docs/kv_recycling.md`` and
``docs/plan.md`` sits between ``<!-- figures:NAME -->`` and ``<!-- /figures -->`` and is the output of
:data:`BLOCKS` ``[NAME]``, which calls what ``fdfleet plan`` calls (``pools_for``, the FastDeploy
flags) at the settings the block prints beside its figures (:class:`Settings`: memory, context,
block size, dtype, batched tokens, recycling mode). So a gain quoted anywhere is the CLI's::

    python -m fastdeploy_paddlefleet.cli.figures --check   # exit 1 naming each stale block
    python -m fastdeploy_paddlefleet.cli.figures --write   # rewrite the blocks in place

``tests/test_plan_figures.py`` runs the check, and compares each figure with ``fdfleet plan --json``
run with the printed settings.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..serving.kv_recycling.report import PoolsReport, pools_for

#: (name in the docs, preset) of the models every figure covers
MODELS: tuple[tuple[str, str], ...] = (
    ("gpt-oss-20b", "gpt-oss-20b"),
    ("Gemma-3-27B", "gemma3-27b"),
    ("MiMo-V2-Flash-like", "mimo-v2-flash-like"),
    ("ERNIE-4.5-21B-A3B head-wise", "ernie-4.5-21b-a3b-headwise"),
)
#: the files whose blocks are generated, relative to the repository root
FILES: tuple[str, ...] = ("README.md", "docs/kv_recycling.md", "docs/plan.md")
BLOCK_RE = re.compile(r"<!-- figures:([a-z0-9-]+) -->(.*?)<!-- /figures -->", re.S)


@dataclass(frozen=True)
class Settings:
    """What ``fdfleet plan`` is run with for a block's figures (its defaults are the CLI's)."""

    contexts: tuple[int, ...] = (8192,)
    memory_gib: float = 40.0
    block_size: int = 64
    dtype: str = "bf16"
    max_num_batched_tokens: int = 8192
    kv_cache_quant: str | None = None
    recycle: str = "auto"

    def argv(self, preset: str = "MODEL") -> list[str]:
        """``fdfleet plan`` arguments giving these figures for ``preset``."""
        out = [
            preset,
            "--memory-gib",
            f"{self.memory_gib:g}",
            "--block-size",
            str(self.block_size),
            "--dtype",
            self.dtype,
            "--context",
            ",".join(str(c) for c in self.contexts),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
        ]
        if self.kv_cache_quant is not None:
            out += ["--kv-cache-quant", self.kv_cache_quant]
        return out

    def command(self) -> str:
        return f"FDFLEET_KV_RECYCLE={self.recycle} fdfleet plan " + " ".join(self.argv())


def report(preset: str, s: Settings) -> PoolsReport:
    """``fdfleet plan``'s window recycling report for ``preset`` at ``s`` (``ValueError`` when there
    is none: every model here slides)."""
    r = pools_for(
        preset,
        1,
        s.block_size,
        s.dtype,
        s.memory_gib,
        s.contexts,
        max_num_batched_tokens=s.max_num_batched_tokens,
        kv_cache_quant=s.kv_cache_quant,
    )
    if isinstance(r, str):
        raise ValueError(f"{preset} at {s.command()}: no recycling report: {r}")
    return r


def ratio(recycling: int, fastdeploy: int) -> str:
    """``x1.91`` as ``fdfleet plan``'s report prints it; ``-`` when FastDeploy holds none."""
    return "-" if not fastdeploy else f"x{recycling / fastdeploy:.2f}"


MEMORY = Settings(contexts=(256, 2048, 8192, 32768, 131072))
GAIN = Settings()
QUANT = replace(GAIN, kv_cache_quant="block_wise_fp8")


def settings_line(*settings: Settings) -> str:
    return "Settings (`fdfleet plan`'s figures): " + "; ".join(f"`{s.command()}`" for s in settings) + "."


def memory_table() -> str:
    """docs/kv_recycling.md: FastDeploy's max concurrent requests beside recycling's per length."""
    s = MEMORY
    lines = [
        settings_line(s),
        "",
        "| model | FastDeploy blocks | " + " | ".join(str(c) for c in s.contexts) + " |",
        "| --- | --- | " + " | ".join("---" for _ in s.contexts) + " |",
    ]
    for name, preset in MODELS:
        r = report(preset, s)
        cells = []
        for row in r.rows:
            cell = f"{row.fastdeploy_requests} / {row.recycling_requests}"
            if row.context == 8192:
                cell += f" ({ratio(row.recycling_requests, row.fastdeploy_requests)})"
            cells.append(cell)
        lines.append(f"| {name} (`{preset}`) | {r.fastdeploy_num_blocks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quant_table() -> str:
    """docs/kv_recycling.md: bf16 against block_wise_fp8 at 8192 tokens."""
    lines = [
        settings_line(GAIN, QUANT),
        "",
        "| model | FastDeploy bf16 / fp8 | recycling bf16 / fp8 "
        "| FastDeploy blocks bf16 / fp8 (its own count) |",
        "| --- | --- | --- | --- |",
    ]
    for name, preset in MODELS:
        b, q = report(preset, GAIN), report(preset, QUANT)
        (rb,), (rq,) = b.rows, q.rows
        fd = f"{rb.fastdeploy_requests} / {rq.fastdeploy_requests} "
        fd += f"({ratio(rq.fastdeploy_requests, rb.fastdeploy_requests)})"
        rec = f"{rb.recycling_requests} / {rq.recycling_requests} "
        rec += f"({ratio(rq.recycling_requests, rb.recycling_requests)})"
        blocks = f"{b.fastdeploy_num_blocks} / {q.fastdeploy_num_blocks} ({q.fastdeploy_claimed_num_blocks})"
        lines.append(f"| {name} (`{preset}`) | {fd} | {rec} | {blocks} |")
    return "\n".join(lines)


def gains() -> list[tuple[str, str]]:
    """``(name, x1.91)``: recycling's gain at :data:`GAIN` per model."""
    out = []
    for name, preset in MODELS:
        (row,) = report(preset, GAIN).rows
        out.append((name, ratio(row.recycling_requests, row.fastdeploy_requests)))
    return out


def readme_gains() -> str:
    """README's one sentence of gains (inline)."""
    what = ", ".join(f"{name} {g}" for name, g in gains())
    return (
        f"at 8k {what} max concurrent requests against FastDeploy's accounting "
        f"(`fdfleet plan`: {GAIN.memory_gib:g} GiB per rank, block {GAIN.block_size}, {GAIN.dtype}, "
        f"{GAIN.max_num_batched_tokens} batched tokens)"
    )


def readme_quant() -> str:
    """README's range of block_wise_fp8 gains over bf16 (FastDeploy's and recycling's, inline)."""
    values = []
    for _, preset in MODELS:
        (rb,), (rq,) = report(preset, GAIN).rows, report(preset, QUANT).rows
        values += [
            rq.fastdeploy_requests / rb.fastdeploy_requests,
            rq.recycling_requests / rb.recycling_requests,
        ]
    return (
        f"at {GAIN.memory_gib:g} GiB / 8k context it serves x{min(values):.2f} to x{max(values):.2f} the "
        "requests of bf16 (FastDeploy's accounting and recycling's)"
    )


def plan_table() -> str:
    """docs/plan.md: per model, the gain and the FastDeploy flags ``fdfleet plan`` prints."""
    from .plan import fastdeploy_flags_for_preset

    s = GAIN
    lines = [
        settings_line(s),
        "",
        "| model | FastDeploy / recycling | `--num-gpu-blocks-override` | `--max-num-seqs` |",
        "| --- | --- | --- | --- |",
    ]
    for name, preset in MODELS:
        (row,) = report(preset, s).rows
        f = fastdeploy_flags_for_preset(preset, s)
        gain = f"{row.fastdeploy_requests} / {row.recycling_requests} "
        gain += f"({ratio(row.recycling_requests, row.fastdeploy_requests)})"
        lines.append(f"| {name} (`{preset}`) | {gain} | {f.num_gpu_blocks_override} | {f.max_num_seqs} |")
    return "\n".join(lines)


#: every generated block, by the name its markers carry
BLOCKS: dict[str, Callable[[], str]] = {
    "memory": memory_table,
    "quant": quant_table,
    "readme-gains": readme_gains,
    "readme-quant": readme_quant,
    "plan-table": plan_table,
}


def _body(name: str, text: str) -> str:
    """A block's text between its markers: a table on lines of its own, a phrase inline."""
    out = BLOCKS[name]()
    return f"\n{out}\n" if text.startswith("\n") else out


def render(text: str) -> str:
    """``text`` with every figures block regenerated (``ValueError`` naming an unknown block)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in BLOCKS:
            raise ValueError(f"figures block {name!r}: unknown; expected one of {', '.join(BLOCKS)}")
        return f"<!-- figures:{name} -->{_body(name, m.group(2))}<!-- /figures -->"

    return BLOCK_RE.sub(sub, text)


def stale(root: Path) -> list[str]:
    """``file: block`` for every block whose text differs from what the plan gives now."""
    out = []
    for rel in FILES:
        text = (root / rel).read_text(encoding="utf-8")
        for m in BLOCK_RE.finditer(text):
            if m.group(1) not in BLOCKS or m.group(2) != _body(m.group(1), m.group(2)):
                out.append(f"{rel}: {m.group(1)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check or rewrite the fdfleet plan figures in README and docs.")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: .)")
    p.add_argument("--write", action="store_true", help="rewrite the blocks (default: check)")
    p.add_argument("--check", action="store_true", help="exit 1 naming each stale block (the default)")
    args = p.parse_args(argv)
    if args.write:
        for rel in FILES:
            path = args.root / rel
            text = path.read_text(encoding="utf-8")
            new = render(text)
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"rewrote {rel}")
        return 0
    bad = stale(args.root)
    for line in bad:
        print(f"stale: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["BLOCKS", "MODELS", "Settings", "main", "render", "stale"]
