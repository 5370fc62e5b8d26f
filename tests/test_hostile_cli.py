"""Hostile command lines: every bad flag, value or file ends with exit code 2 and ONE line on stderr
naming the flag, field or file; never a traceback, a hang or a silent acceptance.

Most cases run ``fdfleet`` in-process (``cli.main``); a closed stdout pipe runs a real child process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastdeploy_paddlefleet.cli import main

BASE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own exits (--help)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, fragments: tuple[str, ...], *argv: str) -> str:
    code, out, err = cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-500:], err[-2000:])
    assert len(lines) == 1, err  # one line, no traceback, no usage block
    assert "Traceback" not in err and lines[0].startswith("fdfleet")
    for frag in fragments:
        assert frag in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")

    def put(name: str, content: str | bytes | dict) -> str:
        p = d / name
        if isinstance(content, dict):
            content = json.dumps(content)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return str(p)

    no_head_dim = {k: v for k, v in BASE.items() if k != "head_dim"}
    paths = {
        "small_hidden": put("small_hidden.json", {**no_head_dim, "hidden_size": 2}),
        "layers_1e8": put("layers_1e8.json", {**BASE, "num_hidden_layers": 10**8}),
        "layers_1e8_float": put("layers_1e8_float.json", {**BASE, "num_hidden_layers": 1e8}),
        "heads_1e9": put(
            "heads_1e9.json", {**BASE, "num_attention_heads": 10**9, "num_key_value_heads": 10**9}
        ),
        "head_dim_huge": put("head_dim_huge.json", {**BASE, "head_dim": 10**12}),
        "layers_bool": put("layers_bool.json", {**BASE, "num_hidden_layers": True}),
        "layers_str": put("layers_str.json", {**BASE, "num_hidden_layers": "2"}),
        "kv_not_divisor": put("kv3.json", {**BASE, "num_key_value_heads": 3}),
        "scale_inf": put("scale_inf.json", json.dumps(BASE)[:-1] + ', "softmax_scale": Infinity}'),
        "scale_nan": put("scale_nan.json", json.dumps(BASE)[:-1] + ', "softmax_scale": NaN}'),
        "scale_zero": put("scale_zero.json", {**BASE, "softmax_scale": 0}),
        "scale_str": put("scale_str.json", {**BASE, "softmax_scale": "0.1"}),
        "qpas_inf": put("qpas_inf.json", json.dumps(BASE)[:-1] + ', "query_pre_attn_scalar": Infinity}'),
        "qpas_zero": put("qpas_zero.json", {**BASE, "query_pre_attn_scalar": 0}),
        "window_neg": put("window_neg.json", {**BASE, "sliding_window": -5}),
        "window_huge": put("window_huge.json", {**BASE, "sliding_window": 10**30}),
        "window_str": put("window_str.json", {**BASE, "sliding_window": "8"}),
        "ratio_nan": put(
            "ratio_nan.json", json.dumps({**BASE, "sliding_window": 8})[:-1] + ', "head_wise_swa_ratio": NaN}'
        ),
        "ratio_big": put("ratio_big.json", {**BASE, "sliding_window": 8, "head_wise_swa_ratio": 1.5}),
        "nested": put("nested.json", '{"a": ' + "[" * 100000 + "]" * 100000 + "}"),
        "binary": put("binary.json", bytes(range(256)) * 4),
        "malformed": put("malformed.json", '{"num_hidden_layers": 2,'),
        "list": put("list.json", "[1, 2]"),
        "empty": put("empty.json", ""),
        "bom": put("bom.json", b"\xef\xbb\xbf" + json.dumps(BASE).encode()),
        "big": put("big.json", {**BASE, "num_hidden_layers": 3000}),
        "mini_small_hidden": put(
            "mini_small_hidden.json",
            {
                "model_type": "minifleet",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 2,
                "vocab_size": 32,
                "intermediate_size": 8,
            },
        ),
    }
    nofile = d / "no such file"
    nofile.mkdir()
    paths["dir_without_config"] = str(nofile)
    paths["dir"] = str(d)
    return paths


# ---- fdfleet plan: flags --------------------------------------------------------------------------

PLAN_FLAGS = [
    (("--memory-gib", "inf"), ("--memory-gib", "'inf'")),  # was OverflowError
    (("--memory-gib", "1e300"), ("--memory-gib",)),  # was OverflowError
    (("--memory-gib", "nan"), ("--memory-gib",)),
    (("--memory-gib", "-1"), ("--memory-gib",)),
    (("--memory-gib", "0"), ("--memory-gib",)),
    (("--memory-gib", "lots"), ("--memory-gib", "'lots'")),
    (("--context", "1000000000000000"), ("--context",)),  # was accepted
    (("--context", "1e15"), ("--context",)),
    (("--context", "0"), ("--context",)),
    (("--context", "-5"), ("--context",)),
    (("--context", "1.5"), ("--context",)),
    (("--block-size", "0"), ("--block-size",)),
    (("--block-size", "1000000000000"), ("--block-size",)),
    (("--block-size", "x"), ("--block-size",)),
    (("--tp", "0"), ("--tp",)),
    (("--tp", "-2"), ("--tp",)),
    (("--tp", "1000000000"), ("--tp",)),
    (("--tp", "3"), ("tp_size=3",)),  # not a divisor of the heads
    (("--tp-rank", "7"), ("tp_rank",)),
    (("--tp-rank", "-1"), ("--tp-rank",)),
    (("--dtype", "junk"), ("dtype", "'junk'")),
    (("--bogus",), ("--bogus",)),
]


@pytest.mark.parametrize(("flags", "fragments"), PLAN_FLAGS, ids=[" ".join(f) for f, _ in PLAN_FLAGS])
def test_plan_bad_flags(capsys, flags, fragments):
    refused(capsys, fragments, "plan", "tiny", *flags)


def test_plan_missing_source(capsys):
    refused(capsys, ("SOURCE",), "plan")


# ---- fdfleet plan: config files -------------------------------------------------------------------

PLAN_FILES = [
    ("small_hidden", ("hidden_size=2", "num_attention_heads=4")),  # was ZeroDivisionError
    ("layers_1e8", ("num_hidden_layers", "100000000")),  # was a hang growing memory
    ("layers_1e8_float", ("num_hidden_layers",)),
    ("heads_1e9", ("num_attention_heads", "1000000000")),  # was accepted
    ("head_dim_huge", ("head_dim",)),
    ("layers_bool", ("num_hidden_layers", "True")),
    ("layers_str", ("num_hidden_layers", "'2'")),
    ("kv_not_divisor", ("num_key_value_heads=3",)),
    ("scale_inf", ("softmax_scale", "inf")),  # was accepted
    ("scale_nan", ("softmax_scale", "nan")),
    ("scale_zero", ("softmax_scale",)),
    ("scale_str", ("softmax_scale",)),
    ("qpas_inf", ("query_pre_attn_scalar", "inf")),  # was scale 0, accepted
    ("qpas_zero", ("query_pre_attn_scalar",)),
    ("window_neg", ("sliding_window",)),
    ("window_huge", ("window",)),
    ("window_str", ("sliding_window",)),
    ("ratio_nan", ("head_wise_swa_ratio",)),
    ("ratio_big", ("head_wise_swa_ratio",)),
    ("nested", ("nested.json", "nested too deeply")),  # was RecursionError
    ("binary", ("binary.json", "not UTF-8")),  # did not name the file
    ("malformed", ("malformed.json", "invalid JSON")),
    ("list", ("list.json", "JSON object")),
    ("empty", ("empty.json", "invalid JSON")),
    ("dir_without_config", ("no such file", "directory without a config.json")),  # said "no such file"
]


@pytest.mark.parametrize(("name", "fragments"), PLAN_FILES, ids=[n for n, _ in PLAN_FILES])
def test_plan_bad_config_files(capsys, files, name, fragments):
    refused(capsys, fragments, "plan", files[name])


@pytest.mark.parametrize(
    ("source", "fragments"),
    [
        ("/nonexistent/config.json", ("/nonexistent/config.json", "no such file")),
        ("nosuchpreset", ("'nosuchpreset'", "no such preset")),
        ("", ("config source is empty",)),
        ("/dev/null", ("/dev/null", "not a regular file")),
    ],
)
def test_plan_bad_sources(capsys, source, fragments):
    refused(capsys, fragments, "plan", source)


def test_plan_accepts_a_utf8_bom(capsys, files):
    code, out, err = cli(capsys, "plan", files["bom"], "--json")
    assert code == 0, err
    assert json.loads(out)["layers"][0]["num_q_heads"] == 4


def test_plan_into_a_closed_pipe_is_named(files):
    """``fdfleet plan ... | head``: one line naming stdout and the broken pipe, exit 141, no traceback."""
    p = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", "plan", files["big"], "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = p.stdout.read(100)
    p.stdout.close()  # the reader goes away, like `head -c 100`
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    assert first.startswith(b'{"source"')
    lines = [
        line for line in err.splitlines() if line.strip() and "Warning" not in line and "import " not in line
    ]
    assert len(lines) == 1 and "stdout" in lines[0] and "broken pipe" in lines[0], err
    assert "Traceback" not in err and "internal error" not in err, err
    assert code == 141


# ---- fdfleet verify -------------------------------------------------------------------------------

VERIFY_FLAGS = [
    (("--seed", "-1"), ("--seed", "'-1'")),  # said "expected non-negative integer"
    (("--seed", "4294967296"), ("--seed",)),
    (("--steps", "-1"), ("--steps",)),
    (("--steps", "1000000000"), ("--steps",)),
    (("--chunk-size", "0"), ("--chunk-size",)),
    (("--block-size", "0"), ("--block-size",)),
    (("--block-size", "100000000000"), ("--block-size",)),
    (("--tolerance", "nan"), ("--tolerance",)),
    (("--tolerance", "-1"), ("--tolerance",)),
    (("--tolerance", "inf"), ("--tolerance",)),
    (("--backend", "junk"), ("--backend",)),
    (("--preset", "tiny", "--config", "x.json"), ("--config", "--preset")),
    (("--preset", "nosuch"), ("nosuch",)),
    (("--preset", "tiny", "--paddleformers", "llama"), ("--paddleformers", "--preset")),
]


@pytest.mark.parametrize(("flags", "fragments"), VERIFY_FLAGS, ids=[" ".join(f) for f, _ in VERIFY_FLAGS])
def test_verify_bad_flags(capsys, flags, fragments):
    refused(capsys, fragments, "verify", *flags)


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("malformed", ("malformed.json", "invalid JSON")),  # did not name the file
        ("binary", ("binary.json", "not UTF-8")),
        ("nested", ("nested.json", "nested too deeply")),
        ("dir_without_config", ("no such file", "directory without a config.json")),
        ("mini_small_hidden", ("hidden_size=2", "num_attention_heads=4")),  # was ZeroDivisionError
    ],
)
def test_verify_bad_config_files(capsys, files, name, fragments):
    pytest.importorskip("paddle")
    refused(capsys, fragments, "verify", "--config", files[name], "--steps", "0")


def test_verify_paddleformers_without_the_extra(capsys, monkeypatch):
    """The extra is simulated away: the case module's first paddleformers import fails."""
    pytest.importorskip("paddle")
    import importlib

    cases = importlib.import_module("fastdeploy_paddlefleet.runner.paddleformers_case")

    def build_case(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'paddleformers'", name="paddleformers")

    monkeypatch.setattr(cases, "build_case", build_case)
    refused(capsys, ("--paddleformers", "'paddleformers'", "extra"), "verify", "--paddleformers", "llama")


def test_verify_triton_backend_without_the_extra(capsys, monkeypatch):
    import fastdeploy_paddlefleet.backends as backends

    def get_backend(name):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(backends, "get_backend", get_backend)
    refused(capsys, ("triton", "'kernels' extra"), "verify", "--backend", "triton")


def test_verify_unknown_module_error_is_not_blamed_on_an_extra(capsys, monkeypatch):
    """A missing module of the package itself is a bug: one line, exit 70, not 'install an extra'."""
    import fastdeploy_paddlefleet.backends as backends

    def get_backend(name):
        raise ModuleNotFoundError(
            "No module named 'fastdeploy_paddlefleet.nope'", name="fastdeploy_paddlefleet.nope"
        )

    monkeypatch.setattr(backends, "get_backend", get_backend)
    code, _, err = cli(capsys, "verify", "--backend", "reference")
    assert (
        code == 70 and len(err.strip().splitlines()) == 1 and "internal error" in err and "extra" not in err
    )


def test_verify_progress_bar_without_a_terminal_writes_no_carriage_returns(capsys):
    pytest.importorskip("paddle")
    code, out, err = cli(capsys, "verify", "--steps", "1")  # captured stderr: not a terminal
    assert code in (0, 1), err[-2000:]
    assert "\r" not in err
    assert "PASSED" in out or "FAILED" in out


def test_help_is_not_an_error(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "plan" in out and "verify" in out


def test_no_command(capsys):
    refused(capsys, ("command",))


def test_internal_errors_are_one_line(capsys, monkeypatch):
    """A bug (an exception no check foresaw) still prints one line (exit 70), traceback only at DEBUG."""
    from fastdeploy_paddlefleet.cli import plan

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(plan, "kv_budget", boom)
    code, _, err = cli(capsys, "plan", "tiny")
    assert code == 70 and err.count("\n") == 1 and "ZeroDivisionError" in err and "Traceback" not in err


# ---- failed writes of stdout / stderr, every command (issue 30 item 5) ---------------------------------

import os  # noqa: E402
import stat  # noqa: E402
from pathlib import Path  # noqa: E402

CLI = [sys.executable, "-m", "fastdeploy_paddlefleet.cli"]


def _dev_full() -> str | None:
    """Why ``/dev/full`` cannot be used (``None``: it is the character device that answers every
    write with ``ENOSPC``). It is only opened, never created or replaced."""
    try:
        st = os.stat("/dev/full")
    except OSError as e:
        return f"no /dev/full on this machine ({e.strerror})"
    if not stat.S_ISCHR(st.st_mode):
        return "/dev/full is not a character device here"
    return None


needs_dev_full = pytest.mark.skipif(_dev_full() is not None, reason=str(_dev_full()))


def _noise_free(err: str) -> list[str]:
    """stderr's lines less the third-party import warnings a child may print (paddle, torch)."""
    return [
        line
        for line in err.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith(" ") and "warnings.warn" not in line
    ]


def _run(argv: list[str], *, stdout: object, stderr: object, timeout: float = 300) -> tuple[int, str]:
    r = subprocess.run([*CLI, *argv], stdout=stdout, stderr=stderr, timeout=timeout)
    err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else ""
    return r.returncode, err


@needs_dev_full
def test_modeldir_json_into_a_full_disk_exits_74_with_one_line(tmp_path):
    """``fdfleet modeldir --json tiny DIR > /dev/full`` ended in a traceback (no such command
    guard): one line naming stdout and ENOSPC, exit 74, no "Exception ignored"."""
    pytest.importorskip("paddle")
    with open("/dev/full", "w") as full:
        code, err = _run(
            ["modeldir", "--json", "tiny", str(tmp_path / "m")], stdout=full, stderr=subprocess.PIPE
        )
    lines = _noise_free(err)
    assert code == 74, err
    assert len(lines) == 1 and "stdout" in lines[0] and "ENOSPC" in lines[0], err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@needs_dev_full
@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["--version"]], ids=" ".join)
def test_help_and_version_into_a_full_disk_exit_74(argv):
    """argparse's own output (``--help`` exits through SystemExit) is flushed under the guard too:
    before, the interpreter's last flush failed ("Exception ignored", exit 120)."""
    with open("/dev/full", "w") as full:
        code, err = _run(argv, stdout=full, stderr=subprocess.PIPE, timeout=120)
    lines = _noise_free(err)
    assert code == 74 and len(lines) == 1 and "ENOSPC" in lines[0], (code, err)
    assert "Exception ignored" not in err


