"""A config too large for memory is refused by name before anything is allocated (issue 30 item 5).

``fdfleet verify --config`` with ``hidden_size`` 10**7 tried to allocate tens of GB and exited 70
("internal error"): :func:`plan.weights.check_fits` estimates the weights from the config (the plan's
per-layer heads and dims, embeddings, MLP / experts, norms, LM head) and refuses with exit 2, naming
the estimate and the available memory. The estimate is exact for every minifleet preset.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest

from fastdeploy_paddlefleet.plan import weights
from fastdeploy_paddlefleet.plan.weights import ModelTooLargeError, check_fits, estimate_weights
from fastdeploy_paddlefleet.presets import list_presets, load_preset

CLI = [sys.executable, "-m", "fastdeploy_paddlefleet.cli"]
#: 10**7 hidden and 10**6 FFN: ~10**14 bytes, more than any machine this runs on
HUGE = {
    "model_type": "minifleet",
    "vocab_size": 256,
    "hidden_size": 10**7,
    "ffn_hidden_size": 10**6,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
MINIFLEET = [n for n in list_presets() if load_preset(n).get("model_type") == "minifleet"]


@pytest.fixture
def huge_config(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(HUGE))
    return path


def _refused_quickly(argv: list[str]) -> str:
    start = time.monotonic()
    r = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    lines = [line for line in r.stderr.splitlines() if line.startswith("fdfleet")]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert took < 5, f"took {took:.1f} s"
    return lines[0]


def test_verify_refuses_a_huge_minifleet_config_at_once(huge_config):
    line = _refused_quickly(["verify", "--config", str(huge_config), "--steps", "0"])
    need = 2 * estimate_weights(HUGE).bytes("float32")
    assert "--config" in line and str(huge_config) in line, line
    assert f"{need} bytes" in line and "MemAvailable" in line, line


def test_verify_refuses_a_huge_paddleformers_config_at_once(huge_config, tmp_path):
    raw = {**HUGE, "model_type": "llama", "intermediate_size": 10**6, "architectures": ["LlamaForCausalLM"]}
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(raw))
    line = _refused_quickly(["verify", "--paddleformers", "llama", "--config", str(path), "--steps", "0"])
    assert "bytes" in line and str(path) in line, line


@pytest.mark.parametrize("name", MINIFLEET)
def test_the_estimate_is_exact_for_every_minifleet_preset(name):
    pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.minifleet import build_minifleet

    model = build_minifleet(name)
    actual = sum(int(p.numel()) for p in model.parameters())
    assert estimate_weights(load_preset(name)).params == actual


@pytest.mark.parametrize(
    "name,low,high",
    [("deepseek-v3", 660e9, 690e9), ("gpt-oss-20b", 20e9, 22e9), ("gemma3-27b", 26e9, 28.5e9)],
)
def test_real_model_estimates_are_their_published_sizes(name, low, high):
    """MLA (deepseek-v3), MoE with experts and sinks (gpt-oss), sliding layers (gemma3)."""
    assert low <= estimate_weights(load_preset(name)).params <= high


def test_check_fits_names_estimate_and_memory():
    with pytest.raises(ModelTooLargeError) as e:
        check_fits(HUGE, copies=2, dtype="float32", available=64 * 2**30, what="X")
    assert isinstance(e.value, ValueError)
    assert f"{2 * estimate_weights(HUGE).bytes(4)} bytes" in str(e.value) and f"{64 * 2**30} bytes" in str(
        e.value
    )
    tiny = load_preset("tiny")
    assert check_fits(tiny, copies=2, available=2**30) == estimate_weights(tiny).bytes(4)
    # the margin: weights that fill the memory entirely leave nothing for activations
    size = estimate_weights(tiny).bytes(4)
    with pytest.raises(ModelTooLargeError):
        check_fits(tiny, available=size)


def test_unknown_memory_is_not_checked(monkeypatch):
    monkeypatch.setattr(weights, "available_memory", lambda: None)
    assert check_fits(HUGE) == estimate_weights(HUGE).bytes(4)


def test_available_memory_reads_memavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_cgroup_room", lambda: None)
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000 kB\nMemFree:   10 kB\nMemAvailable:     2048 kB\n")
    assert weights.available_memory(str(info)) == 2048 * 1024
    missing = weights.available_memory(str(tmp_path / "none"))  # the fallback: free physical pages
    assert missing is None or missing > 0
    monkeypatch.setattr(weights, "_cgroup_room", lambda: 1024)
    assert weights.available_memory(str(info)) == 1024  # a cgroup limit bounds it


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("paddle.float32", 4), (None, 4), (1, 1)])
def test_dtype_bytes(dtype, size):
    assert weights.dtype_bytes(dtype) == size


@pytest.mark.parametrize("dtype", ["int3", 3, True])
def test_dtype_bytes_refuses(dtype):
    with pytest.raises(
        (ValueError, TypeError), match=repr(dtype) if not isinstance(dtype, bool) else "dtype"
    ):
        weights.dtype_bytes(dtype)


def test_the_builder_refuses_before_allocating(monkeypatch):
    """Callers other than the CLI (tests, benchmarks) get the same refusal from the case builder."""
    if importlib.util.find_spec("paddle") is None:
        pytest.skip("needs paddle (the minifleet builder)")
    from fastdeploy_paddlefleet.runner import fleet_case

    monkeypatch.setattr(weights, "available_memory", lambda: 2**30)
    with pytest.raises(ModelTooLargeError, match="bytes"):
        fleet_case.build_minifleet_case(dict(HUGE), "reference")


def test_the_tiny_presets_still_verify(capsys):
    pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.cli import main

    for name in ("tiny", "tiny-mla"):
        assert main(["verify", "--preset", name, "--steps", "1"]) == 0, capsys.readouterr().err
