"""Published ``config.json`` files (tests/data/configs, sources in SOURCES.md) plan as their
reference code runs them, or are refused by name.

The expected per-layer plans below are written from each model type's reference code in HF
transformers (file and function cited per entry), not read back from the planner. Where
``transformers`` is installed, its own config classes are a second, executable oracle: the
config object they build plans identically to the dict, and their resolved ``layer_types``
agree with the plan's sliding layers.
"""

from __future__ import annotations

import json
import math
import shutil
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fastdeploy_paddlefleet.cli import main
from fastdeploy_paddlefleet.plan import plan_from_config

DATA = Path(__file__).parent / "data" / "configs"


@dataclass(frozen=True)
class Expected:
    """One config's expected plan: ``sliding`` layer indices (window ``window_left``), the rest full."""

    layers: int
    sliding: tuple[int, ...]
    window_left: int | None
    heads: tuple[int, int]  # q, kv
    qk_dim: int
    v_dim: int
    scale: float
    cite: str
    soft_cap: float | None = None
    sink: str = "vanilla"
    source_note: str = ""
    extra: dict = field(default_factory=dict)


def _slides(n: int, rule) -> tuple[int, ...]:
    return tuple(i for i in range(n) if rule(i))


_DS_MSCALE = (
    0.1 * 1.0 * math.log(40) + 1.0
)  # modeling_deepseek_v3.py yarn_get_mscale(factor=40, mscale_all_dim=1)

EXPECTED: dict[str, Expected] = {
    "gemma-2-9b-it": Expected(
        42,
        _slides(42, lambda i: (i + 1) % 2),
        4095,
        (16, 8),
        256,
        256,
        256**-0.5,
        "configuration_gemma2.py Gemma2Config.__post_init__ (layer_types: sliding iff (i + 1) % 2); "
        "modeling_gemma2.py Gemma2Attention (scaling = query_pre_attn_scalar ** -0.5, "
        "softcap = attn_logit_softcapping) and eager_attention_forward (tanh(s / cap) * cap); "
        "masking_utils sliding_window_overlay (kv > q - W: W keys incl. the query)",
        soft_cap=50.0,
    ),  # fmt: skip
    "gemma-3-1b-it": Expected(
        26,
        _slides(26, lambda i: (i + 1) % 6),
        511,
        (4, 1),
        256,
        256,
        256**-0.5,
        "configuration_gemma3.py Gemma3TextConfig.__post_init__ (pattern = sliding_window_pattern, 6)",
    ),  # fmt: skip
    "gemma-3-4b-it": Expected(
        34,
        _slides(34, lambda i: (i + 1) % 6),
        1023,
        (8, 4),
        256,
        256,
        256**-0.5,
        "configuration_gemma3.py Gemma3Config (text_config -> Gemma3TextConfig); Gemma3TextConfig defaults "
        "num_attention_heads 8, num_key_value_heads 4, head_dim 256, query_pre_attn_scalar 256, pattern 6",
        source_note="text_config of Gemma3ForConditionalGeneration",
    ),  # fmt: skip
    "qwen2.5-7b": Expected(
        28,
        (),
        None,
        (28, 4),
        128,
        128,
        128**-0.5,
        "configuration_qwen2.py Qwen2Config (sliding_window = None unless use_sliding_window)",
    ),
    "qwen2.5-7b-swa-variant": Expected(
        28,
        tuple(range(20, 28)),
        4095,
        (28, 4),
        128,
        128,
        128**-0.5,
        "configuration_qwen2.py Qwen2Config (layer_types: sliding iff sliding_window is not None and "
        "i >= max_window_layers)",
    ),
    "qwen3-8b": Expected(36, (), None, (32, 8), 128, 128, 128**-0.5, "configuration_qwen3.py Qwen3Config"),
    "qwen3-30b-a3b": Expected(
        48, (), None, (32, 4), 128, 128, 128**-0.5, "configuration_qwen3_moe.py Qwen3MoeConfig"
    ),
    "llama-3.1-8b": Expected(
        32, (), None, (32, 8), 128, 128, 128**-0.5, "configuration_llama.py LlamaConfig (no sliding window)"
    ),
    "mistral-nemo-base-2407": Expected(
        40,
        (),
        None,
        (32, 8),
        128,
        128,
        128**-0.5,
        "configuration_mistral.py MistralConfig (sliding_window null stays None: no window; head_dim "
        "from the config, not hidden_size // heads = 160)",
    ),
    "mixtral-8x7b-v0.1": Expected(
        32,
        (),
        None,
        (32, 8),
        128,
        128,
        128**-0.5,
        "configuration_mixtral.py MixtralConfig (sliding_window default None)",
    ),
    "phi-3-mini-4k-instruct": Expected(
        32,
        tuple(range(32)),
        2046,
        (32, 32),
        96,
        96,
        96**-0.5,
        "configuration_phi3.py Phi3Config / modeling_phi3.py (every layer uses config.sliding_window)",
    ),
    "phi-3-medium-4k-instruct": Expected(
        40,
        tuple(range(40)),
        2046,
        (40, 10),
        128,
        128,
        128**-0.5,
        "configuration_phi3.py Phi3Config / modeling_phi3.py (every layer uses config.sliding_window)",
    ),
    "gpt-oss-20b": Expected(
        24,
        _slides(24, lambda i: i % 2 == 0),
        127,
        (64, 8),
        64,
        64,
        64**-0.5,
        "configuration_gpt_oss.py GptOssConfig (layer_types as given); modeling_gpt_oss.py "
        "GptOssAttention (per-head sinks on every layer)",
        sink="learnable",
    ),
    "deepseek-v3": Expected(
        61,
        (),
        None,
        (128, 128),
        192,
        128,
        192**-0.5 * _DS_MSCALE**2,
        "modeling_deepseek_v3.py DeepseekV3Attention (MLA: qk = nope + rope = 192, v 128, scaling "
        "qk_head_dim ** -0.5 * mscale ** 2)",
        extra={"mla_kv_lora_rank": 512},
    ),
    "exaone-4.0-32b": Expected(
        64,
        _slides(64, lambda i: (i + 1) % 4),
        4095,
        (40, 8),
        128,
        128,
        128**-0.5,
        "modular_exaone4.py Exaone4Attention.__init__ (is_sliding = config.layer_types[i] == "
        "'sliding_attention'); the file lists layer_types explicitly",
    ),
}

