"""Strict parsing of FDFLEET_* environment switches, read at call time."""

from __future__ import annotations

import logging

import pytest

from fastdeploy_paddlefleet import envs


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " On ", "\ttrue\n"])
def test_parse_bool_true(value):
    assert envs.parse_bool("X", value) is True


@pytest.mark.parametrize("value", ["0", "false", "False", "NO", "off", " off "])
def test_parse_bool_false(value):
    assert envs.parse_bool("X", value) is False


@pytest.mark.parametrize("value", ["2", "y", "n", "enable", "truthy", "-1", "1.0"])
def test_parse_bool_rejects(value):
    with pytest.raises(ValueError) as e:
        envs.parse_bool("FDFLEET_SOMETHING", value)
    assert "FDFLEET_SOMETHING" in str(e.value) and repr(value) in str(e.value)


def test_parse_bool_type():
    with pytest.raises(TypeError, match="FLAG"):
        envs.parse_bool("FLAG", 1)


def test_headwise_kv(monkeypatch):
    monkeypatch.delenv("FDFLEET_HEADWISE_KV", raising=False)
    assert envs.headwise_kv() is False
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "YES")
    assert envs.headwise_kv() is True  # read at call time, after import
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "")
    assert envs.headwise_kv() is False  # empty counts as unset
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "maybe")
    with pytest.raises(ValueError, match="FDFLEET_HEADWISE_KV='maybe'"):
        envs.headwise_kv()


@pytest.mark.parametrize(
    "value,expected", [(None, "auto"), ("auto", "auto"), ("Reference", "reference"), (" TRITON ", "triton")]
)
def test_backend_name(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FDFLEET_BACKEND", raising=False)
    else:
        monkeypatch.setenv("FDFLEET_BACKEND", value)
    assert envs.backend_name() == expected


def test_backend_name_rejects(monkeypatch):
    monkeypatch.setenv("FDFLEET_BACKEND", "cuda")
    with pytest.raises(ValueError) as e:
        envs.backend_name()
    assert "FDFLEET_BACKEND" in str(e.value) and "'cuda'" in str(e.value)


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, logging.WARNING),
        ("debug", logging.DEBUG),
        ("Info", logging.INFO),
        ("WARNING", logging.WARNING),
        ("error", logging.ERROR),
        (" critical ", logging.CRITICAL),
    ],
)
def test_log_level(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("FDFLEET_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("FDFLEET_LOG_LEVEL", value)
    assert envs.log_level() == expected


@pytest.mark.parametrize("value", ["verbose", "10", "warn"])
def test_log_level_rejects(monkeypatch, value):
    monkeypatch.setenv("FDFLEET_LOG_LEVEL", value)
    with pytest.raises(ValueError) as e:
        envs.log_level()
    assert "FDFLEET_LOG_LEVEL" in str(e.value) and repr(value) in str(e.value)


def test_model_impl_switch_is_strict(monkeypatch):
    from fastdeploy_paddlefleet.envs import model_impl_is_paddlefleet

    monkeypatch.delenv("FDFLEET_MODEL_IMPL", raising=False)
    assert model_impl_is_paddlefleet() is False
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", " PaddleFleet ")
    assert model_impl_is_paddlefleet() is True
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", "fastdeploy")
    with pytest.raises(ValueError, match="FDFLEET_MODEL_IMPL='fastdeploy'"):
        model_impl_is_paddlefleet()


def test_check_all_names_the_bad_switch(monkeypatch):
    for name in ("FDFLEET_BACKEND", "FDFLEET_HEADWISE_KV", "FDFLEET_LOG_LEVEL", "FDFLEET_MODEL_IMPL"):
        monkeypatch.delenv(name, raising=False)
    envs.check_all()  # all unset: fine
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", "fastdeploy")
    with pytest.raises(ValueError, match="FDFLEET_MODEL_IMPL='fastdeploy'"):
        envs.check_all()


def test_raw_values_follow_the_environment(monkeypatch):
    """Values for cache keys: equal while the variables are unchanged, different once one changes."""
    monkeypatch.delenv("FDFLEET_OWN_LAUNCHER", raising=False)
    monkeypatch.setenv("FDFLEET_DIRECT_LAUNCH", "on")
    a = envs.raw_values("FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER")
    assert a == envs.raw_values("FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER") and a[1] is None
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "off")
    b = envs.raw_values("FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER")
    assert b[0] == a[0] and b[1] is not None
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "on")
    assert envs.raw_values("FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER") != b
    monkeypatch.delenv("FDFLEET_OWN_LAUNCHER")
    assert envs.raw_values("FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER") == a


def test_own_launcher(monkeypatch):
    monkeypatch.delenv("FDFLEET_OWN_LAUNCHER", raising=False)
    assert envs.own_launcher() is True  # on by default
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "NO")
    assert envs.own_launcher() is False
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", " ")
    assert envs.own_launcher() is True  # empty counts as unset
    monkeypatch.setenv("FDFLEET_OWN_LAUNCHER", "ctypes")
    with pytest.raises(ValueError, match="FDFLEET_OWN_LAUNCHER='ctypes'"):
        envs.own_launcher()
    with pytest.raises(ValueError, match="FDFLEET_OWN_LAUNCHER"):
        envs.check_all()