@needs_dev_full
def test_stderr_on_a_full_disk_exits_74_silently():
    """A bad input whose one-line message cannot be written (stderr on /dev/full): exit 74, not 2 or
    a traceback into nowhere (exit 1 / 120 before)."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([*CLI, "plan", "no-such-preset"], stdout=subprocess.PIPE, stderr=full, timeout=120)
    assert r.returncode == 74 and r.stdout == b""


@needs_dev_full
def test_stderr_full_while_stdout_is_fine_is_no_error():
    """Nothing written to stderr: a full stderr changes nothing."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([*CLI, "plan", "tiny"], stdout=subprocess.PIPE, stderr=full, timeout=120)
    assert r.returncode == 0 and b"tiny" in r.stdout


@pytest.mark.parametrize("argv", [["--help"], ["modeldir", "--help"]], ids=" ".join)
def test_a_closed_pipe_exits_141_without_exception_ignored(argv):
    """``fdfleet --help | head -0``: 141 and the documented line, never "Exception ignored"."""
    p = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before a byte is read
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert code == 141, (code, err)


def test_help_documents_the_exit_codes(capsys):
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    flat = " ".join(out.split())
    for fragment in (
        "2 bad input",
        "74 a failed write",
        "stdout or stderr",
        "141 the reader closed the pipe",
    ):
        assert fragment in flat, flat


def test_modeldir_is_a_command(capsys, tmp_path):
    pytest.importorskip("paddle")
    code, out, err = cli(capsys, "modeldir", "tiny", str(tmp_path / "m"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["files"] == ["config.json", "model.safetensors"] and Path(report["path"]).is_dir()
