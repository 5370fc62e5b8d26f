"""benchmarks/attention.py keeps running: every issue-4 case at --smoke shapes (CPU interpreter), checked
against the dense reference inside the script (its max_abs_err field)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "decode-full",
    "decode-swa1024",
    "decode-swa1024-sinks",
    "decode-headwise",
    "prefill-causal",
    "prefill-swa1024",
    "prefill-swa1024-sinks",
    "mixed",
    "mla-decode",
    "mla-prefill-causal",
}


@pytest.mark.slow
def test_attention_benchmark_smoke(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    out = tmp_path / "smoke.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    script = ROOT / "benchmarks" / "attention.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--no-peers", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = {r["case"]: r for r in rows if r.get("impl") == "triton" and r.get("kind") != "host"}
    assert set(ours) == CASES
    for case, row in ours.items():
        assert "error" not in row, (case, row)
        assert row["max_abs_err"] < 1e-4, (case, row)  # fp32 at --smoke shapes on the CPU
    host = [r for r in rows if r.get("kind") == "host"]  # host cost per eager launch (issue 20)
    assert host and all("error" not in r and r["us"] > 0 for r in host), host
    assert out.with_suffix(".png").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--smoke", "--out", "benchmarks/results/attention-h200.jsonl"], "committed results"),
        (["--out", "results.png"], "--out"),
        (["--out", "x.jsonl", "--plot", "plot.jsonl"], "--plot"),
    ],
)
def test_attention_benchmark_refuses_outputs_before_any_work(args, named, tmp_path):
    """A smoke run never writes the committed results; a mismatched extension is refused by flag; in
    every case no file changes (checked byte for byte on the committed results)."""
    committed = ROOT / "benchmarks" / "results" / "attention-h200.jsonl"
    before = committed.read_bytes()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), *args],
        cwd=ROOT if args[-1].startswith("benchmarks/") else tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
    assert committed.read_bytes() == before
    assert list(tmp_path.iterdir()) == []
