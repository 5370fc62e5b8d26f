"""Every extra of ``pyproject.toml`` resolves beside FastDeploy's requirements (issue 33).

FastDeploy pins ``transformers>=4.55.1,<5.0.0`` and ``paddleformers>=1.1.1``; an extra that pins
against them (``paddleformers==1.2.0`` needs ``transformers>=5``) makes ``pip install ".[verify,
paddleformers]"`` fail in a FastDeploy environment. One ``pip install --dry-run --ignore-installed``
resolves the requirements of all extras together with FastDeploy's lines
(``tests/data/fastdeploy_requirements.txt``, from the FastDeploy commit named in it): where the union
resolves, each extra does beside FastDeploy, alone or with the others. On a conflict the test fails with
pip's explanation and the extras that name each package in it. Needs the package index: skipped, with
the reason, where pip cannot reach it. About 40 s with pip's cache warm (a first run downloads the
metadata of ~200 packages).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FASTDEPLOY_REQUIREMENTS = ROOT / "tests" / "data" / "fastdeploy_requirements.txt"
#: pip's words for an index it could not reach (as opposed to a resolution that has no answer)
NETWORK = (
    "NewConnectionError",
    "Max retries exceeded",
    "Could not fetch URL",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "SSLError",
    "connection broken",
)


def extras() -> dict[str, list[str]]:
    """``[project.optional-dependencies]`` of ``pyproject.toml``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11) or tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def fastdeploy_lines() -> list[str]:
    """FastDeploy's requirement lines kept in ``tests/data`` (comments and blank lines dropped)."""
    lines = []
    for raw in FASTDEPLOY_REQUIREMENTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def _name(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if m is None:
        raise ValueError(f"requirement {requirement!r}: no project name")
    return re.sub(r"[-_.]+", "-", m[1]).lower()


def test_fastdeploy_requirements_file():
    """The kept lines name their FastDeploy commit and hold nothing pip cannot take from an index."""
    text = FASTDEPLOY_REQUIREMENTS.read_text()
    assert re.search(r"commit\s*\n?#?\s*[0-9a-f]{40}", text), "the FastDeploy commit the lines came from"
    lines = fastdeploy_lines()
    assert len(lines) > 40
    assert not [line for line in lines if "@" in line or "://" in line], "URL requirements are left out"
    names = {_name(line) for line in lines}
    assert {"transformers", "paddleformers", "triton", "fastapi"} <= names
    assert "transformers>=4.55.1,<5.0.0" in lines and "paddleformers>=1.1.1" in lines


def test_extras_are_what_the_readme_installs():
    """The extras the README and ``.ci/run`` name exist (a renamed extra would make pip warn, not fail)."""
    have = set(extras())
    readme = (ROOT / "README.md").read_text() + (ROOT / ".ci" / "run").read_text()
    named = set()
    for group in re.findall(r'"\.\[([a-z,]+)\]"', readme):
        named.update(group.split(","))
    assert named and named <= have, named - have


def _owners(package: str, groups: dict[str, list[str]]) -> list[str]:
    return [extra for extra, reqs in groups.items() if any(_name(r) == package for r in reqs)]


def _conflict(out: str, groups: dict[str, list[str]]) -> str:
    """pip's explanation of a conflict (from its ``Cannot install`` line, warnings left out) and the
    extras that name each package in it."""
    lines = [line for line in out.splitlines() if not line.startswith("WARNING")]
    start = next((i for i, line in enumerate(lines) if "Cannot install" in line), max(0, len(lines) - 30))
    text = "\n".join(lines[start:])
    named = set()
    m = re.search(r"Cannot install (.*?) because", text)
    if m:
        named.update(_name(part) for part in m[1].split(" and ") if re.match(r"\s*[A-Za-z]", part))
    named.update(_name(r) for r in re.findall(r"^\s+The user requested (\S+)", text, re.M))
    named.update(_name(r) for r in re.findall(r"^\s+(\S+) \S+ depends on", text, re.M))
    owners = {p: _owners(p, groups) for p in sorted(named) if _owners(p, groups)}
    return (
        "the extras do not resolve beside FastDeploy's lines (tests/data/fastdeploy_requirements.txt): "
        f"extras naming the packages in the conflict: {owners}\n{text[-3000:]}"
    )


@pytest.mark.slow
def test_every_extra_resolves_beside_fastdeploy(tmp_path):
    groups = extras()
    union = sorted({r for reqs in groups.values() for r in reqs})
    report = tmp_path / "report.json"
    # not --quiet: it hides pip's "The conflict is caused by" lines; the extras' lines as arguments, so
    # that pip names them in a conflict (a file's lines it names by line number)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--retries", "2", "--timeout", "30", "--report", str(report),
           *union, "-r", str(FASTDEPLOY_REQUIREMENTS)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("pip did not resolve within 600 s (a slow or unreachable package index)")
    out = proc.stdout  # pip's explanation (stdout) between its errors (stderr), in order
    if proc.returncode != 0:
        if "ResolutionImpossible" in out or "conflicting dependencies" in out:
            pytest.fail(_conflict(out, groups))
        if any(word in out for word in NETWORK):  # (a package missing from a reachable index fails)
            why = next(line for line in out.splitlines() if any(word in line for word in NETWORK))
            pytest.skip(f"the package index is unreachable: {why.strip()[:300]}")
        pytest.fail(f"pip install --dry-run failed (exit {proc.returncode}):\n{out[-4000:]}")
    installed = {
        _name(i["metadata"]["name"]): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    # the pins of FastDeploy that the extras once contradicted hold in the answer
    assert installed["transformers"].split(".")[0] == "4", installed["transformers"]
    pf = tuple(int(x) for x in installed["paddleformers"].split(".")[:3])
    assert pf >= (1, 1, 1), installed["paddleformers"]
    print(
        f"{len(installed)} packages; "
        + ", ".join(
            f"{p} {installed[p]}"
            for p in ("paddleformers", "transformers", "triton", "torch")
            if p in installed
        )
    )
