"""The serving modules import one another without a cycle (issue 30 item 7).

``registration`` used to import ``model``, ``pretrained`` and the scheduler hook while they imported
``registration`` back for the architecture name and the routing rule; those names now live in
``serving/names.py``, which imports nothing from ``serving``. Checked two ways:

* on the syntax tree: every import among ``serving/`` modules, at any depth (a lazy import inside a
  function counts), forms a graph without a cycle; the checker finds a cycle planted in a scratch
  package, so a pass means something;
* in a fresh interpreter: each module of the old cycle (and ``names``, ``entry_points``) imported
  first, then every other serving module, imports cleanly.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "src" / "fastdeploy_paddlefleet" / "serving"
PACKAGE = "fastdeploy_paddlefleet.serving"


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package_dir`` (a package's ``__init__`` by the
    package's name)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((package, *parts))] = path
    return out


def _absolute(current: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``current``."""
    parts = current.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def import_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere in its source (``import a.b``,
    ``from .a import b`` where ``b`` is a module or a name in ``a``)."""
    modules = module_names(package_dir, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = (
                    _absolute(name, path.name == "__init__.py", node.level, node.module)
                    if node.level
                    else node.module or ""
                )
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        edges.add(f"{base}.{alias.name}")
                    elif base in modules:
                        edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None`` (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_checker_finds_a_planted_cycle(tmp_path):
    """A scratch package where ``a`` imports ``b`` at the top and ``b`` imports ``a`` inside a
    function (the lazy form the old registration used), and ``c`` through ``from . import``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import NAME\n")
    (pkg / "b.py").write_text("NAME = 1\n\ndef later():\n    from .sub.c import f\n    return f\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from .. import a\n    return a\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c"}
    (pkg / "sub" / "c.py").write_text("def f():\n    return 1\n")  # the cycle broken: none found
    assert find_cycle(import_graph(pkg, "pkg")) is None


def test_serving_modules_have_no_import_cycle():
    graph = import_graph(SERVING, PACKAGE)
    assert f"{PACKAGE}.registration" in graph and f"{PACKAGE}.kv_recycling.scheduler" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among serving modules: " + " -> ".join(cycle or [])


def test_names_imports_nothing_from_serving():
    """``serving/names.py`` is the home below every serving module: it imports none of them."""
    assert import_graph(SERVING, PACKAGE)[f"{PACKAGE}.names"] == set()
    tree = ast.parse((SERVING / "names.py").read_text(encoding="utf-8"))
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1]
    assert relative == []


def test_shared_names_have_one_home():
    """``registration`` and the modules that answer to its names use the very objects of ``names``."""
    pytest.importorskip("paddle", reason="serving.model and serving.pretrained import paddle")
    from fastdeploy_paddlefleet.serving import model, names, pretrained, registration
    from fastdeploy_paddlefleet.serving.kv_recycling import scheduler

    assert registration.ARCHITECTURE is names.ARCHITECTURE == "PaddleFleetForCausalLM"
    assert registration._wants_paddlefleet is names.wants_paddlefleet is scheduler._wants_paddlefleet
    assert model.ARCHITECTURE is pretrained.ARCHITECTURE is names.ARCHITECTURE
    assert model.RL_ARCHITECTURE == registration.RL_ARCHITECTURE == "PaddleFleetForCausalLMRL"


_ALL = sorted(module_names(SERVING, PACKAGE))
#: the modules of the old cycle, and the two that start an import in production
_FIRST = [
    f"{PACKAGE}.{m}"
    for m in (
        "entry_points",
        "kv_recycling.scheduler",
        "model",
        "model_runner.runner",
        "names",
        "pretrained",
        "registration",
    )
]


@pytest.mark.parametrize("first", _FIRST)
def test_each_serving_module_imports_first_in_a_fresh_interpreter(first):
    """``first`` imported before any other serving module, then every other one: no partially
    initialised module is ever read (the failure an import cycle gives depending on the order)."""
    others = [m for m in _ALL if m != first]
    code = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        f"for name in {[first, *others]!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name and e.name.split('.')[0] in ('paddle', 'numpy', 'paddleformers'):\n"
        "            print('SKIP', name, e.name); sys.exit(0)\n"
        "        raise\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(f"needs {last.split()[-1]} to import {last.split()[1]}")
    assert last == "ok"