#: configs whose attention the plan cannot express: file -> (field named in the error, reference)
REFUSED: dict[str, tuple[str, str]] = {
    "llama-4-scout-17b-16e": (
        "attention_chunk_size",
        "modeling_llama4.py: RoPE layers use a chunked causal mask of attention_chunk_size keys",
    ),
    "phi-3-small-8k-instruct": (
        "phi3small",
        "remote code modeling_phi3_small.py: block-sparse attention (blocksparse_* fields)",
    ),
}


def _load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _check(plan, exp: Expected) -> None:
    assert len(plan) == exp.layers
    assert tuple(x.index for x in plan if x.kind != "full") == exp.sliding
    for x in plan:
        sliding = x.index in exp.sliding
        assert x.kind == ("sliding" if sliding else "full")
        assert x.window_left == (exp.window_left if sliding else None)
        assert (x.num_q_heads, x.num_kv_heads) == exp.heads
        assert (x.qk_head_dim, x.v_head_dim) == (exp.qk_dim, exp.v_dim)
        assert x.softmax_scale == pytest.approx(exp.scale, rel=1e-12)
        assert x.logits_soft_cap == exp.soft_cap
        assert x.sink == exp.sink
    if "mla_kv_lora_rank" in exp.extra:
        assert all(x.mla is not None and x.mla.kv_lora_rank == exp.extra["mla_kv_lora_rank"] for x in plan)
    assert plan.convention == ("hf" if exp.sliding else "none")


