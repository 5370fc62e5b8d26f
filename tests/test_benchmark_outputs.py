"""Benchmark scripts never delete what they did not make, and read files back with named errors
(issue 30 items 3 and 5).

* ``benchmarks/_outputs.py`` on its own: a user's file is refused (naming the path and ``--force``),
  the script's own output (its mark, ``benchmarks/results/``, a plot beside it) and ``--force`` are
  not; a file that appears during the run is not clobbered; a symlink is written through.
* Every writing script, run as a subprocess on the CPU: ``--out`` (or ``--sass-dir``) naming a user's
  file exits 2 before any work, naming the file and ``--force``, and leaves it byte for byte.
* ``--plot-only`` / ``--from-json`` / ``--merge`` / ``--replot`` on a missing file, a directory, an
  empty file, garbage or JSON of the wrong shape exit 2 with one line naming the file, no traceback.
* ``serving_sim.py`` without FastDeploy exits 2 naming ``FDFLEET_HOST_FASTDEPLOY``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
USER = b'{"mine": "a user\'s notes, not a benchmark output"}\n'


@pytest.fixture(scope="module")
def outputs():
    spec = importlib.util.spec_from_file_location("fdfleet_bench_outputs", BENCH / "_outputs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


def _run(script: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", **(env or {}))
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_named_line(proc: subprocess.CompletedProcess, *named: str) -> str:
    """Exit 2, no traceback, and the last stderr line names every one of ``named``."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    for n in named:
        assert n in line, (n, line)
    return line


# ---- the helpers ---------------------------------------------------------------------------------


def test_a_users_file_is_refused_and_own_outputs_are_not(outputs, tmp_path):
    user = tmp_path / "r.json"
    user.write_bytes(USER)
    with pytest.raises(outputs.Refused, match=r"--out '.*r\.json' exists .* pass --force"):
        outputs.claim(user, script="serving_sim")
    assert outputs.claim(user, script="serving_sim", force=True).seen is not None
    own = tmp_path / "own.json"
    own.write_text(json.dumps(outputs.mark({"rows": []}, "serving_sim"), indent=1))
    outputs.claim(own, script="serving_sim")  # its own (a JSON document, the mark inside)
    with pytest.raises(outputs.Refused):  # another script's output is not this one's
        outputs.claim(own, script="headwise_sim")
    lines = tmp_path / "own.jsonl"
    lines.write_text(json.dumps(outputs.mark({"case": "x"}, "attention")) + "\n")
    outputs.claim(lines, script="attention")
    png = tmp_path / "own.png"
    png.write_bytes(b"a plot")
    outputs.claim(png, script="serving_sim", flag="--plot", beside=own)  # a plot beside its own data
    with pytest.raises(outputs.Refused, match="--plot"):
        outputs.claim(png, script="serving_sim", flag="--plot", beside=user)
    sass = tmp_path / "k.sass"
    sass.write_text(outputs.mark_line("hopper_compile") + "SASS\n")
    outputs.claim(sass, script="hopper_compile")
    outputs.claim(BENCH / "results" / "serving_sim.json", script="serving_sim")  # the committed results
    with pytest.raises(outputs.Refused, match="directory"):
        outputs.claim(tmp_path, script="serving_sim")
    assert user.read_bytes() == USER


def test_a_file_that_appears_during_the_run_is_not_clobbered(outputs, tmp_path):
    path = tmp_path / "r.json"
    c = outputs.claim(path, script="serving_sim")  # nothing there when the run starts
    with pytest.raises(outputs.Refused, match="appeared or changed during the run"):
        with outputs.replacing(c) as tmp:
            tmp.write_text('{"new": 1}\n')
            path.write_bytes(USER)  # the user's file, written meanwhile
    assert path.read_bytes() == USER
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary sibling left
    own = outputs.claim(path, script="serving_sim", force=True)
    with outputs.replacing(own) as tmp:
        tmp.write_text('{"new": 2}\n')
    assert json.loads(path.read_text()) == {"new": 2}


def test_a_symlink_is_written_through(outputs, tmp_path):
    target = tmp_path / "data" / "r.json"
    target.parent.mkdir()
    target.write_text(json.dumps(outputs.mark({"old": 1}, "headwise_sim")))
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with outputs.replacing(outputs.claim(link, script="headwise_sim")) as tmp:
        tmp.write_text('{"new": 1}\n')
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"new": 1}
    records = outputs.open_records(link, script="headwise_sim", force=True)
    records.record({"more": 2})
    records.close()
    assert link.is_symlink() and target.read_text().endswith(
        '{"fdfleet-benchmark": "headwise_sim", "more": 2}\n'
    )


def test_appending_only_to_its_own_files(outputs, tmp_path):
    path = tmp_path / "r.jsonl"
    for content in (USER, b""):  # a user's file, an empty one: not this script's
        path.write_bytes(content)
        with pytest.raises(outputs.Refused, match="--force"):
            outputs.open_records(path, script="decode_ceiling")
        assert path.read_bytes() == content
    path.unlink()
    for n in range(2):
        records = outputs.open_records(path, script="decode_ceiling")
        records.record({"run": n})
        records.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"fdfleet-benchmark": "decode_ceiling", "run": 0},
        {"fdfleet-benchmark": "decode_ceiling", "run": 1},
    ]


