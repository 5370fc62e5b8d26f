"""Each benchmark says what it needs and, without it, exits 2 with one line naming it (no traceback).

* ``probes/decode_ceiling.py --smoke`` on a CPU without ``TRITON_INTERPRET=1`` (the interpreter is
  read when the kernels are decorated: the script cannot switch it on itself) and without ``--smoke``;
* ``probes/launch_parts.py`` and ``attention.py`` (without ``--smoke``) without a GPU;
* every script's ``--help`` names its needs, and ``benchmarks/README.md`` has a "needs" column;
* ``attention.py``'s ``summary`` with a zero peer figure (a time below the timer's resolution at
  ``--smoke`` shapes) used to raise ``ZeroDivisionError`` after the cases ran, leaving no output.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


needs_no_gpu = pytest.mark.skipif(_cuda(), reason="checks the message shown without a CUDA GPU")


def _run(script: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(PYTHONPATH=str(ROOT / "src"), **env)
    return subprocess.run(
        [sys.executable, str(BENCH / script), *argv],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _one_named_line(proc: subprocess.CompletedProcess, *named: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for n in named:
        assert n in errors[0], (n, errors[0])


@needs_no_gpu
@pytest.mark.parametrize(
    "script, argv, named",
    [
        ("probes/decode_ceiling.py", ["--smoke"], ["TRITON_INTERPRET=1", "--smoke"]),
        ("probes/decode_ceiling.py", [], ["CUDA GPU"]),
        ("probes/launch_parts.py", [], ["CUDA GPU"]),
        ("probes/safe_launch.py", [], ["CUDA GPU"]),
        ("attention.py", [], ["CUDA GPU", "--smoke"]),
    ],
)
def test_gpu_scripts_name_what_they_need(script, argv, named):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    _one_named_line(_run(script, *argv), *named)


@pytest.mark.parametrize(
    "script, named",
    [
        ("attention.py", ["CUDA GPU", "TRITON_INTERPRET"]),
        ("serving_sim.py", ["FDFLEET_HOST_FASTDEPLOY", "no GPU"]),
        ("headwise_sim.py", ["no GPU", "no FastDeploy"]),
        ("probes/decode_ceiling.py", ["CUDA GPU", "TRITON_INTERPRET=1"]),
        ("probes/launch_parts.py", ["CUDA GPU"]),
        ("probes/safe_launch.py", ["Hopper GPU"]),
        ("probes/portable_compile.py", ["no GPU"]),
    ],
)
def test_help_says_what_each_script_needs(script, named):
    for module in ("torch", "triton", "numpy"):
        pytest.importorskip(module, reason=f"{script} imports {module} before parsing its arguments")
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    for n in named:
        assert n in text, (n, text[-600:])


def test_readme_tables_have_a_needs_column_and_name_the_extra():
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    headers = [
        line for line in text.splitlines() if line.startswith("| script |") or line.startswith("| probe |")
    ]
    assert len(headers) == 2 and all("| needs |" in h for h in headers), headers
    assert ".[bench]" in text
    bench = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert any(req.split(">")[0].split("=")[0].strip() == "triton" for req in bench), bench


def test_summary_survives_a_zero_figure():
    spec = importlib.util.spec_from_file_location("_attention_bench_summary", BENCH / "attention.py")
    attention = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attention)  # stdlib and benchmarks/_outputs.py at import time
    records = [
        {"case": "copy", "impl": "copy", "kind": "copy", "gbps": 0.0},
        {"case": "decode-full", "impl": "triton", "gbps": 0.0},
        {"case": "prefill-causal", "impl": "triton", "tflops": 1.0},
        {"case": "prefill-causal", "impl": "sdpa-cudnn", "tflops": 0.0},
    ]
    rows = attention.summary(records)
    by = {r["target"]: r for r in rows}
    decode = by["decode full >= 0.9 x copy"]
    assert decode.get("missing") and "ratio" not in decode, decode
    prefill = by["prefill causal >= 1.0 x sdpa-cudnn (same run)"]
    assert prefill.get("missing") and "met" not in prefill, prefill
