"""benchmarks/probes/host_python.py keeps running on the CPU: every case on the direct path (the kept kernel
called with addresses, as on a GPU), each launch counted, and the lane each launch came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "probes" / "host_python.py"
LAUNCHES = {  # kept kernels per call: a one-shot wrapper one launch, a served layer write + attention
    "write_kv_cache": 1,
    "paged_attention-decode": 1,
    "paged_attention-prefill-portable": 2,  # the prefill's fast and safe launches
    "backend-layer-served": 2,
    "backend-layer-served-checked": 2,
    "backend-layer-served-prefill": 3,
    "backend-step-served": 16,  # a call: a step of 8 layers
    "backend-step-served-checked": 16,
    "backend-layer-paddle-views": 2,  # paddle tensors (needs paddle): DLPack views, then the lane
    "backend-layer-paddle-lane": 2,
    "backend-step-paddle-views": 16,
    "backend-step-paddle-lane": 16,
}
# kept-lane calls per call: as many as launches, but a prefill's two launches are one call
LANES = {**LAUNCHES, "paged_attention-prefill-portable": 1, "backend-layer-served-prefill": 2}


def _run(*args, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_host_python_benchmark_runs_every_case_on_the_direct_path(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    out = tmp_path / "host.jsonl"
    args = ["--device", "cpu", "--calls", "20", "--repeats", "2", "--out", str(out), "--tag", "call=3"]
    proc = _run(*args, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == [{"fdfleet-benchmark": "host_python", **r} for r in printed]  # each with its mark
    rows = {r["case"]: r for r in printed}
    assert set(rows) == {"torch-add_", "torch-empty", "new_empty", *LAUNCHES}
    for case, row in rows.items():
        if "skipped" in row:  # only the paddle cases, and only without paddle
            assert "paddle" in case and not _has_paddle(), row
            continue
        assert "error" not in row and row["us"] > 0 and row["us_min"] <= row["us"], row
        assert row["kind"] == "host-python" and row["device"] == "cpu" and row["call"] == 3
        assert row["calls"] == (2 if case.startswith("backend-step") else 20)
        assert row.get("direct_launches") == LAUNCHES.get(case), row
        if case in LANES:  # every launch from a kept lane; DLPack views first build the step
            n = LANES[case]
            assert row["lanes"] == {"kept": n, "kept-refused": 0, "step": n if "views" in case else 0}, row


def _has_paddle() -> bool:
    try:
        import paddle  # noqa: F401
    except ImportError:
        return False
    return True


def test_host_python_benchmark_refuses_bad_arguments(tmp_path):
    for args in (["--cases", "nope"], ["--calls", "0"], ["--out", "x.json"], ["--tag", "novalue"]):
        proc = _run(*args, tmp_path=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr[-500:])
        assert args[0] in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpu_like_tensors_is_undone_on_exit():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    try:
        import host_python
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "probes"))
    x = torch.zeros(2)
    with pytest.raises(KeyError), host_python.gpu_like_tensors(True):
        assert x.is_cuda is True
        raise KeyError
    assert "is_cuda" not in torch.Tensor.__dict__ and x.is_cuda is False
