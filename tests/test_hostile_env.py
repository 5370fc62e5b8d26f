"""Hostile environment switches: every bad ``FDFLEET_*`` value is refused by name, by every command
(``fdfleet plan`` too, which reads none of them), before any work starts; the getters parse strictly.
"""

from __future__ import annotations

import pytest

from fastdeploy_paddlefleet import envs
from fastdeploy_paddlefleet.cli import main

SWITCHES = {
    "FDFLEET_BACKEND": envs.backend_name,
    "FDFLEET_HEADWISE_KV": envs.headwise_kv,
    "FDFLEET_LOG_LEVEL": envs.log_level,
    "FDFLEET_MODEL_IMPL": envs.model_impl_is_paddlefleet,
}
if hasattr(envs, "prefill_kernel"):
    SWITCHES["FDFLEET_PREFILL_KERNEL"] = envs.prefill_kernel

BAD_VALUES = ["junk", "tru", "1.0", "auto auto", "trïton", "x" * 10_000, "\x7f"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


COMMANDS = [("plan", "tiny"), ("verify", "--steps", "0"), ("plan", "gpt-oss-20b", "--json")]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_every_command_refuses_every_bad_switch(capsys, monkeypatch, command, name):
    """``FDFLEET_BACKEND=junk fdfleet plan`` and ``FDFLEET_MODEL_IMPL=junk fdfleet verify`` ran."""
    monkeypatch.setenv(name, "junk")
    code, err = cli(capsys, *command)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert f"{name}='junk'" in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("value", BAD_VALUES, ids=range(len(BAD_VALUES)))
@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_getters_refuse_bad_values_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        SWITCHES[name]()
    assert name in str(e.value)
    with pytest.raises(ValueError, match=name):
        envs.check_all()


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
def test_empty_values_are_unset(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    SWITCHES[name]()  # the default, no error
    envs.check_all()


def test_good_values_pass_check_all(monkeypatch):
    monkeypatch.setenv("FDFLEET_BACKEND", " Reference ")
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "ON")
    monkeypatch.setenv("FDFLEET_LOG_LEVEL", "debug")
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", "PaddleFleet")
    envs.check_all()
    assert envs.backend_name() == "reference" and envs.headwise_kv() is True


def test_check_all_covers_every_getter():
    """A new switch must join check_all, or a bad value would pass every command unnoticed."""
    getters = {f.__name__ for f in envs._GETTERS}
    assert {f.__name__ for f in SWITCHES.values()} <= getters


def test_verify_flag_beats_env_but_a_bad_env_is_still_refused(capsys, monkeypatch):
    """``--headwise-kv`` on the command line does not excuse a malformed FDFLEET_HEADWISE_KV."""
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "maybe")
    code, err = cli(capsys, "verify", "--headwise-kv", "--steps", "0")
    assert code == 2 and "FDFLEET_HEADWISE_KV='maybe'" in err


def test_help_works_with_a_bad_switch(capsys, monkeypatch):
    """``--help`` is no command: it still prints (the error comes with the first real command)."""
    monkeypatch.setenv("FDFLEET_BACKEND", "junk")
    code, _ = cli(capsys, "--help")
    assert code == 0


@pytest.mark.parametrize("value", [1, 1.0, None, b"1"])
def test_parse_bool_non_strings(value):
    with pytest.raises(TypeError, match="FLAG"):
        envs.parse_bool("FLAG", value)
