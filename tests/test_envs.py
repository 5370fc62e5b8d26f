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
