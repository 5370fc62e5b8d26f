"""Every module, name and repository path the docs mention exists.

README.md and docs/*.md name modules (``fastdeploy_paddlefleet.serving.modeldir``, with an
attribute: ``fastdeploy_paddlefleet.kvcache.headwise.HeadwiseKVManager``) and files (``src/...``,
``tests/....py``, ``benchmarks/....py``, ``docs/....md``) in backticks; a rename left them pointing at
nothing. Modules are resolved to files under ``src/`` (nothing is imported: the heavy modules need
paddle or a GPU) and an attribute must be defined at the top level of its module's file.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CODE_SPAN = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"\bfastdeploy_paddlefleet(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"(?<![\w./-])((?:src/fastdeploy_paddlefleet|tests|benchmarks|docs)/[A-Za-z0-9_./-]*[\w/])")
#: the package's own subpackages and modules, named without the package (``kvcache.headwise.X``)
SUBPACKAGES = sorted(
    p.stem if p.suffix == ".py" else p.name
    for p in (ROOT / "src" / "fastdeploy_paddlefleet").iterdir()
    if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
)
RELATIVE = re.compile(rf"(?<![\w./-])((?:{'|'.join(SUBPACKAGES)})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])")


def _spans() -> list[tuple[str, int, str]]:
    """(doc, line, code span) for every inline code span and every line of a fenced block."""
    found = []
    for doc in DOCS:
        fenced = False
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            spans = [line] if fenced else CODE_SPAN.findall(line)
            found.extend((doc.name, n, span) for span in spans)
    return found


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if isinstance(node.value, ast.Dict):  # lazy exports: ``_LAZY = {"Name": ".module"}``
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # guarded definitions
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return frozenset(names)


def module_problem(dotted: str) -> str | None:
    """Why ``dotted`` (a module, optionally followed by one attribute and its attributes) names
    nothing, or ``None``."""
    parts = dotted.split(".")
    base = ROOT / "src"
    for i, part in enumerate(parts):
        package = base / part
        if (package / "__init__.py").is_file():
            base = package
            continue
        if (base / f"{part}.py").is_file():
            module_file, rest = base / f"{part}.py", parts[i + 1 :]
            break
        if i == 0 or not (base / "__init__.py").is_file():
            return f"no module {'.'.join(parts[: i + 1])}"
        module_file, rest = base / "__init__.py", parts[i:]
        break
    else:
        return None
    if rest and rest[0] not in _top_level_names(module_file):
        return f"{module_file.relative_to(ROOT)} defines no {rest[0]}"
    return None


def path_problem(path: str) -> str | None:
    if "*" in path or "..." in path:
        return None
    return None if (ROOT / path.rstrip("/.")).exists() else f"no {path}"


def _mentions() -> list[tuple[str, str]]:
    mentions = []
    for doc, line, span in _spans():
        for dotted in MODULE.findall(span):
            mentions.append((f"{doc}:{line}", dotted))
        for dotted in RELATIVE.findall(MODULE.sub("", span)):
            if not re.search(r"\.(py|md|json|txt)$", dotted):  # a file name, not a module
                mentions.append((f"{doc}:{line}", f"fastdeploy_paddlefleet.{dotted}"))
        for path in PATH.findall(span):
            if path.startswith("src/") or re.search(r"\.(py|md)$", path) or path.endswith("/"):
                mentions.append((f"{doc}:{line}", path))
    return mentions


def test_the_docs_mention_names():
    """The scan itself finds what it should (else the test below checks nothing)."""
    mentioned = {name for _, name in _mentions()}
    assert "src/fastdeploy_paddlefleet/envs.py" in mentioned
    assert any(name.startswith("fastdeploy_paddlefleet.") for name in mentioned)


def test_the_resolver_tells_names_from_stale_ones():
    assert module_problem("fastdeploy_paddlefleet.serving.modeldir") is None
    assert module_problem("fastdeploy_paddlefleet.envs.Variable") is None
    assert module_problem("fastdeploy_paddlefleet.serving.no_such_module") is not None
    assert module_problem("fastdeploy_paddlefleet.envs.NoSuchName") is not None
    assert path_problem("tests/test_docs_names.py") is None
    assert path_problem("tests/test_no_such_file.py") is not None


@pytest.mark.parametrize("doc", [d.name for d in DOCS])
def test_every_mentioned_name_exists(doc):
    problems = []
    for where, name in _mentions():
        if not where.startswith(f"{doc}:"):
            continue
        problem = module_problem(name) if name.startswith("fastdeploy_paddlefleet") else path_problem(name)
        if problem:
            problems.append(f"{where}: `{name}`: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("argv", [["--version"], ["--version", "--json"]])
def test_every_command_checks_the_variables(argv):
    """README: a bad ``FDFLEET_*`` value makes every ``fdfleet`` command, ``--version`` too, exit 2
    with one line naming the variable and the value."""
    env = {**os.environ, "FDFLEET_HEADWISE_KV": "maybe"}
    r = subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and "FDFLEET_HEADWISE_KV" in lines[0] and "'maybe'" in lines[0], r.stderr
