"""Parity on real PaddleFormers models: the paged path vs the model's own eager forward.

The reference is each model's own full-sequence eager attention (PaddleFormers
code nobody on this project wrote); the paged side is the same weights patched
by ``patch_paddleformers`` and driven by ``run_verify`` (chunked prefill, mixed
prefill/decode batches, 32 greedy decode steps, prompts longer than every
sliding window). CPU, fp32, tiny random-init configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("paddleformers")

from fastdeploy_paddlefleet.adapter.context import StepContextHolder  # noqa: E402
from fastdeploy_paddlefleet.backends.reference import ReferenceBackend  # noqa: E402
from fastdeploy_paddlefleet.patch.paddleformers import (  # noqa: E402
    PAGED_ATTN_KEY,
    patch_paddleformers,
    unpatch_paddleformers,
)
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.runner import paddleformers_case as pfc  # noqa: E402
from fastdeploy_paddlefleet.runner.verify import run_verify  # noqa: E402

TOL = 1e-4
DECODE_STEPS = 32


def _needs_model(arch: str) -> None:
    """Skip, naming the release, where the installed PaddleFormers does not build ``arch`` here
    (``pfc.MIN_PADDLEFORMERS``: beside FastDeploy pip takes 1.1.1, whose deepseek_v3 needs a GPU paddle)."""
    why = pfc.arch_unavailable(arch)
    if why is not None:
        pytest.skip(why)


def _windows(plan) -> list[int]:
    return [layer.window_left for layer in plan if layer.window_left is not None]


@pytest.mark.parametrize("arch", list(pfc.ARCHITECTURES))
def test_parity_reference_backend(arch):
    _needs_model(arch)
    case = pfc.build_case(arch, backend="reference", seed=0)
    report = run_verify(case, decode_steps=DECODE_STEPS, progress=False)
    d = report.to_dict()
    assert d["passed"], d
    assert d["max_abs_logit_diff"] <= TOL
    assert d["greedy_agreement"] == 1.0
    assert d["layers_patched"] == len(case.plan)
    assert all(len(r["generated"]) >= DECODE_STEPS for r in d["requests"])
    windows = _windows(case.plan)
    if windows:  # every prompt is longer than the widest window
        assert min(r["prompt_len"] for r in d["requests"]) > max(windows) + 1
    # mixed batches happened: some step both prefilled and decoded
    assert any(s["num_prefill"] and s["num_decode"] for s in d["per_step"])


def test_tiny_configs_cover_the_features():
    """What the parity runs above exercise, read from the plans of the tiny configs."""
    gpt = plan_from_config(pfc.tiny_config("gpt_oss"))
    assert [layer.kind for layer in gpt] == ["sliding", "full", "sliding", "full"]
    assert {layer.sink for layer in gpt} == {"learnable"} and _windows(gpt) == [7, 7]  # HF W=8 -> 7
    gemma = plan_from_config(pfc.tiny_config("gemma3_text"))
    assert [layer.kind for layer in gemma] == ["sliding", "sliding", "full", "sliding"]
    assert gemma[0].softmax_scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    ds = plan_from_config(pfc.tiny_config("deepseek_v3"))
    assert (ds[0].qk_head_dim, ds[0].v_head_dim, ds[0].mla is not None) == (24, 16, True)
    llama = plan_from_config(pfc.tiny_config("llama"))
    assert llama[0].num_q_heads == 4 and llama[0].num_kv_heads == 2  # GQA


def _shift_windows(plan, by: int):
    layers = tuple(
        dataclasses.replace(layer, window_left=layer.window_left + by)
        if layer.window_left is not None
        else layer
        for layer in plan
    )
    return dataclasses.replace(plan, layers=layers)


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text"])
def test_wrong_window_translation_breaks_parity(arch):
    """window_left = W (instead of HF's W - 1) must be caught: the check can fail."""
    case = pfc.build_case(arch, plan_transform=lambda plan: _shift_windows(plan, 1))
    report = run_verify(case, decode_steps=2, progress=False)
    assert not report.passed
    assert report.max_abs_logit_diff > 100 * TOL


def test_wrong_scale_translation_breaks_parity():
    """gemma3's softmax scale is query_pre_attn_scalar ** -0.5; head_dim ** -0.5 must be caught."""

    def head_dim_scale(plan):
        layers = tuple(dataclasses.replace(layer, softmax_scale=layer.qk_head_dim**-0.5) for layer in plan)
        return dataclasses.replace(plan, layers=layers)

    report = run_verify(
        pfc.build_case("gemma3_text", plan_transform=head_dim_scale), decode_steps=2, progress=False
    )
    assert not report.passed


class _EqualDimsBackend(ReferenceBackend):
    """A backend that, like some kernels, needs v_head_dim == qk_head_dim."""

    name = "equal-dims"
    supports_unequal_v_dim = False
    calls = 0

    def forward(self, q, k, v, layer, meta, kv_cache, sinks=None):
        if v.shape[-1] != q.shape[-1] or layer.v_head_dim != layer.qk_head_dim:
            raise AssertionError(f"unequal dims reached the backend: v {list(v.shape)} q {list(q.shape)}")
        type(self).calls += 1
        return super().forward(q, k, v, layer, meta, kv_cache, sinks)


def test_deepseek_mla_values_padded_for_equal_dim_backend():
    _needs_model("deepseek_v3")
    case = pfc.build_case("deepseek_v3", backend=_EqualDimsBackend())
    assert case.cache_plan is not None and case.cache_plan[0].v_head_dim == 24
    report = run_verify(case, decode_steps=4, progress=False)
    assert report.passed, report.to_dict()
    assert _EqualDimsBackend.calls > 0
    # one-token steps (the last request decoding alone) ran: deepseek's RoPE needs the pad workaround there
    assert any(s.num_tokens == 1 for s in report.steps)


@pytest.mark.parametrize("arch", list(pfc.ARCHITECTURES))
def test_patched_model_runs_only_through_the_paged_path(arch):
    """Outside a step the patched twin fails (no step context); the native twin is untouched."""
    _needs_model(arch)
    config = pfc.tiny_config(arch)
    native, twin = pfc.build_twins(config)
    report = patch_paddleformers(twin, plan_from_config(config), ReferenceBackend())
    assert report.num_patched == config.num_hidden_layers and not report.skipped
    ids = paddle.to_tensor([[1, 2, 3, 4]], dtype="int64")
    with pytest.raises(ValueError, match="no step context"):
        twin(input_ids=ids, use_cache=False, return_dict=True)
    assert native.config._attn_implementation == "eager"
    before = native(input_ids=ids, use_cache=False, return_dict=True).logits
    unpatch_paddleformers(twin)
    after = twin(input_ids=ids, use_cache=False, return_dict=True).logits
    assert float((before - after).abs().max()) < 1e-5  # unpatched: the model's own attention again
    assert twin.config._attn_implementation == "eager"


def test_other_models_keep_their_attention():
    """Patching adds a registry key; existing keys and unpatched modules are untouched."""
    from paddleformers.nn.attention.eager_attention import eager_attention_forward
    from paddleformers.nn.attention.interface import ALL_ATTENTION_FUNCTIONS

    config = pfc.tiny_config("gpt_oss")
    _, twin = pfc.build_twins(config)
    patch_paddleformers(twin, plan_from_config(config), ReferenceBackend())
    assert ALL_ATTENTION_FUNCTIONS["eager"] is eager_attention_forward
    assert PAGED_ATTN_KEY in ALL_ATTENTION_FUNCTIONS
    stranger = paddle.nn.Layer()  # a module nobody patched, calling the new key
    q = paddle.zeros([1, 2, 3, 4])
    with pytest.raises(ValueError, match="did not patch"):
        ALL_ATTENTION_FUNCTIONS[PAGED_ATTN_KEY](stranger, query=q, key=q, value=q)


def test_patch_time_errors():
    config = pfc.tiny_config("gpt_oss")
    plan = plan_from_config(config)
    _, twin = pfc.build_twins(config)
    wrong_heads = dataclasses.replace(plan, layers=tuple(dataclasses.replace(l, num_q_heads=8) for l in plan))
    with pytest.raises(ValueError, match="num_q_heads=8"):
        patch_paddleformers(twin, wrong_heads, ReferenceBackend())
    no_sinks = dataclasses.replace(plan, layers=tuple(dataclasses.replace(l, sink="vanilla") for l in plan))
    with pytest.raises(ValueError, match="learnable sinks"):
        patch_paddleformers(twin, no_sinks, ReferenceBackend())
    short = dataclasses.replace(plan, layers=plan.layers[:2])  # layers 2, 3 beyond the plan
    report = patch_paddleformers(twin, short, ReferenceBackend(), holder=StepContextHolder())
    assert [p.layer_index for p in report.patched] == [0, 1] and len(report.skipped) == 2
    with pytest.raises(ValueError, match="already patched"):
        patch_paddleformers(twin, plan, ReferenceBackend())
    with pytest.raises(TypeError, match="backend"):
        patch_paddleformers(pfc.build_twins(config)[1], plan, "reference")


def test_unsupported_model_type_and_arch():
    config = pfc.tiny_config("llama")
    _, twin = pfc.build_twins(config)
    twin.config.model_type = "phi3"
    with pytest.raises(ValueError, match="model_type='phi3'"):
        patch_paddleformers(twin, plan_from_config(config), ReferenceBackend())
    with pytest.raises(ValueError, match="arch must be one of"):
        pfc.build_case("qwen9")


def test_gpt_oss_moe_fix_restores_causality():
    """Upstream eval MoE mixes tokens (a prefix's logits change with later tokens); the fix removes that."""
    config = pfc.tiny_config("gpt_oss")
    paddle.seed(3)
    from paddleformers.transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    ids = paddle.randint(0, config.vocab_size, [1, 20])

    def prefix_gap():
        with paddle.no_grad():
            full = model(input_ids=ids, use_cache=False, return_dict=True).logits[:, :10]
            part = model(input_ids=ids[:, :10], use_cache=False, return_dict=True).logits
        return float((full - part).abs().max())

    assert prefix_gap() > 1e-2  # the upstream bug, as observed
    assert pfc.fix_gpt_oss_moe(model) == config.num_hidden_layers
    assert prefix_gap() < 1e-5


def test_config_path(tmp_path):
    path = tmp_path / "config.json"
    fields = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2}
    fields |= {"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 48}
    path.write_text(json.dumps(fields))  # a hand-written HF-style config.json
    case = pfc.build_case("llama", config_path=path)
    assert run_verify(case, decode_steps=2, progress=False).passed
    with pytest.raises(ValueError, match="does not match arch"):
        pfc.load_arch_config("gemma3_text", path)
    with pytest.raises(ValueError, match="no such file"):
        pfc.load_arch_config("llama", tmp_path / "missing.json")


def test_paddlefleet_ops_stand_in(monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "paddlefleet_ops", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with caplog.at_level(logging.WARNING, logger=pfc.__name__):
        assert pfc.ensure_paddlefleet_ops() is True
    assert sys.modules["paddlefleet_ops"].is_deep_ep_available() is False
    assert "stand-in" in caplog.text
    assert pfc.ensure_paddlefleet_ops() is False  # importable now: nothing more to do


_HAS_TRITON = (
    importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("fastdeploy_paddlefleet.backends.triton") is not None
)


@pytest.mark.skipif(not _HAS_TRITON, reason="triton backend not available")
@pytest.mark.parametrize(("arch", "steps"), [("gpt_oss", DECODE_STEPS), ("deepseek_v3", 8)])
def test_triton_backend_interpreter(arch, steps):
    """The Triton backend under the interpreter (set before triton is imported: a subprocess).

    gpt_oss: sinks + alternating windows over the full 32 steps; deepseek_v3:
    q/k head 24 != v head 16, fewer steps to keep the interpreter's time modest.
    """
    _needs_model(arch)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "fastdeploy_paddlefleet.cli", "verify", "--paddleformers", arch]
    cmd += ["--backend", "triton", "--steps", str(steps), "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["backend"] == "triton" and d["name"] == f"paddleformers:{arch}"
    assert d["passed"] and d["max_abs_logit_diff"] <= TOL and d["greedy_agreement"] == 1.0


def test_unbuildable_arch_is_named(monkeypatch):
    """An architecture the installed PaddleFormers does not build here is refused by name, with the
    release it needs (stood in: a release below every minimum, a model module that does not import)."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0.0")
    monkeypatch.setattr(pfc, "MIN_PADDLEFORMERS", {"llama": "1.2.0"})
    real = pfc.importlib.import_module

    def fake_import(name, *args):
        if name == "paddleformers.transformers.llama.modeling":
            raise ModuleNotFoundError("No module named 'paddle.no_such_module'")
        return real(name, *args)

    monkeypatch.setattr(pfc.importlib, "import_module", fake_import)
    why = pfc.arch_unavailable("llama")
    assert why is not None and "PaddleFormers 1.0.0" in why and ">= 1.2.0" in why
    assert pfc.arch_unavailable("gpt_oss") is None  # no minimum beyond the extra's floor
    with pytest.raises(ValueError, match=r"PaddleFormers 1\.0\.0's llama model does not import"):
        pfc.build_twins(pfc.tiny_config("llama"))
    assert pfc._release("1.2.0.post1") == (1, 2, 0) and pfc._release("1.1.1+cu12") == (1, 1, 1)