def test_direct_launch(monkeypatch):
    monkeypatch.delenv("FDFLEET_DIRECT_LAUNCH", raising=False)
    assert envs.direct_launch() is True  # on by default
    monkeypatch.setenv("FDFLEET_DIRECT_LAUNCH", " Off ")
    assert envs.direct_launch() is False
    monkeypatch.setenv("FDFLEET_DIRECT_LAUNCH", "")
    assert envs.direct_launch() is True  # empty counts as unset
    monkeypatch.setenv("FDFLEET_DIRECT_LAUNCH", "fast")
    with pytest.raises(ValueError, match="FDFLEET_DIRECT_LAUNCH='fast'"):
        envs.direct_launch()
    with pytest.raises(ValueError, match="FDFLEET_DIRECT_LAUNCH"):
        envs.check_all()  # the CLI refuses it before any command


# ---- one registry, parsed at import whatever the backend (issue 30 item 5) -----------------------------

import importlib.util  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter (a fresh import of the package), ``env`` added to a
    copy of this environment without any FDFLEET_* variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FDFLEET_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", ["FDFLEET_DIRECT_LAUNCH", "FDFLEET_OWN_LAUNCHER"])
def test_launch_switches_are_parsed_at_import_under_the_interpreter(name):
    """Under ``TRITON_INTERPRET=1`` nothing launches directly, so these two were never parsed and a
    bad value passed silently: importing the env module refuses it by name."""
    r = _child("import fastdeploy_paddlefleet.envs", TRITON_INTERPRET="1", **{name: "fast"})
    assert r.returncode != 0 and f"{name}='fast'" in r.stderr and "ValueError" in r.stderr, r.stderr[-2000:]


def test_the_kernels_refuse_a_bad_switch_at_import_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (the kernels' import)")
    code = "import fastdeploy_paddlefleet.kernels.paged_attention"
    r = _child(code, TRITON_INTERPRET="1", FDFLEET_DIRECT_LAUNCH="fast")
    assert r.returncode != 0 and "FDFLEET_DIRECT_LAUNCH='fast'" in r.stderr, r.stderr[-2000:]
    assert _child(code, TRITON_INTERPRET="1", FDFLEET_DIRECT_LAUNCH="off").returncode == 0


def test_a_misspelt_name_is_warned_about_once_naming_the_close_match():
    code = (
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "import fastdeploy_paddlefleet.envs as e\n"
        "e.warn_unknown(); e.check_all(); e.warn_unknown()\n"
    )
    r = _child(code, FDFLEET_KV_RECYCEL="off")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "FDFLEET_KV_RECYCEL" in line]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("WARNING") and "did you mean FDFLEET_KV_RECYCLE?" in lines[0]


def test_an_unknown_name_without_a_close_match_says_so():
    r = _child("import fastdeploy_paddlefleet.envs", FDFLEET_ZZZ="1")
    assert r.returncode == 0 and r.stderr.count("FDFLEET_ZZZ") == 1, r.stderr
    assert "no known variable is close" in r.stderr


def test_test_and_ci_names_are_known_not_warned_about():
    names = {"FDFLEET_HOST_FASTDEPLOY": "/x", "FDFLEET_HOST_PADDLEFLEET": "/y", "FDFLEET_TRITON36_SITE": "/z"}
    r = _child("import fastdeploy_paddlefleet.envs", **names)
    assert r.returncode == 0 and "FDFLEET" not in r.stderr, r.stderr


def test_every_fdfleet_name_in_the_sources_tests_and_ci_is_registered():
    """envs.VARIABLES is the one registry: every FDFLEET_* name src/, tests/ or .ci/ reads is in it
    (names tests only make up to check the parsers are listed here)."""
    made_up = {"FDFLEET_SOMETHING", "FDFLEET_TEST_A", "FDFLEET_TEST_B", "FDFLEET_TEST_C", "FDFLEET_TEST_D"}
    made_up |= {"FDFLEET_HOST_"}
    made_up |= {"FDFLEET_KV_RECYCEL", "FDFLEET_ZZZ"}
    found = set()
    for folder in ("src", "tests", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", "") and "__pycache__" not in path.parts:
                found |= set(
                    re.findall(r"FDFLEET_[A-Z0-9_]+", path.read_text(encoding="utf-8", errors="replace"))
                )
    assert found - made_up - set(envs.VARIABLES) == set()


@pytest.mark.parametrize("argv", [["--version"], ["plan", "tiny"], ["modeldir", "--help"]], ids=" ".join)
def test_a_bad_switch_exits_2_from_every_cli_entry_but_help(argv):
    """``FDFLEET_HEADWISE_KV=maybe fdfleet --version`` printed the version (exit 0): exit 2 and one
    line naming the variable; ``--help`` still prints."""
    code = f"import sys; from fastdeploy_paddlefleet.cli import main; sys.exit(main({argv!r}))"
    r = _child(code, FDFLEET_HEADWISE_KV="maybe")
    if "--help" in argv:
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr
        return
    lines = [line for line in r.stderr.splitlines() if line.startswith("fdfleet")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "FDFLEET_HEADWISE_KV='maybe'" in lines[0] and "Traceback" not in r.stderr
