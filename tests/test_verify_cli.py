"""``fdfleet verify``: JSON, exit codes, bad inputs; the verify driver's schedule and arguments."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fastdeploy_paddlefleet.cli import main
from fastdeploy_paddlefleet.runner.fleet_case import build_minifleet_case
from fastdeploy_paddlefleet.runner.verify import run_verify, schedule_steps

JSON_KEYS = {"passed", "backend", "max_abs_logit_diff", "greedy_agreement", "steps", "layers_patched"}


def verify_json(capsys, *args):
    code = main(["verify", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize(("preset", "layers"), [("tiny", 5), ("tiny-mla", 3)])
def test_verify_reference_passes(capsys, preset, layers):
    code, report = verify_json(capsys, "--preset", preset, "--backend", "reference")
    assert code == 0
    assert JSON_KEYS <= set(report)
    assert report["passed"] is True and report["backend"] == "reference"
    assert report["max_abs_logit_diff"] <= 1e-4
    assert report["greedy_agreement"] == 1.0
    assert report["layers_patched"] == layers
    per_step = report["per_step"]
    assert len(per_step) == report["steps"] > 8
    # mixed batches: some step decodes one request while another still prefills
    assert any(s["num_prefill"] and s["num_decode"] for s in per_step)
    assert all(s["blocks_used"] > 0 for s in per_step)
    assert all(len(r["generated"]) == 9 for r in report["requests"])  # 8 decode steps + the last pick


def test_verify_default_is_tiny_with_a_table(capsys, monkeypatch):
    monkeypatch.setenv("FDFLEET_BACKEND", "reference")
    assert main(["verify", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("minifleet:tiny backend=reference layers patched=5")
    assert "PASSED" in out.splitlines()[-1]


def test_verify_fails_above_tolerance(capsys):
    code, report = verify_json(capsys, "--backend", "reference", "--steps", "1", "--tolerance", "0")
    assert code == 1 and report["passed"] is False and report["max_abs_logit_diff"] > 0


def test_verify_minifleet_config_file(capsys, tmp_path):
    path = tmp_path / "mini.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "minifleet",
                "vocab_size": 32,
                "hidden_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "sliding_window": 3,  # PaddleFleet's FlashMask path: 3 keys including the query
                "window_attn_skip_freq": 2,
                "softmax_type": "off-by-one",
            }
        )
    )
    code, report = verify_json(capsys, "--config", str(path), "--backend", "reference", "--steps", "2")
    assert code == 0 and report["passed"] and report["layers_patched"] == 2


def test_native_model_gets_causal_start_end_rows():
    """The native forward is fed what PaddleFleet's data path feeds (its sliding layers need it)."""
    import paddle

    from fastdeploy_paddlefleet.runner.fleet_case import fleet_case

    case = build_minifleet_case("tiny", "reference", seed=0)
    seen = []
    core = case.native_logits.model.decoder.layers[1].self_attn.core_attention
    core.register_forward_pre_hook(lambda layer, inputs: seen.append(inputs[4]))
    case.native_logits(paddle.to_tensor([[1, 2, 3, 4, 5]], dtype="int64"))
    assert seen[0].dtype == paddle.int32 and seen[0].numpy().tolist() == [[[[5]] * 5]]
    with pytest.raises(ValueError, match="native_path"):
        fleet_case("x", case.native_logits.model, case.native_logits.model, case.plan, native_path="sdpa")


def test_verify_config_of_a_paddlefleet_model_runs_sliding_layers(capsys, tmp_path, monkeypatch):
    """`--config` of a non-minifleet model type builds PaddleFleet through PaddleFormers; here the
    build is stood in by minifleet (paddlefleet does not install), the rest is the real CLI path."""
    from fastdeploy_paddlefleet.cli import verify as cli_verify
    from fastdeploy_paddlefleet.minifleet import build_minifleet, make_config
    from fastdeploy_paddlefleet.runner import fleet_case

    monkeypatch.setattr(cli_verify, "_paddlefleet_installed", lambda: True)
    monkeypatch.setattr(fleet_case, "paddlefleet_config", lambda raw: make_config(raw))
    monkeypatch.setattr(
        fleet_case, "build_paddlefleet_model", lambda config, seed: build_minifleet(config, seed)
    )
    path = tmp_path / "config.json"
    fields = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "sliding_window": 4,
        "window_attn_skip_freq": [0, 1, 1],
    }
    path.write_text(json.dumps(fields))
    code, report = verify_json(capsys, "--config", str(path), "--backend", "reference", "--steps", "3")
    assert code == 0 and report["passed"] and report["name"] == "paddlefleet:qwen3"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "gpt-oss-20b"], "not a minifleet one"),
        (["--preset", "no-such-preset"], "neither a JSON file nor a preset"),
        (["--steps", "-1"], "--steps"),
        (["--paddleformers", "gpt_oss", "--preset", "tiny"], "cannot be combined"),
        (["--chunk-size", "0"], "chunk"),
    ],
)
def test_verify_bad_inputs_exit_2(capsys, args, message):
    try:  # argparse-level refusals exit through SystemExit(2), the others return 2
        code = main(["verify", "--backend", "reference", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(("fdfleet: error:", "fdfleet verify: error:")) and message in err
    assert err.count("\n") == 1  # one line


def test_paddlefleet_config_without_paddlefleet_names_the_package(capsys, tmp_path):
    if importlib.util.find_spec("paddlefleet") is not None:
        pytest.skip("paddlefleet is installed")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    assert main(["verify", "--config", str(path), "--backend", "reference"]) == 2
    assert "`paddlefleet` package" in capsys.readouterr().err


def test_missing_paddleformers_cases_module_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastdeploy_paddlefleet.runner.paddleformers_case", None)
    assert main(["verify", "--paddleformers", "gpt_oss", "--backend", "reference"]) == 2
    assert "--paddleformers needs" in capsys.readouterr().err


def test_schedule_mixes_prefill_chunks_and_decode():
    steps = schedule_steps((10, 5, 12), decode_steps=2, chunk_size=4)
    assert steps[0] == [(0, 4)]  # staggered starts: request r arrives at step r
    assert steps[2] == [(0, 2), (1, 1), (2, 4)]  # 0 finishes its prompt, 1 decodes, 2 starts
    fed = {}
    for batch in steps:
        for r, n in batch:
            fed[r] = fed.get(r, 0) + n
    assert fed == {0: 12, 1: 7, 2: 14}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_lens": ()}, "prompt_lens"),
        ({"decode_steps": -1}, "decode_steps"),
        ({"block_size": 0}, "block_size"),
        ({"tolerance": -1.0}, "tolerance"),
    ],
)
def test_run_verify_rejects_bad_arguments(kwargs, message):
    case = build_minifleet_case("tiny", "reference", seed=0)
    with pytest.raises(ValueError, match=message):
        run_verify(case, progress=False, **kwargs)


@pytest.mark.skipif(
    importlib.util.find_spec("fastdeploy_paddlefleet.backends.triton") is None
    or importlib.util.find_spec("triton") is None,
    reason="triton backend not available",
)
@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_verify_triton_backend_under_interpreter(preset):
    # a fresh process: TRITON_INTERPRET must be set before triton is imported
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", "verify", "--json", "--backend", "triton"]
        + ["--preset", preset, "--steps", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["backend"] == "triton" and report["passed"]
    assert report["max_abs_logit_diff"] <= 1e-4 and report["greedy_agreement"] == 1.0
