"""One preset registry: README's list and the commands' help all name the presets the package ships.

README listed 7 presets, ``fdfleet plan --help`` 9, and ``fdfleet verify`` / ``fdfleet modeldir``
help said "tiny, tiny-mla" while four minifleet presets ship. The shipped ``*.json`` files are read
here directly (the independent fact); the help texts come from ``presets.minifleet_presets``.
``fdfleet verify --model`` says which checkpoints it takes, and a directory's load shows a bar.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = ROOT / "src" / "fastdeploy_paddlefleet" / "presets"
CLI = [sys.executable, "-m", "fastdeploy_paddlefleet.cli"]


def shipped() -> dict[str, str]:
    """preset name -> model_type, from the files themselves."""
    return {p.stem: json.loads(p.read_text())["model_type"] for p in sorted(PRESET_DIR.glob("*.json"))}


def help_text(*argv: str) -> str:
    r = subprocess.run([*CLI, *argv, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())  # argparse wraps lines


def test_readme_lists_every_shipped_preset():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (line,) = re.findall(r"Presets \(documented shapes, no weights\):(.*?)(?:;|\.\n)", readme, re.S)
    assert sorted(re.findall(r"`([^`]+)`", line)) == sorted(shipped())


def test_the_registry_names_the_minifleet_presets():
    from fastdeploy_paddlefleet.presets import list_presets, minifleet_presets

    assert list_presets() == sorted(shipped())
    assert minifleet_presets() == sorted(n for n, t in shipped().items() if t == "minifleet")


@pytest.mark.parametrize("command", ["verify", "modeldir"])
def test_help_names_every_minifleet_preset(command):
    text = help_text(command)
    minifleet = sorted(n for n, t in shipped().items() if t == "minifleet")
    assert ", ".join(minifleet) in text, text
    for name, model_type in shipped().items():
        if model_type != "minifleet":  # plan's presets are not offered where they cannot be built
            assert name not in text, (name, text)


def test_verify_model_help_says_what_it_takes():
    from fastdeploy_paddlefleet.runner.paddleformers_case import ARCHITECTURES

    text = help_text("verify")
    options = text[text.index("options:") :]
    model = options[options.index("--model DIR") :]
    model = model[: model.index("--config")]
    assert "config.json" in model and "safetensors" in model and "minifleet" in model, model
    for arch in ARCHITECTURES:
        assert arch in model, (arch, model)


def test_loading_a_model_directory_shows_a_bar(tmp_path, monkeypatch):
    pytest.importorskip("paddle", reason="building the model needs paddle")
    pytest.importorskip("safetensors", reason="the verify extra")
    from fastdeploy_paddlefleet.runner import checkpoint_case
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    d = Path(write_model_dir("tiny", tmp_path / "tiny", dtype="float32", seed=0))
    files = sorted(p.name for p in d.glob("*.safetensors"))
    bars = []

    class Bar:
        def __init__(self, total, desc, enabled, unit="step"):
            self.total, self.enabled, self.unit, self.done, self.closed = total, enabled, unit, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(checkpoint_case, "progress_bar", Bar)
    checkpoint_case.build_checkpoint_case(d, "reference", 0, progress=True)
    (bar,) = bars
    assert (bar.total, bar.done, bar.unit, bar.enabled, bar.closed) == (
        len(files),
        len(files),
        "file",
        True,
        True,
    )
