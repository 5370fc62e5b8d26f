"""Which room may import what (docs/architecture.md), checked on the source tree itself.

* only ``serving/`` imports FastDeploy (``import fastdeploy``, ``from fastdeploy...``, or a
  module name string handed to ``importlib.import_module`` / ``find_spec``);
* ``plan/`` is stdlib-only;
* the core (plan, envs, cache layout, ``fdfleet plan``) imports nothing heavy when it runs;
* every ``kernels/`` module imports without paddle.

The rules read the syntax tree (every import, at any depth), so a lazy import inside a
function counts the same as one at the top.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fastdeploy_paddlefleet"
HEAVY = ("paddle", "torch", "triton", "numpy", "paddleformers")
_IMPORT_CALLS = {"import_module", "find_spec", "__import__"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute or relative module name)`` of every import in ``path``.

    Relative imports keep their leading dots (``..plan.layer``); a string literal passed to
    ``importlib.import_module`` / ``importlib.util.find_spec`` / ``__import__`` counts as an import.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _IMPORT_CALLS and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
    return found


def _root(module: str) -> str:
    return module.split(".", 1)[0]


def fastdeploy_imports_outside_serving(package: Path) -> list[str]:
    """``file:line module`` for every FastDeploy import outside ``package/serving/``."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "serving":
            continue
        for line, module in imported_modules(path):
            if not module.startswith(".") and _root(module) == "fastdeploy":
                bad.append(f"{rel}:{line} {module}")
    return bad


def non_stdlib_imports(room: Path, siblings: tuple[str, ...] = ()) -> list[str]:
    """``file:line module`` for every import in ``room`` that is neither stdlib, inside ``room``,
    nor one of the package's ``siblings`` (rooms held to the same rule)."""
    bad = []
    for path in sorted(room.rglob("*.py")):
        rel = path.relative_to(room)
        depth = len(rel.parts)  # a relative import with more dots than this leaves the room
        for line, module in imported_modules(path):
            if module.startswith("."):
                dots = len(module) - len(module.lstrip("."))
                target = module.lstrip(".").split(".", 1)[0]
                if dots <= depth or (dots == depth + 1 and target in siblings):
                    continue
                bad.append(f"{room.name}/{rel}:{line} {module}")
            elif module != "__future__" and _root(module) not in sys.stdlib_module_names:
                bad.append(f"{room.name}/{rel}:{line} {module}")
    return bad


def test_only_serving_imports_fastdeploy():
    bad = fastdeploy_imports_outside_serving(PACKAGE)
    assert not bad, "FastDeploy is imported outside serving/: " + ", ".join(bad)


def test_serving_is_where_fastdeploy_is_imported():
    """The rule is not vacuous: serving/ does import FastDeploy (lazily)."""
    serving = [m for p in (PACKAGE / "serving").rglob("*.py") for _, m in imported_modules(p)]
    assert any(_root(m) == "fastdeploy" for m in serving)


def test_plan_is_stdlib_only():
    """plan/ and the presets it reads (JSON files through importlib.resources) are stdlib-only."""
    bad = non_stdlib_imports(PACKAGE / "plan", siblings=("presets",)) + non_stdlib_imports(
        PACKAGE / "presets"
    )
    assert not bad, "plan/ must import the standard library only: " + ", ".join(bad)


def test_the_rules_name_a_stray_import(tmp_path):
    """A stray FastDeploy import outside serving/ and a numpy import in plan/ are named by file."""
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "ok.py").write_text("import fastdeploy\n")
    (tmp_path / "runner").mkdir()
    (tmp_path / "runner" / "stray.py").write_text("def f():\n    from fastdeploy.config import FDConfig\n")
    (tmp_path / "cli.py").write_text("import importlib\nimportlib.import_module('fastdeploy.engine')\n")
    assert fastdeploy_imports_outside_serving(tmp_path) == [
        "cli.py:2 fastdeploy.engine",
        "runner/stray.py:2 fastdeploy.config",
    ]
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "layer.py").write_text("import json\nfrom .config import x\nimport numpy\nfrom ..envs import y\n")
    assert non_stdlib_imports(plan) == ["plan/layer.py:3 numpy", "plan/layer.py:4 ..envs"]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_core_imports_are_light():
    """The core (plan, envs, cache layout, ``fdfleet plan``) imports nothing heavy when it runs."""
    code = (
        "import sys, json\n"
        "import fastdeploy_paddlefleet.plan, fastdeploy_paddlefleet.envs, fastdeploy_paddlefleet.serving\n"
        "import fastdeploy_paddlefleet.kvcache.layout, fastdeploy_paddlefleet.cli.plan\n"
        "from fastdeploy_paddlefleet.cli import main\n"
        "main(['plan', 'tiny', '--json'])\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def _kernel_modules() -> list[str]:
    """Every module under kernels/, sub-packages (``kernels/launch/``) included, by dotted name."""
    names = []
    for p in (PACKAGE / "kernels").rglob("*.py"):
        parts = p.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.append(".".join(("fastdeploy_paddlefleet", *parts)))
    return sorted(names)


def test_kernel_modules_include_the_launch_package():
    assert "fastdeploy_paddlefleet.kernels.launch.direct" in _kernel_modules()
    assert "fastdeploy_paddlefleet.kernels.launch" in _kernel_modules()


@pytest.mark.parametrize("name", _kernel_modules())
def test_kernel_modules_import_without_paddle(name):
    """Each kernels/ module imports with paddle absent (paddle is needed only at launch)."""
    pytest.importorskip("triton")
    code = f"import sys\nsys.modules['paddle'] = None\nimport {name}\nprint('ok')\n"
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"{name}: {r.stderr[-2000:]}"


def test_prefix_rule_is_stdlib_only():
    """``kvcache/prefix.py`` (window-aware prefix matching) imports the standard library only."""
    path = PACKAGE / "kvcache" / "prefix.py"
    bad = [
        f"{line} {m}"
        for line, m in imported_modules(path)
        if m.startswith(".") or (m != "__future__" and _root(m) not in sys.stdlib_module_names)
    ]
    assert not bad, "kvcache/prefix.py must import the standard library only: " + ", ".join(bad)
