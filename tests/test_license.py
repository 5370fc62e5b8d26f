"""The licence pyproject declares is in the repository and in every built distribution.

pyproject says Apache-2.0; the sdist and the wheel must carry the licence's text (``LICENSE``), not
only its name. The distributions are built here with the installed setuptools, from a copy of the
files they are made of, so the checkout gets no ``build/`` or ``*.egg-info``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_license_file_is_apache_2():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
    assert "The fastdeploy-paddlefleet authors" in text.splitlines()[0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    assert "LICENSE" in project["license-files"]


@pytest.mark.slow
def test_sdist_and_wheel_carry_the_license(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "proj"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "out"
    out.mkdir()
    code = (
        "import sys; from setuptools import build_meta as b; out = sys.argv[1]; "
        "print(b.build_sdist(out)); print(b.build_wheel(out))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    built = sorted(p.name for p in out.iterdir())
    sdists = [out / n for n in built if n.endswith(".tar.gz")]
    wheels = [out / n for n in built if n.endswith(".whl")]
    assert len(sdists) == 1 and len(wheels) == 1, (built, r.stdout[-2000:])
    sdist, wheel = sdists[0], wheels[0]
    license_text = (ROOT / "LICENSE").read_bytes()
    with tarfile.open(sdist) as tar:
        names = [m.name for m in tar.getmembers() if m.name.endswith("/LICENSE")]
        assert names, "sdist has no LICENSE"
        assert tar.extractfile(min(names, key=len)).read() == license_text
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith("/LICENSE") and ".dist-info/" in n]
        assert names, f"wheel has no LICENSE in its .dist-info: {whl.namelist()[-10:]}"
        assert whl.read(names[0]) == license_text
        metadata = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = whl.read(metadata).decode()
        assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
