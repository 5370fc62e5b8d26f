"""Process edges and newcomer papercuts (issue 19): real child processes and the repository's own files.

* Ctrl-C exits 130 with one line; a closed stdout, a reader that closes the pipe, and a full disk
  (``/dev/full``: ``ENOSPC``) give one named line each, never ``internal error: AttributeError``;
* ``fdfleet --version`` (``--json``) is the installed distribution's version and pyproject's;
* installing any extra but ``cpu`` never installs the CPU ``paddlepaddle`` over ``paddlepaddle-gpu``;
  README's commands use extras that exist, and ``.ci/run`` runs README's test command after ruff;
* README has one table of every ``FDFLEET_*`` variable, defaults as ``envs.py`` parses them;
* plan tables use one range notation, checked against ``--json``'s half-open lists;
* ``fdfleet plan`` warns about what serving refuses and hints at ``--tp``;
* ``--backend triton`` under the interpreter without torch names the extra.
"""

from __future__ import annotations

import errno
import importlib.metadata
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from fastdeploy_paddlefleet.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "fastdeploy_paddlefleet.cli"]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    return lines[0]


def tracked_files_digest() -> str:
    """``git status --porcelain`` of the tracked files: a command must change none of them."""
    r = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    )
    return r.stdout if r.returncode == 0 else ""


# ---- Ctrl-C, closed stdout, broken pipe, full disk -------------------------------------------------

SLOW_PLAN = textwrap.dedent(
    """
    import sys, time
    import fastdeploy_paddlefleet.cli.plan as plan
    from fastdeploy_paddlefleet.cli import main

    def slow(args):
        print("ready", flush=True)
        time.sleep(120)
        return 0

    plan.run = slow
    sys.exit(main(["plan", "tiny"]))
    """
)


def _terminal_sigint() -> None:
    """In the child: SIGINT's default action, as under a terminal. A shell that starts the test run in
    the background without job control (``(cmd &)``) sets SIGINT to ignored, and children inherit
    that: Python then never raises KeyboardInterrupt and the CLI cannot be interrupted at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python installs its KeyboardInterrupt handler on it


def test_ctrl_c_exits_130_with_one_line():
    """A real SIGINT while a command runs (the command is held in a sleep so that the signal lands
    inside it, not during start-up)."""
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW_PLAN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_terminal_sigint,
    )
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    assert one_line(err) == "fdfleet: interrupted"


VERIFY_READY = textwrap.dedent(
    """
    import os, sys
    import fastdeploy_paddlefleet.runner.verify as verify
    from fastdeploy_paddlefleet.cli import main

    ready_fd = int(sys.argv[1])
    real_bar = verify.progress_bar

    class Ready:
        # the real (disabled) bar, and one byte on the ready pipe at the first finished step
        def __init__(self, bar):
            self.bar, self.sent = bar, False

        def update(self, n):
            if not self.sent:
                os.write(ready_fd, b"r")
                self.sent = True
            self.bar.update(n)

        def set_postfix(self, **kw):
            self.bar.set_postfix(**kw)

        def close(self):
            self.bar.close()

    verify.progress_bar = lambda *a, **kw: Ready(real_bar(*a, **kw))
    sys.exit(main(["verify", "--steps", "5000"]))
    """
)


def _wait_readable(fd: int, timeout: float) -> bool:
    import select

    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)


@pytest.mark.slow
def test_ctrl_c_during_verify_exits_130():
    """The same inside paddle's work: ``fdfleet verify`` with many steps, interrupted once its first
    step has run (a byte on a pipe says so: no sleep, so a loaded machine cannot make it early or
    late). The child is in its own process group and killed on every exit path: a failing or
    timed-out run never leaves a 5000-step verify behind."""
    pytest.importorskip("paddle")
    before = tracked_files_digest()
    ready_r, ready_w = os.pipe()

    def child_setup() -> None:
        _terminal_sigint()
        os.setpgrp()  # its own group: the finally below kills the child and whatever it started

    try:
        p = subprocess.Popen(
            [sys.executable, "-c", VERIFY_READY, str(ready_w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=child_setup,
            pass_fds=(ready_w,),
        )
    finally:
        os.close(ready_w)
    try:
        # generous: the first step includes paddle's import and the model's build on a loaded machine
        assert _wait_readable(ready_r, 600), "verify never finished a step in 600 s"
        assert os.read(ready_r, 1) == b"r", "verify exited before finishing a step"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
        assert p.returncode == 130, (p.returncode, err[-2000:])
        assert one_line(err) == "fdfleet: interrupted" and out == ""
    finally:
        os.close(ready_r)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=60)
        for stream in (p.stdout, p.stderr):
            stream.close()
    assert tracked_files_digest() == before


def test_closed_stdout_is_named():
    """``fdfleet plan tiny >&-`` was ``internal error: AttributeError``."""
    r = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *CLI, "plan", "tiny"],
        capture_output=False,
        stderr=subprocess.PIPE,
    )
    line = one_line(r.stderr.decode())
    assert r.returncode == 2 and "stdout is closed" in line, line


@pytest.mark.parametrize("source", ["tiny", "deepseek-v3"])
def test_reader_closing_the_pipe_is_named(source):
    """``fdfleet plan ... | head -0``: the reader is gone before the first write."""
    p = subprocess.Popen([*CLI, "plan", source, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    line = one_line(err)
    assert code == 141 and "stdout" in line and "broken pipe" in line, (code, line)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_full_disk_on_stdout_is_named(json_flag):
    """``/dev/full`` answers every write with ENOSPC: one line naming stdout and the error, exit 74."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([*CLI, "plan", "gpt-oss-20b", *json_flag], stdout=full, stderr=subprocess.PIPE)
    line = one_line(r.stderr.decode())
    assert r.returncode == 74, line
    assert "stdout" in line and "ENOSPC" in line and "No space left" in line, line


