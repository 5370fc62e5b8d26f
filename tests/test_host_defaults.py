"""README's test command finds the hosts where README's instructions put them.

``.ci/run`` used to be the only place that pointed ``FDFLEET_HOST_FASTDEPLOY`` /
``FDFLEET_HOST_PADDLEFLEET`` at ``~/.cache/fdfleet-hosts/...``: a user running the Quickstart's
command with those folders filled skipped every host test. With the variables unset the tests look
there themselves; with the folders empty they still skip, naming the variable.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HOSTS = Path(__file__).resolve().parent / "hosts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_host_defaults_{name}", HOSTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("FDFLEET_HOST_FASTDEPLOY", "FDFLEET_HOST_PADDLEFLEET"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_fastdeploy_host_defaults_to_the_readme_folder(home, monkeypatch):
    fd = _load("_fastdeploy_host")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no installed fastdeploy
    reason = fd.locate_host()
    assert isinstance(reason, str) and "FDFLEET_HOST_FASTDEPLOY" in reason, reason
    package = home / ".cache" / "fdfleet-hosts" / "fastdeploy" / "fastdeploy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    host = fd.locate_host()
    assert not isinstance(host, str), host
    assert Path(host.path) == package.parent.resolve()
    monkeypatch.setenv("FDFLEET_HOST_FASTDEPLOY", str(home / "elsewhere"))  # the variable still wins
    assert isinstance(fd.locate_host(), str)


def test_paddlefleet_host_defaults_to_the_readme_folder(home, monkeypatch):
    pytest.importorskip("paddle", reason="tests/hosts/_paddlefleet_host.py imports paddle")
    pf = _load("_paddlefleet_host")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no installed paddlefleet
    monkeypatch.delitem(sys.modules, "paddlefleet", raising=False)
    host, reason = pf.locate_host()
    assert host is None and "FDFLEET_HOST_PADDLEFLEET" in reason, reason
    src = home / ".cache" / "fdfleet-hosts" / "paddlefleet" / "src"
    (src / "paddlefleet" / "transformer").mkdir(parents=True)
    (src / "paddlefleet" / "transformer" / "utils.py").write_text("")
    host, reason = pf.locate_host()
    assert host is not None and host.root == src, reason
    monkeypatch.setenv("FDFLEET_HOST_PADDLEFLEET", str(home / "elsewhere"))
    assert pf.locate_host()[0] is None