def test_every_collected_config_is_covered():
    assert {p.stem for p in DATA.glob("*.json")} == set(EXPECTED) | set(REFUSED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("form", ["dict", "file", "directory"])
def test_plans_as_reference_code_runs(name, form, tmp_path):
    exp = EXPECTED[name]
    if form == "dict":
        source = _load(name)
    elif form == "file":
        source = str(DATA / f"{name}.json")
    else:
        shutil.copy(DATA / f"{name}.json", tmp_path / "config.json")
        source = tmp_path
    plan = plan_from_config(source)
    _check(plan, exp)
    if exp.source_note:
        assert exp.source_note in plan.source and plan.extras["text_config_of"] == exp.source_note


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name(name, capsys):
    field_name, _ = REFUSED[name]
    with pytest.raises(ValueError, match=field_name):
        plan_from_config(_load(name))
    assert main(["plan", str(DATA / f"{name}.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fdfleet: error:") and field_name in err and "\n" not in err


def test_cli_source_line_names_the_text_config(capsys):
    path = str(DATA / "gemma-3-4b-it.json")
    assert main(["plan", path]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[0]
        .startswith(f"{path} (text_config of Gemma3ForConditionalGeneration): 34 layers")
    )
    assert main(["plan", path, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"].endswith("(text_config of Gemma3ForConditionalGeneration)")


def test_cli_shows_the_soft_cap(capsys):
    assert main(["plan", str(DATA / "gemma-2-9b-it.json"), "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert [x["logits_soft_cap"] for x in layers] == [50.0] * 42
    assert main(["plan", str(DATA / "gemma-2-9b-it.json")]) == 0
    assert "soft cap" in capsys.readouterr().out


def test_soft_cap_survives_tensor_parallelism():
    plan = plan_from_config(_load("gemma-2-9b-it"), tp_size=4, tp_rank=3)
    assert {(x.num_q_heads, x.num_kv_heads, x.logits_soft_cap) for x in plan} == {(4, 2, 50.0)}


# ------------------------------------------------------------------ HF transformers as the oracle

transformers = pytest.importorskip("transformers", reason="HF transformers is the executable reference")


def _hf_config(cfg: dict):
    return transformers.AutoConfig.for_model(**cfg)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hf_config_object_plans_like_the_dict(name):
    """A ``PretrainedConfig`` built by the model type's own config class gives the same plan."""
    cfg = _load(name)
    obj = _hf_config(cfg)
    got, want = plan_from_config(obj), plan_from_config(cfg)
    assert [x.to_dict() for x in got] == [x.to_dict() for x in want]
    # and HF's own resolved layer_types (where the config class has them) agree with the plan
    text = getattr(obj, "text_config", None) or obj
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        assert (
            tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention") == EXPECTED[name].sliding
        )


def test_hf_llama4_resolves_chunked_layers_and_the_object_is_refused():
    obj = _hf_config(_load("llama-4-scout-17b-16e"))
    assert "chunked_attention" in obj.text_config.layer_types  # HF agrees: the mask is chunked
    with pytest.raises(ValueError, match="attention_chunk_size"):
        plan_from_config(obj)


# ------------------------------------------------------------------ defaults and rules, smaller cases


def _sliding(plan) -> list[int]:
    return [x.index for x in plan if x.kind != "full"]


def test_gemma3_text_without_pattern_uses_hf_default_6():
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 16}
    plan = plan_from_config(cfg)
    assert _sliding(plan) == [i for i in range(12) if (i + 1) % 6]
    assert _sliding(plan) == [
        i for i, t in enumerate(_hf_config(cfg).layer_types) if t == "sliding_attention"
    ]


def test_gemma3_private_pattern_spelling_is_not_read_as_hf_does():
    """Gemma3TextConfig.__post_init__ reads kwargs['sliding_window_pattern'] only."""
    cfg = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 8,
        "sliding_window": 16,
        "_sliding_window_pattern": 4,
    }
    hf = [i for i, t in enumerate(_hf_config(cfg).layer_types) if t == "sliding_attention"]
    assert _sliding(plan_from_config(cfg)) == hf == [0, 1, 2, 3, 4, 6, 7]


def test_gemma2_defaults_fill_a_sparse_dict():
    plan = plan_from_config({"model_type": "gemma2", "num_hidden_layers": 4})
    assert [(x.kind, x.window_left, x.logits_soft_cap) for x in plan] == [
        ("sliding", 4095, 50.0),
        ("full", None, 50.0),
        ("sliding", 4095, 50.0),
        ("full", None, 50.0),
    ]
    assert {(x.num_q_heads, x.num_kv_heads, x.qk_head_dim, x.softmax_scale) for x in plan} == {
        (8, 4, 256, 1 / 16)
    }


def test_mistral_absent_window_is_the_class_default_but_null_is_none():
    base = {"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert {x.window_left for x in plan_from_config(base)} == {4095}  # MistralConfig sliding_window=4096
    assert {x.window_left for x in plan_from_config({**base, "sliding_window": None})} == {None}


def test_gemma4_text_dims_per_kind_and_last_layer_full():
    """modeling_gemma4.py Gemma4TextAttention.__init__: full layers use global_head_dim (and, with
    attention_k_eq_v, num_global_key_value_heads), sliding layers head_dim; scaling 1.0; the last
    layer is forced full by Gemma4TextConfig.__post_init__."""
    cfg = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 7,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 2,
        "sliding_window": 512,
    }
    plan = plan_from_config(cfg)
    got = [(x.kind, x.num_kv_heads, x.qk_head_dim, x.v_head_dim, x.softmax_scale) for x in plan]
    slide, full = ("sliding", 4, 256, 256, 1.0), ("full", 2, 512, 512, 1.0)
    assert got == [slide] * 5 + [full, full]
    try:
        hf = _hf_config(cfg).layer_types
    except ValueError:  # a transformers release without gemma4
        return
    assert [x.kind == "sliding" for x in plan] == [t == "sliding_attention" for t in hf]


def test_gemma4_kv_sharing_refused():
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        plan_from_config({"model_type": "gemma4_text", "num_hidden_layers": 6, "num_kv_shared_layers": 2})


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_chunk_size": 64}, "attention_chunk_size"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ],
)
def test_mask_changing_fields_refused(extra, name):
    cfg = {
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        **extra,
    }
    with pytest.raises(ValueError, match=name):
        plan_from_config(cfg)


def test_unknown_model_type_with_window_fields_is_refused_not_guessed():
    cfg = {"model_type": "brand_new", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64}
    assert _sliding(plan_from_config(cfg)) == []  # no window field: nothing to guess
    with pytest.raises(ValueError, match="'brand_new'.*sliding_window"):
        plan_from_config({**cfg, "sliding_window": 64})
    explicit = {**cfg, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert _sliding(plan_from_config(explicit)) == [0, 2]


def test_paddlefleet_object_ignores_hf_soft_cap():
    """PaddleFleet's core attention has no soft-capping: a TransformerConfig-like object that
    copied an HF attn_logit_softcapping is planned without it (the host would not cap)."""
    obj = types.SimpleNamespace(
        model_type="gemma2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, attn_logit_softcapping=50.0,
    )  # fmt: skip
    assert {x.logits_soft_cap for x in plan_from_config(obj)} == {None}
    assert {x.logits_soft_cap for x in plan_from_config(vars(obj))} == {50.0}  # an HF dict caps