class _FullDisk(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_in_process(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    code = main(["--version"])
    err = capsys.readouterr().err
    assert code == 74 and "stdout" in one_line(err) and "ENOSPC" in err


def test_a_file_error_names_the_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{}")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        pytest.skip("running as root: permissions do not apply")
    code = main(["plan", str(path)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and str(path) in line and "cannot read" in line, line


# ---- --version --------------------------------------------------------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version(capsys):
    """The version printed is the package's, the installed distribution's and pyproject's (independent
    sources that must agree)."""
    import fastdeploy_paddlefleet

    want = _pyproject()["project"]["version"]
    assert fastdeploy_paddlefleet.__version__ == want
    assert importlib.metadata.version("fastdeploy-paddlefleet") == want
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.split() == ["fdfleet", "(fastdeploy-paddlefleet)", want]
    for argv in (["--version", "--json"], ["--json", "--version"]):
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out) == {"name": "fastdeploy-paddlefleet", "version": want}


def test_version_through_the_console_entry():
    r = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith(_pyproject()["project"]["version"]), r.stderr


def test_no_command_names_what_is_missing(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own error path: exit 2
        main([])
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert "command" in line and "--version" in line


# ---- extras: never the CPU paddlepaddle beside FastDeploy ------------------------------------------


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


PADDLE_DISTRIBUTIONS = {"paddlepaddle", "paddlepaddle-gpu", "paddlepaddle-xpu", "paddlepaddle-dcu"}


def test_only_the_cpu_extra_names_paddlepaddle():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {_name(r) for r in extras["cpu"]} & PADDLE_DISTRIBUTIONS == {"paddlepaddle"}
    for extra, requirements in extras.items():
        if extra == "cpu":
            continue
        named = {_name(r) for r in requirements} & PADDLE_DISTRIBUTIONS
        assert not named, f"extra {extra!r} names {named}: it would install a Paddle over paddlepaddle-gpu"
    assert not {_name(r) for r in _pyproject()["project"]["dependencies"]} & PADDLE_DISTRIBUTIONS


def test_extras_do_not_pull_paddlepaddle_transitively():
    """The installed requirements of every extra but ``cpu`` do not require a Paddle distribution
    either (unconditionally: requirements behind one of their own extras are not installed)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        if extra == "cpu":
            continue
        for requirement in requirements:
            try:
                requires = importlib.metadata.requires(_name(requirement)) or []
            except importlib.metadata.PackageNotFoundError:
                continue
            unconditional = [r for r in requires if "extra ==" not in r]
            named = {_name(r) for r in unconditional} & PADDLE_DISTRIBUTIONS
            assert not named, f"extra {extra!r}: {requirement} requires {named}"


def test_readme_commands_use_existing_extras_and_ci_runs_readme_test_command():
    extras = set(_pyproject()["project"]["optional-dependencies"])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    used = {e.strip() for group in re.findall(r"\.\[([a-z0-9,_ -]+)\]", readme) for e in group.split(",")}
    assert used and used <= extras, used - extras
    quick = readme[readme.index("## Quickstart") : readme.index("## Using it with FastDeploy")]
    blocks = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    install, tests = (part.strip() for part in test_command.split("&&"))
    assert install == 'pip install -e ".[test,cpu]"' and "cpu" in blocks[0], blocks
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci and tests in ci, (install, tests)
    order = [ci.index(install), ci.index("ruff check ."), ci.index("ruff format --check ."), ci.index(tests)]
    assert order == sorted(order), "ruff runs after the install and before the tests"
    # ruff comes from the test extra, pinned as in the dev extra and pre-commit's hook
    pins = {r for e in ("test", "dev") for r in _pyproject()["project"]["optional-dependencies"][e]}
    assert {p for p in pins if _name(p) == "ruff"} == {"ruff==0.17.6"}
    assert "ruff==0.17.6" in (ROOT / ".pre-commit-config.yaml").read_text()
    assert (
        "## Contributing" in readme and 'pip install -e ".[dev]"' in readme and "pre-commit install" in readme
    )


def test_missing_paddle_names_the_cpu_extra_and_paddlepaddle_gpu():
    from fastdeploy_paddlefleet.cli import missing_extra

    err = missing_extra(ModuleNotFoundError("No module named 'paddle'", name="paddle"), "fdfleet verify")
    assert err is not None and "'cpu'" in str(err) and "paddlepaddle-gpu" in str(err)


# ---- README: every FDFLEET_* variable --------------------------------------------------------------


def _readme_variables() -> dict[str, tuple[str, str]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Environment variables") :]
    section = section[: section.index("\n#")]
    rows = re.findall(r"^\| `(FDFLEET_[A-Z0-9_]+)` \| (.+?) \| (.+?) \|$", section, flags=re.M)
    return {name: (default, meaning) for name, default, meaning in rows}


def test_readme_lists_every_fdfleet_variable():
    table = _readme_variables()
    envs = (ROOT / "src" / "fastdeploy_paddlefleet" / "envs.py").read_text(encoding="utf-8")
    defined = set(re.findall(r"FDFLEET_[A-Z0-9_]+", envs))
    in_src = {
        name
        for path in (ROOT / "src").rglob("*.py")
        for name in re.findall(r"FDFLEET_[A-Z0-9_]+", path.read_text(encoding="utf-8"))
    }
    in_tests = {
        name
        for path in (ROOT / "tests" / "hosts").rglob("*.py")
        for name in re.findall(r"FDFLEET_HOST_[A-Z_]+", path.read_text(encoding="utf-8"))
    }
    assert defined, "envs.py defines no FDFLEET_* variable?"
    missing = (defined | in_src | in_tests) - set(table)
    assert not missing, f"README's table lacks {sorted(missing)}"
    for name, (default, meaning) in table.items():
        assert default.strip() and len(meaning.strip()) > 10, name


def test_readme_defaults_are_what_envs_parses(monkeypatch):
    from fastdeploy_paddlefleet import envs

    for name in ("FDFLEET_BACKEND", "FDFLEET_PREFILL_KERNEL", "FDFLEET_HEADWISE_KV", "FDFLEET_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    table = _readme_variables()
    assert table["FDFLEET_BACKEND"][0] == f"`{envs.backend_name()}`"
    assert table["FDFLEET_PREFILL_KERNEL"][0] == f"`{envs.prefill_kernel()}`"
    assert table["FDFLEET_LOG_LEVEL"][0] == f"`{logging.getLevelName(envs.log_level())}`"
    assert table["FDFLEET_HEADWISE_KV"][0] == ("on" if envs.headwise_kv() else "off")


# ---- plan tables: one range notation ---------------------------------------------------------------


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.splitlines()
    header_line = lines[1]
    starts = [m.start() for m in re.finditer(r"(?:(?<=  )|^)\S", header_line)]
    cells = lambda line: [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]  # noqa: E731
    rows = []
    for line in lines[2:]:
        if not line.strip() or line.startswith("("):
            break
        rows.append(cells(line))
    return cells(header_line), rows


def _expand(text: str) -> list[int]:
    """The inclusive notation read back: ``0-3`` -> 0..3, ``0-22/2`` -> every 2nd, ``0,3``, ``2``."""
    out: list[int] = []
    for part in text.split(","):
        step = 1
        if "/" in part:
            part, s = part.split("/")
            step = int(s)
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1, step))
    return out


@pytest.mark.parametrize(
    "argv", [["gpt-oss-20b", "--tp", "2", "--tp-rank", "1"], ["tiny"], ["mimo-v2-flash-like", "--tp", "4"]]
)
def test_plan_table_ranges_are_inclusive_everywhere(capsys, argv):
    """Every range cell read back as inclusive equals ``--json``'s half-open list (an independent
    view of the same plan); the notation is stated under the table."""
    assert main(["plan", *argv, "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "(ranges a-b include both ends" in out
    header, rows = _table(out)
    col = {name: i for i, name in enumerate(header)}
    seen = set()
    for row in rows:
        indices = _expand(row[col["layers"]])
        for i in indices:
            layer = layers[i]
            seen.add(i)
            slide = layer["sliding_kv_heads"]
            want = "-" if slide is None else list(range(*slide))
            assert (row[col["sliding kv"]] == "-") if want == "-" else _expand(row[col["sliding kv"]]) == want
            if "kv heads" in col:  # tensor parallel: this rank's global head indices
                assert _expand(row[col["q heads (sinks)"]]) == json_range(layer, "q"), row
                assert _expand(row[col["kv heads"]]) == json_range(layer, "kv"), row
                assert len(json_range(layer, "q")) == layer["num_q_heads"]
    assert seen == set(range(len(layers)))


def json_range(layer: dict, which: str) -> list[int]:
    """A layer's global ``q`` / ``kv`` head indices, expanded from the plan's half-open range."""
    return layer[f"_{which}_range"]


@pytest.fixture(autouse=True)
def _head_ranges_in_json(monkeypatch):
    """``--json`` prints no head ranges; add them from the plan (the same half-open tuples the
    table reads) for :func:`json_range`."""
    from fastdeploy_paddlefleet.cli import plan as plan_cli

    real = plan_cli.layer_dict

    def layer_dict(layer):
        d = real(layer)
        d["_q_range"] = list(range(*layer.q_head_range))
        d["_kv_range"] = list(range(*layer.kv_head_range))
        return d

    monkeypatch.setattr(plan_cli, "layer_dict", layer_dict)


def test_single_head_ranges_are_one_number(capsys):
    assert main(["plan", "tiny"]) == 0
    header, rows = _table(capsys.readouterr().out)
    col = {name: i for i, name in enumerate(header)}
    headwise = [r for r in rows if r[col["kind"]] == "headwise"]
    assert headwise and headwise[0][col["sliding kv"]] == "1"  # the last of 2 kv heads slides


# ---- plan: what serving refuses, and the --tp hint --------------------------------------------------


def test_plan_warns_about_a_quantization_config(tmp_path, capsys):
    from fastdeploy_paddlefleet.plan import load_config

    raw = load_config("tiny")
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    before = path.read_bytes()
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if line.startswith("WARNING:")]
    assert len(warning) == 1 and "quantization_config" in warning[0] and "'fp8'" in warning[0], out
    assert main(["plan", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["warnings"]) == 1 and "quantization_config" in d["warnings"][0]
    assert path.read_bytes() == before
    assert main(["plan", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_plan_hints_at_tp_when_one_rank_cannot_hold_a_request(capsys):
    """DeepSeek-V3 at TP 1 in 40 GiB: max requests 0 in FastDeploy's one shape; the hint names a
    --tp that holds one, checked by planning at that --tp."""
    assert main(["plan", "deepseek-v3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_cache"]["fastdeploy_uniform"]["max_requests_uniform"] == 0
    (hint,) = d["warnings"]
    tp = int(re.search(r"try --tp (\d+)", hint).group(1))
    assert main(["plan", "deepseek-v3", "--tp", str(tp), "--json"]) == 0
    at_tp = json.loads(capsys.readouterr().out)
    assert at_tp["kv_cache"]["fastdeploy_uniform"]["max_requests_uniform"] >= 1 and at_tp["warnings"] == []
    if tp > 2:  # the smallest that fits
        assert main(["plan", "deepseek-v3", "--tp", str(tp // 2), "--json"]) == 0
        assert (
            json.loads(capsys.readouterr().out)["kv_cache"]["fastdeploy_uniform"]["max_requests_uniform"] == 0
        )
    assert main(["plan", "deepseek-v3"]) == 0
    assert f"WARNING: {hint}" in capsys.readouterr().out


def test_plan_says_when_no_tp_helps(capsys):
    assert main(["plan", "deepseek-v3", "--memory-gib", "0.001", "--json"]) == 0
    (hint,) = json.loads(capsys.readouterr().out)["warnings"]
    assert "--memory-gib" in hint and "--context" in hint


# ---- --backend triton without torch ----------------------------------------------------------------


def test_triton_interpreter_without_torch_names_the_extra():
    """Was ``AttributeError: 'Tensor' object has no attribute 'untyped_storage'``: Triton's CPU
    interpreter needs torch tensors. Torch is blocked in the child process."""
    pytest.importorskip("paddle")
    pytest.importorskip("triton")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from fastdeploy_paddlefleet.cli import main\n"
        "sys.exit(main(['verify', '--backend', 'triton', '--steps', '1']))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    line = one_line(r.stderr)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--backend triton" in line and "'torch' extra" in line and "TRITON_INTERPRET" in line, line


def test_top_level_json_applies_to_the_command(capsys):
    assert main(["--json", "plan", "tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "tiny"


def test_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for code in ("130", "141", "74", "70", " 2 bad input"):
        assert code in " ".join(out.split()), out
