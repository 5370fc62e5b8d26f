"""Run a scenario against FastDeploy's REAL code, each in a fresh child process.

FastDeploy loads its plugins once per process and the import order matters, so a
scenario never runs inside the pytest process: :func:`run_scenario` writes the
scenario's source to a file and runs it with ``python`` in a child process whose
``sys.path`` starts with the host.

Where the host comes from (:func:`locate_host`):

1. ``$FDFLEET_HOST_FASTDEPLOY``: a folder holding the ``fastdeploy`` package; it is put first on
   the child's ``sys.path`` (``PYTHONPATH``);
2. when the variable is unset or empty, :data:`HOST_DEFAULT` (``~/.cache/fdfleet-hosts/fastdeploy``,
   where README's instructions put it) if it holds the package;
3. otherwise an installed ``fastdeploy`` (``importlib.util.find_spec``);
4. otherwise :func:`host_or_skip` skips the test with a reason.

Stand-in modules. FastDeploy imports a few GPU-only third-party packages
(``deep_ep``, ``flash_mla``, ...). Its compiled custom ops are handled by
FastDeploy itself (it logs and goes on); a third-party package that is simply not
installable here gets an EMPTY module written into a temp folder that is
APPENDED to the child's ``sys.path`` (so a really installed package always wins).
Every stand-in offered, and every one the scenario actually imported, is printed
by :func:`run_scenario` (pytest shows it in the test's captured output, e.g. with
``-rP`` or on failure) and returned in :class:`ScenarioResult`. Pass
``stand_ins={"name": "source", ...}`` to offer others (source ``""`` = empty).

Writing a scenario. The script is plain Python run as ``__main__``. A prelude
defines ``report(**values)``: call it (any number of times) with JSON-serialisable
values; the merged values come back as ``ScenarioResult.data``. Example::

    from _fastdeploy_host import host_or_skip, run_scenario  # tests/hosts is on sys.path under pytest

    def test_something():
        host = host_or_skip()
        result = run_scenario(
            '''
            import fastdeploy
            from fastdeploy.engine.args_utils import EngineArgs
            report(model_impl=EngineArgs(model="m", model_impl="paddlefleet").model_impl)
            ''',
            host=host,
            env={"FD_PLUGINS": "paddlefleet"},
        )
        result.check()  # raises AssertionError with the child's output tail when it failed
        assert result.data["model_impl"] == ...

``FD_PLUGINS`` is NOT set by default (FastDeploy then loads no plugin): pass it in
``env``. Variables named ``FDFLEET_*`` and ``FD_PLUGINS`` of the parent are removed
from the child's environment first, so a scenario starts from a known state.
Keep scenarios fast (``import fastdeploy`` alone takes ~5 s on one core).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HOST_VAR = "FDFLEET_HOST_FASTDEPLOY"
#: where README ("Conformance tests against the hosts' real code") puts FastDeploy's sources
HOST_DEFAULT = "~/.cache/fdfleet-hosts/fastdeploy"
RESULT_MARK = "FDHOST_RESULT "
REPO_ROOT = Path(__file__).resolve().parents[2]

#: GPU-only third-party packages FastDeploy may import on the paths the scenarios take.
#: Each is offered as an empty module, used only when the real package is not importable.
DEFAULT_STAND_INS: dict[str, str] = {
    "deep_ep": "",
    "deep_gemm": "",
    "flash_mla": "",
    "flashinfer": "",
    "flash_mask": "",
}

_PRELUDE = r'''
import atexit as _fdhost_atexit
import json as _fdhost_json
import os as _fdhost_os
import sys as _fdhost_sys

_fdhost_standins = _fdhost_os.environ.get("FDHOST_STANDIN_DIR")
if _fdhost_standins:
    _fdhost_sys.path.append(_fdhost_standins)  # last: an installed package always wins


def report(**values):
    """Send JSON-serialisable values back to the test (merged over all calls)."""
    print("FDHOST_RESULT " + _fdhost_json.dumps(values, default=str), flush=True)


def _fdhost_list_standins():
    if not _fdhost_standins:
        return
    used = sorted(
        name for name, mod in list(_fdhost_sys.modules.items())
        if "." not in name and str(getattr(mod, "__file__", "") or "").startswith(_fdhost_standins)
    )
    print("FDHOST_STANDINS_IMPORTED " + _fdhost_json.dumps(used), flush=True)


_fdhost_atexit.register(_fdhost_list_standins)
'''


@dataclass(frozen=True)
class HostLocation:
    """Where FastDeploy's code comes from: ``path`` (put on ``sys.path``) or the installed package."""

    path: str | None
    description: str


