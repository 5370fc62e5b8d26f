"""One gain figure per model everywhere (issue 33): every plan figure in README and the docs is what
``fdfleet plan --json`` gives at the settings printed beside it.

The figures sit in ``<!-- figures:NAME -->`` blocks (``cli/figures.py`` writes them). These tests read
the files as written, run ``fdfleet plan`` with each block's printed settings and compare every
number; and they check that a figure edited by hand is caught.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from fastdeploy_paddlefleet.cli import figures, main

ROOT = Path(__file__).resolve().parents[1]


def block(rel: str, name: str) -> str:
    text = (ROOT / rel).read_text(encoding="utf-8")
    found = [m.group(2) for m in figures.BLOCK_RE.finditer(text) if m.group(1) == name]
    assert len(found) == 1, f"{rel}: expected one figures:{name} block, found {len(found)}"
    return found[0]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """``(FDFLEET_KV_RECYCLE value, fdfleet plan args after MODEL)`` of each command on the settings
    line."""
    line = next(x for x in text.splitlines() if x.startswith("Settings"))
    out = []
    for cmd in re.findall(r"`(FDFLEET_KV_RECYCLE=[^`]+)`", line):
        words = shlex.split(cmd)
        assert words[0].startswith("FDFLEET_KV_RECYCLE=") and words[1:4] == ["fdfleet", "plan", "MODEL"]
        out.append((words[0].split("=", 1)[1], words[4:]))
    return out


def rows(text: str) -> list[list[str]]:
    """The table's body rows as cells (header and rule left out)."""
    lines = [x for x in text.splitlines() if x.startswith("|")]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines[2:]]


def preset_of(cell: str) -> str:
    (preset,) = re.findall(r"`([^`]+)`", cell)
    return preset