# ---- every writing script ------------------------------------------------------------------------

WRITERS = [
    ("attention.py", ["--out", "{f}.jsonl"]),
    ("attention.py", ["--out", "{d}/own.jsonl", "--plot", "{f}.png"]),
    ("headwise_sim.py", ["--quick", "--out", "{f}.json"]),
    ("serving_sim.py", ["--smoke", "--out", "{f}.json"]),
    ("probes/decode_ceiling.py", ["--smoke", "--out", "{f}.jsonl"]),
    ("probes/decode_probe.py", ["--out", "{f}.json"]),
    ("probes/hopper_probe.py", ["--out", "{f}.json"]),
    ("probes/hopper_variants.py", ["--out", "{f}.jsonl"]),
    ("probes/host_python.py", ["--device", "cpu", "--out", "{f}.jsonl"]),
    ("probes/launch_parts.py", ["--out", "{f}.jsonl"]),
    ("probes/safe_launch.py", ["--out", "{f}.jsonl"]),
    ("probes/hopper_compile.py", ["--case", '{{"dqk": 128}}', "--sass-dir", "{d}"]),
]


@pytest.mark.parametrize("script, args", WRITERS, ids=[f"{s}-{a[-2]}" for s, a in WRITERS])
def test_a_users_file_is_left_as_it_was(script, args, tmp_path):
    """Before any work: exit 2 naming the file and ``--force``; the file byte for byte, nothing else
    written. Old code: ``--out`` opened with ``"w"`` / ``"a"`` or renamed over whatever was there."""
    d = tmp_path / "d"
    d.mkdir()
    argv = [a.format(f=d / "user", d=d) for a in args]
    user = (
        d / "hopper_prefill_dqk128.sass"
        if "--sass-dir" in argv
        else Path(argv[argv.index("--plot" if "--plot" in argv else "--out") + 1])
    )
    user.write_bytes(USER)
    before = sorted(p.name for p in d.iterdir())
    _one_named_line(_run(script, *argv, cwd=tmp_path), str(user), "--force")
    assert user.read_bytes() == USER
    assert sorted(p.name for p in d.iterdir()) == before


def test_force_is_explained_in_each_scripts_help(tmp_path):
    for script in sorted({s for s, _ in WRITERS}):
        proc = _run(script, "--help", cwd=tmp_path)
        assert proc.returncode == 0, (script, proc.stderr[-1000:])
        assert "--force" in proc.stdout and "not this script's output" in " ".join(proc.stdout.split()), (
            script
        )


# ---- files read back -----------------------------------------------------------------------------

BAD_INPUTS = {
    "missing": (None, "no such file"),
    "directory": ("dir", "is a directory"),
    "empty": (b"", "is empty"),
    "garbage": (b"\x00not json at all {\n", "not JSON"),
}
READERS = [
    ("attention.py", "--plot-only", b'{"meta": true}\n', "no benchmark record"),
    ("serving_sim.py", "--replot", b'{"rows": [{"model": "x"}]}\n', "lacks context"),
    ("serving_sim.py", "--merge", b"[1, 2]\n", "expected a JSON object"),
    ("probes/decode_probe.py", "--from-json", b'{"not": "a list"}\n', "expected a JSON list"),
]


@pytest.mark.parametrize(
    "script, flag, wrong_shape, says", READERS, ids=[f"{s}{f}" for s, f, _, _ in READERS]
)
@pytest.mark.parametrize("kind", [*BAD_INPUTS, "wrong-shape"])
def test_bad_input_files_are_named_in_one_line(script, flag, wrong_shape, says, kind, tmp_path):
    path = tmp_path / "in.json"
    content, expected = BAD_INPUTS.get(kind, (wrong_shape, says))
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    extra = ["--smoke", "--out", str(tmp_path / "o.json")] if flag == "--merge" else []
    line = _one_named_line(_run(script, flag, str(path), *extra, cwd=tmp_path), flag, str(path), expected)
    assert len(line) < 400, line


def test_serving_sim_without_fastdeploy_names_what_is_missing(tmp_path):
    if importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("fastdeploy is installed in this environment: nothing is missing")
    empty = tmp_path / "no-host"
    empty.mkdir()
    for env in (
        {"FDFLEET_HOST_FASTDEPLOY": str(empty)},
        {"FDFLEET_HOST_FASTDEPLOY": "", "HOME": str(tmp_path)},
    ):
        proc = _run("serving_sim.py", "--smoke", "--out", str(tmp_path / "o.json"), cwd=tmp_path, env=env)
        _one_named_line(proc, "FastDeploy is not importable", "FDFLEET_HOST_FASTDEPLOY", "fastdeploy/")
        assert not (tmp_path / "o.json").exists()