def locate_host() -> HostLocation | str:
    """The host to test against, or a string saying why there is none."""
    value = os.environ.get(HOST_VAR, "").strip()
    if value:
        root = Path(value)
        if (root / "fastdeploy" / "__init__.py").is_file():
            return HostLocation(str(root.resolve()), f"{HOST_VAR}={root}")
        reason = f"{HOST_VAR}={value!r} holds no fastdeploy/__init__.py"
    else:
        root = Path(HOST_DEFAULT).expanduser()
        if (root / "fastdeploy" / "__init__.py").is_file():
            return HostLocation(str(root.resolve()), f"{HOST_DEFAULT} ({HOST_VAR} unset)")
        reason = f"{HOST_VAR} is not set and {HOST_DEFAULT} holds no fastdeploy/__init__.py"
    if importlib.util.find_spec("fastdeploy") is not None:
        spec = importlib.util.find_spec("fastdeploy")
        return HostLocation(None, f"installed fastdeploy ({spec.origin})")
    return f"no FastDeploy to test against: {reason} and no fastdeploy package is installed"


def host_or_skip() -> HostLocation:
    """:func:`locate_host`, or ``pytest.skip`` with the reason."""
    import pytest

    host = locate_host()
    if isinstance(host, str):
        pytest.skip(host)
    return host


@dataclass
class ScenarioResult:
    """What a scenario run gave back."""

    returncode: int
    stdout: str
    stderr: str
    data: dict = field(default_factory=dict)
    #: stand-in modules offered to the child (name -> "empty" or "source")
    stand_ins_offered: list[str] = field(default_factory=list)
    #: the stand-ins the scenario actually imported (top-level names)
    stand_ins_imported: list[str] = field(default_factory=list)
    host: str = ""

    def tail(self, chars: int = 6000) -> str:
        return f"--- stdout ---\n{self.stdout[-chars:]}\n--- stderr ---\n{self.stderr[-chars:]}"

    def check(self) -> ScenarioResult:
        """Raise ``AssertionError`` with the child's output when it exited non-zero."""
        if self.returncode != 0:
            raise AssertionError(f"scenario exited {self.returncode} against {self.host}\n{self.tail()}")
        return self


def _write_stand_ins(folder: Path, stand_ins: Mapping[str, str]) -> None:
    for name, source in stand_ins.items():
        parts = name.split(".")
        pkg = folder.joinpath(*parts)
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(textwrap.dedent(source))
        for i in range(1, len(parts)):  # parent packages of a dotted stand-in
            init = folder.joinpath(*parts[:i], "__init__.py")
            if not init.exists():
                init.write_text("")


def _child_env(host: HostLocation, standin_dir: str, env: Mapping[str, str] | None) -> dict[str, str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("FDFLEET_") and k != "FD_PLUGINS"}
    paths = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "tests" / "hosts")]  # test helpers importable
    if host.path:
        paths.insert(0, host.path)
    old = child.get("PYTHONPATH")
    child["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    child["FDHOST_STANDIN_DIR"] = standin_dir
    child.setdefault("TRITON_INTERPRET", "1")  # no GPU here: kernels (if any) interpreted
    child["PYTHONUNBUFFERED"] = "1"
    child["GLOG_minloglevel"] = "2"
    if env:
        child.update({k: str(v) for k, v in env.items()})
    return child


def run_scenario(
    script: str,
    *,
    host: HostLocation | None = None,
    env: Mapping[str, str] | None = None,
    argv: Sequence[str] = (),
    stand_ins: Mapping[str, str] | None = None,
    timeout: float = 180.0,
    cwd: str | None = None,
) -> ScenarioResult:
    """Run ``script`` (Python source, dedented) in a fresh child process against the host.

    ``env``: extra environment variables (e.g. ``{"FD_PLUGINS": "paddlefleet"}``).
    ``argv``: the child's ``sys.argv[1:]`` (argparse-at-import modules read it).
    ``stand_ins``: module name -> source, offered instead of :data:`DEFAULT_STAND_INS`
    (``None``) ; both are listed in the output. Returns a :class:`ScenarioResult`;
    call ``.check()`` to fail on a non-zero exit.
    """
    if host is None:
        host = host_or_skip()
    offered = dict(DEFAULT_STAND_INS if stand_ins is None else stand_ins)
    # a really installed package is never stood in for
    offered = {n: s for n, s in offered.items() if importlib.util.find_spec(n.split(".")[0]) is None}
    with tempfile.TemporaryDirectory(prefix="fdhost-") as tmp:
        standin_dir = os.path.join(tmp, "standins")
        os.mkdir(standin_dir)
        _write_stand_ins(Path(standin_dir), offered)
        path = os.path.join(tmp, "scenario.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_PRELUDE + "\n" + textwrap.dedent(script))
        proc = subprocess.run(
            [sys.executable, path, *argv],
            env=_child_env(host, standin_dir, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or tmp,
        )
    data: dict = {}
    imported: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            data.update(json.loads(line[len(RESULT_MARK) :]))
        elif line.startswith("FDHOST_STANDINS_IMPORTED "):
            imported = json.loads(line.split(" ", 1)[1])
    result = ScenarioResult(
        returncode=proc.returncode,
        stdout=proc.stdout,
        stderr=proc.stderr,
        data=data,
        stand_ins_offered=sorted(offered),
        stand_ins_imported=imported,
        host=host.description,
    )
    print(
        f"[fastdeploy host] {host.description}; stand-in modules offered (empty unless given): "
        f"{', '.join(result.stand_ins_offered) or 'none'}; imported by the scenario: "
        f"{', '.join(imported) or 'none'}"
    )
    return result