def cli(capsys, monkeypatch, recycle: str, preset: str, args: list[str]) -> dict:
    monkeypatch.setenv("FDFLEET_KV_RECYCLE", recycle)
    assert main(["plan", preset, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def pair(cell: str) -> tuple[int, int, str | None]:
    """``"104 / 199 (x1.91)"`` -> ``(104, 199, "x1.91")``."""
    m = re.fullmatch(r"(\d+) / (\d+)(?: \((x[\d.]+|-)\))?", cell)
    assert m, cell
    return int(m.group(1)), int(m.group(2)), m.group(3)


def ratio(a: int, b: int) -> str:
    """``b / a`` as the report prints it (independently of ``figures.ratio``)."""
    return "-" if a == 0 else "x" + format(b / a, ".2f")


def test_every_block_is_current():
    assert figures.stale(ROOT) == []


def test_memory_table_is_the_cli(capsys, monkeypatch):
    text = block("docs/kv_recycling.md", "memory")
    ((recycle, args),) = commands(text)
    contexts = [int(c) for c in args[args.index("--context") + 1].split(",")]
    body = rows(text)
    assert {preset_of(r[0]) for r in body} == {p for _, p in figures.MODELS}
    for r in body:
        d = cli(capsys, monkeypatch, recycle, preset_of(r[0]), args)
        pools = d["pools"]
        assert int(r[1]) == pools["fastdeploy_num_blocks"], r
        assert [c["context"] for c in pools["contexts"]] == contexts
        for cell, c in zip(r[2:], pools["contexts"], strict=True):
            fd, rec, shown = pair(cell)
            assert (fd, rec) == (c["fastdeploy_requests"], c["recycling_requests"]), (r[0], c["context"])
            if shown is not None:
                assert shown == ratio(fd, rec), (r[0], cell)


def test_quant_table_is_the_cli(capsys, monkeypatch):
    text = block("docs/kv_recycling.md", "quant")
    (rb, bf16), (rq, fp8) = commands(text)
    assert "--kv-cache-quant" not in bf16 and fp8[fp8.index("--kv-cache-quant") + 1] == "block_wise_fp8"
    for r in rows(text):
        preset = preset_of(r[0])
        b = cli(capsys, monkeypatch, rb, preset, bf16)["pools"]
        q = cli(capsys, monkeypatch, rq, preset, fp8)["pools"]
        (cb,), (cq,) = b["contexts"], q["contexts"]
        fd_b, fd_q, fd_ratio = pair(r[1])
        rec_b, rec_q, rec_ratio = pair(r[2])
        assert (fd_b, fd_q) == (cb["fastdeploy_requests"], cq["fastdeploy_requests"]), r
        assert (rec_b, rec_q) == (cb["recycling_requests"], cq["recycling_requests"]), r
        assert fd_ratio == ratio(fd_b, fd_q) and rec_ratio == ratio(rec_b, rec_q), r
        m = re.fullmatch(r"(\d+) / (\d+) \((\d+)\)", r[3])
        assert m, r[3]
        assert int(m.group(1)) == b["fastdeploy_num_blocks"] and int(m.group(2)) == q["fastdeploy_num_blocks"]
        assert int(m.group(3)) == q["fastdeploy_claimed_num_blocks"]


def test_plan_table_is_the_cli(capsys, monkeypatch):
    text = block("docs/plan.md", "plan-table")
    ((recycle, args),) = commands(text)
    for r in rows(text):
        d = cli(capsys, monkeypatch, recycle, preset_of(r[0]), args)
        (c,) = d["pools"]["contexts"]
        fd, rec, shown = pair(r[1])
        assert (fd, rec, shown) == (c["fastdeploy_requests"], c["recycling_requests"], ratio(fd, rec))
        flags = d["fastdeploy_flags"]
        assert int(r[2].strip("`")) == flags["num_gpu_blocks_override"]
        assert int(r[3].strip("`")) == flags["max_num_seqs"]


def test_readme_gains_are_the_cli(capsys, monkeypatch):
    """README's sentence names its settings in words; they are the CLI's defaults (40 GiB, block 64,
    bf16, 8192 tokens and batched tokens)."""
    text = block("README.md", "readme-gains")
    assert "40 GiB per rank, block 64, bf16, 8192 batched tokens" in text and text.startswith("at 8k ")
    found = dict(re.findall(r"([A-Za-z][\w.\- ]*?) (x\d\.\d\d)", text.removeprefix("at 8k ")))
    assert set(found) == {name for name, _ in figures.MODELS}
    for name, preset in figures.MODELS:
        monkeypatch.setenv("FDFLEET_KV_RECYCLE", "auto")
        assert main(["plan", preset, "--json"]) == 0
        (c,) = json.loads(capsys.readouterr().out)["pools"]["contexts"]
        assert found[name] == ratio(c["fastdeploy_requests"], c["recycling_requests"]), name
    # and the text output prints the same figure
    assert main(["plan", "gpt-oss-20b"]) == 0
    assert f" {found['gpt-oss-20b']}  " in capsys.readouterr().out


def test_readme_quant_range_is_the_cli(capsys, monkeypatch):
    text = block("README.md", "readme-quant")
    low, high = (float(x) for x in re.findall(r"x(\d\.\d\d)", text))
    values = []
    for _, preset in figures.MODELS:
        b = cli(capsys, monkeypatch, "auto", preset, [])["pools"]["contexts"][0]
        q = cli(capsys, monkeypatch, "auto", preset, ["--kv-cache-quant", "block_wise_fp8"])["pools"]
        q = q["contexts"][0]
        values += [
            q["fastdeploy_requests"] / b["fastdeploy_requests"],
            q["recycling_requests"] / b["recycling_requests"],
        ]
    assert (low, high) == (round(min(values), 2), round(max(values), 2))


@pytest.mark.parametrize(
    "rel,old,new",
    [
        ("docs/kv_recycling.md", "104 / 199 (x1.91)", "104 / 199 (x1.92)"),
        ("docs/kv_recycling.md", "| 13653 / 26479 (27306) |", "| 13653 / 26480 (27306) |"),
        ("README.md", "gpt-oss-20b x1.91", "gpt-oss-20b x1.96"),
        ("docs/plan.md", "| 13653 | 199 |", "| 13653 | 200 |"),
    ],
)
def test_a_hand_edited_figure_is_caught(tmp_path, rel, old, new):
    for f in figures.FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    path = tmp_path / rel
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")
    assert len(figures.stale(tmp_path)) == 1 and figures.stale(tmp_path)[0].startswith(rel)
    assert figures.main(["--root", str(tmp_path)]) == 1
    assert figures.main(["--root", str(tmp_path), "--write"]) == 0
    assert figures.stale(tmp_path) == [] and path.read_text(encoding="utf-8") == text
