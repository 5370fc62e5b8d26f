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


# ---- verify --model DIR: a checkpoint directory on its real weights ---------------------------------


def _digests(root) -> dict[str, str]:
    import hashlib
    from pathlib import Path

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


def test_verify_model_on_a_minifleet_model_dir(capsys, tmp_path):
    """A directory written by serving.modeldir (seed 7) passes; both models hold the checkpoint's
    tensors (read here with safetensors), which differ from the seed-0 weights verify would build;
    nothing in the directory changes."""
    import numpy as np
    from safetensors.numpy import load_file

    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.runner.checkpoint_case import build_checkpoint_case
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    d = write_model_dir("tiny", tmp_path / "tiny", dtype="float32", seed=7)
    before = _digests(d)
    code, report = verify_json(capsys, "--model", str(d), "--steps", "4")
    assert code == 0 and report["passed"] is True and report["max_abs_logit_diff"] <= 1e-4
    assert report["greedy_agreement"] == 1.0 and report["layers_patched"] == 5
    assert _digests(d) == before
    tensors = load_file(str(d / "model.safetensors"))
    case = build_checkpoint_case(d, "reference", seed=0)
    native = case.native_logits.model.state_dict()
    seed0 = build_minifleet(json.loads((d / "config.json").read_text()), seed=0).state_dict()
    assert set(tensors) == set(native)
    for name, array in tensors.items():
        np.testing.assert_array_equal(native[name].numpy(), array)
    assert any(not np.array_equal(seed0[n].numpy(), tensors[n]) for n in tensors)
    code, out = main(["verify", "--model", str(d), "--steps", "1"]), capsys.readouterr().out
    assert code == 0 and "PASSED" in out  # the table report too


def test_verify_model_on_a_bfloat16_model_dir(capsys, tmp_path):
    """Checkpoints are usually bf16 (numpy has no bfloat16): the same directory with every tensor
    rounded to bf16 passes, and the models hold exactly the rounded values."""
    import numpy as np
    import paddle
    from safetensors.paddle import load_file, save_file

    from fastdeploy_paddlefleet.runner.checkpoint_case import build_checkpoint_case
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    d = write_model_dir("tiny", tmp_path / "bf16", dtype="float32", seed=3)
    rounded = {k: v.astype("bfloat16") for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(rounded, str(d / "model.safetensors"))
    code, report = verify_json(capsys, "--model", str(d), "--steps", "2")
    assert code == 0 and report["passed"] is True, report
    native = build_checkpoint_case(d, "reference").native_logits.model.state_dict()
    for name, tensor in rounded.items():
        np.testing.assert_array_equal(native[name].numpy(), tensor.astype(paddle.float32).numpy())


def _paddleformers_checkpoint(arch: str, path):
    """A tiny random PaddleFormers model of ``arch`` written with its own save_pretrained."""
    import paddle
    from paddleformers.transformers import AutoModelForCausalLM

    from fastdeploy_paddlefleet.runner.paddleformers_case import ensure_paddlefleet_ops, tiny_config

    if arch == "deepseek_v3":
        ensure_paddlefleet_ops()
    paddle.seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    model.eval()
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss"])
def test_verify_model_on_a_paddleformers_checkpoint(capsys, tmp_path, arch):
    """save_pretrained's directory passes verify --model; the native side is the checkpoint's model:
    its logits equal those of the model that wrote it (gpt_oss: its eval-mode MoE routing bug is
    fixed in both twins, so the writer's own logits differ by design and are not compared)."""
    pytest.importorskip("paddleformers")
    import paddle

    from fastdeploy_paddlefleet.runner.checkpoint_case import build_checkpoint_case

    d = tmp_path / arch
    writer = _paddleformers_checkpoint(arch, d)
    before = _digests(d)
    code, report = verify_json(capsys, "--model", str(d), "--steps", "4")
    assert code == 0 and report["passed"] is True and report["max_abs_logit_diff"] <= 1e-4, report
    assert _digests(d) == before
    if arch != "gpt_oss":
        case = build_checkpoint_case(d, "reference")
        ids = paddle.to_tensor([[1, 5, 9, 3, 7, 2, 4, 4, 8, 9, 10, 11]], dtype="int64")
        with paddle.no_grad():
            want = writer(input_ids=ids, use_cache=False, return_dict=True).logits
        assert float((case.native_logits(ids) - want).abs().max()) < 1e-5


def _bad_model_dirs(tmp_path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (directory, fragments the one-line error must hold)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    out["missing"] = (str(tmp_path / "nope"), ("no such directory",))
    good = write_model_dir("tiny", tmp_path / "good", dtype="float32")
    out["a file"] = (str(good / "config.json"), ("not a directory",))
    empty = tmp_path / "empty"
    empty.mkdir()
    out["no config.json"] = (str(empty), ("no config.json",))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    out["no weights"] = (str(no_weights), ("no *.safetensors",))
    lacking = write_model_dir("tiny", tmp_path / "lacking", dtype="float32")
    tensors = load_file(str(lacking / "model.safetensors"))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(lacking / "model.safetensors"))
    out["lacks a weight"] = (str(lacking), ("lacks 1", dropped))
    damaged = write_model_dir("tiny", tmp_path / "damaged", dtype="float32")
    (damaged / "model.safetensors").write_bytes(b"\x00garbage" * 8)
    out["damaged weights"] = (str(damaged), ("model.safetensors", "not a readable safetensors"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({**json.loads((good / "config.json").read_text()), "model_type": "qwen3"})
    )
    save_file({"x": np.zeros(2, np.float32)}, str(other / "model.safetensors"))
    out["other model_type"] = (str(other), ("model_type 'qwen3'",))
    bad_field = write_model_dir("tiny", tmp_path / "bad_field", dtype="float32")
    cfg = json.loads((bad_field / "config.json").read_text())
    (bad_field / "config.json").write_text(json.dumps({**cfg, "rope_theta": -1.0}))
    out["bad field"] = (str(bad_field), ("rope_theta",))
    return out


BAD_MODEL_DIRS = [
    "missing",
    "a file",
    "no config.json",
    "no weights",
    "lacks a weight",
    "damaged weights",
    "other model_type",
    "bad field",
]


@pytest.mark.parametrize("name", BAD_MODEL_DIRS)
def test_verify_model_bad_dirs_are_named(capsys, tmp_path, name):
    path, fragments = _bad_model_dirs(tmp_path)[name]
    before = _digests(tmp_path)
    code = main(["verify", "--model", path, "--steps", "1"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fdfleet: error: --model") and path in lines[0], lines[0]
    for frag in fragments:
        assert frag in lines[0], lines[0]
    assert "PASSED" not in out and "FAILED" not in out
    assert _digests(tmp_path) == before


def test_verify_model_excludes_the_other_sources(capsys, tmp_path):
    for other in (["--preset", "tiny"], ["--config", "x.json"]):
        with pytest.raises(SystemExit):
            main(["verify", "--model", str(tmp_path), *other])
        assert "--model" in capsys.readouterr().err
    assert main(["verify", "--model", str(tmp_path), "--paddleformers", "llama"]) == 2
    assert "--paddleformers and --model" in capsys.readouterr().err
