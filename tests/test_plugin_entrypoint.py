"""The FastDeploy entry point, found through real entry-point discovery."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import pytest


def test_entry_point_registers_nothing_without_fastdeploy(caplog):
    if importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("fastdeploy is installed; this test covers its absence")
    eps = importlib.metadata.entry_points(group="fastdeploy.model_register_plugins")
    ours = [ep for ep in eps if ep.name == "paddlefleet"]
    assert len(ours) == 1, [ep.name for ep in eps]
    assert ours[0].value == "fastdeploy_paddlefleet.serving.entry_points:register"
    register = ours[0].load()
    with caplog.at_level(logging.INFO, logger="fastdeploy_paddlefleet"):
        assert register() is False
    records = [r for r in caplog.records if r.name.startswith("fastdeploy_paddlefleet")]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "fastdeploy" in records[0].getMessage()


def test_log_level_switch_applies_to_the_package_logger(monkeypatch):
    from fastdeploy_paddlefleet.serving import entry_points as plugin

    pkg = logging.getLogger("fastdeploy_paddlefleet")
    before = pkg.level
    try:
        monkeypatch.setenv("FDFLEET_LOG_LEVEL", "debug")
        plugin.register()
        assert pkg.level == logging.DEBUG
        monkeypatch.setenv("FDFLEET_LOG_LEVEL", "chatty")
        with pytest.raises(ValueError, match="FDFLEET_LOG_LEVEL"):
            plugin.register()
    finally:
        pkg.setLevel(before)
