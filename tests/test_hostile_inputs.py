"""Hostile model configs, bounded and named (issue 19, "Bounded inputs").

* caps on layers, MTP layers, heads, per-layer lists and the config file's size, each refused by
  field (or file) name with the cap, before the config is read or expanded (a sparse multi-GiB
  ``config.json`` is refused without reading a byte; 10**9 layers without building a list);
* every numeric field checked where the plan reads it, the FIELD named, never a value derived
  from it (``rope_scaling.factor``, not ``softmax_scale=nan``);
* ``layer_types`` entries checked in every input form (dict, ``config.json``, model directory,
  preset, attribute object, PaddleFormers config), with and without ``model_type``;
* ``fdfleet plan`` / ``fdfleet verify --config`` name the field and the file (exit 2), instead of
  ``FAILED: max abs logit diff inf``; nothing on disk changes.

Accepted values are checked against an independent reference (the yarn formula written out here).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from fastdeploy_paddlefleet.cli import main  # noqa: E402
from fastdeploy_paddlefleet.minifleet.config import make_config  # noqa: E402
from fastdeploy_paddlefleet.plan import load_config, plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.plan.fields import (  # noqa: E402
    MAX_CONFIG_BYTES,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MTP_LAYERS,
)

BASE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
MLA = {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
MINI = {
    "model_type": "minifleet",
    "vocab_size": 32,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """``{relative path: (sha256, mtime_ns)}`` of every file under ``root`` (sparse files by size)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < 2**20 else str(st.st_size)
            out[str(p.relative_to(root))] = (digest, st.st_mtime_ns)
    return out


def refused(config, *fragments: str, exc=(ValueError, TypeError), **kw) -> str:
    start = time.perf_counter()
    with pytest.raises(exc) as e:
        plan_from_config(config, **kw)
    assert time.perf_counter() - start < 5, "refused, but only after expanding the config"
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 1000, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# ---- caps, before anything is read or expanded ---------------------------------------------------

CAPS = [
    ({"num_hidden_layers": 10**9}, ("num_hidden_layers", str(MAX_LAYERS))),
    ({"num_layers": 10**9, "num_hidden_layers": None}, ("num_layers", str(MAX_LAYERS))),
    ({"model_type": "minifleet", "mtp_num_layers": 10**9}, ("mtp_num_layers", str(MAX_MTP_LAYERS))),
    ({"mtp_num_layers": MAX_MTP_LAYERS + 1}, ("mtp_num_layers", str(MAX_MTP_LAYERS))),  # hung fdfleet
    ({"num_nextn_predict_layers": 10**12}, ("num_nextn_predict_layers", str(MAX_MTP_LAYERS))),
    ({"num_attention_heads": 10**7, "num_key_value_heads": 1}, ("num_attention_heads", str(MAX_HEADS))),
    ({"num_key_value_heads": 10**7}, ("num_key_value_heads", str(MAX_HEADS))),
    ({"swa_num_attention_heads": 10**7, "sliding_window": 8}, ("swa_num_attention_heads", str(MAX_HEADS))),
    ({"swa_num_key_value_heads": 10**7, "sliding_window": 8}, ("swa_num_key_value_heads", str(MAX_HEADS))),
    # a model type whose rule builds a per-layer list: capped before the rule runs
    ({"model_type": "gemma3_text", "num_hidden_layers": 10**9}, ("num_hidden_layers", str(MAX_LAYERS))),
    ({"model_type": "qwen3", "num_hidden_layers": 10**9}, ("num_hidden_layers",)),
    ({"layer_types": ["full_attention"] * (MAX_LAYERS + MAX_MTP_LAYERS + 1)}, ("layer_types", "entries")),
    ({"window_attn_skip_freq": [1] * 10**6, "sliding_window": 8}, ("window_attn_skip_freq", "entries")),
]


@pytest.mark.parametrize(("change", "fragments"), CAPS, ids=[str(c)[:50] for c, _ in CAPS])
def test_counts_are_capped_by_name(change, fragments):
    refused({**BASE, **change}, *fragments)


def test_caps_on_a_multimodal_text_config():
    wrapper = {"model_type": "gemma3", "text_config": {**BASE, "num_hidden_layers": 10**9}}
    refused(wrapper, "num_hidden_layers", str(MAX_LAYERS))


@pytest.mark.parametrize("size", [MAX_CONFIG_BYTES + 1, 3 * 2**30])  # just over the cap; 3 GiB
def test_config_file_size_is_checked_before_reading(tmp_path, size):
    """A sparse file: nothing is read (a 3 GiB read would take seconds and the memory)."""
    path = tmp_path / "config.json"
    with path.open("wb") as f:
        f.truncate(size)
    before = snapshot(tmp_path)
    for source in (path, tmp_path):  # the file and its model directory
        msg = refused(str(source), str(path), str(size), str(MAX_CONFIG_BYTES))
        assert "bytes" in msg
    with pytest.raises(ValueError, match="bytes"):
        make_config(str(path))  # minifleet reads files through the same cap
    assert snapshot(tmp_path) == before


def test_minifleet_config_shares_the_caps():
    with pytest.raises(ValueError, match=f"mtp_num_layers.*{MAX_MTP_LAYERS}"):
        make_config({**MINI, "mtp_num_layers": 10**9})
    with pytest.raises(ValueError, match="num_attention_heads"):
        make_config({**MINI, "num_attention_heads": 10**8, "num_key_value_heads": 1})


# ---- numeric fields: the field named --------------------------------------------------------------

NAN, INF = math.nan, math.inf
POSITIVE = ("rope_theta", "rms_norm_eps", "layernorm_epsilon", "layer_norm_eps", "swa_rope_theta")
SIZES = ("vocab_size", "hidden_size", "max_position_embeddings")
PER_TYPE = {"sliding_attention": {"rope_theta": NAN}, "full_attention": {"rope_theta": 1e6}}
NUMERIC = [
    *[({name: v}, name) for name in POSITIVE for v in (NAN, INF, -1.0, 0.0)],
    *[({name: v}, name) for name in SIZES for v in (0, -4)],
    ({"vocab_size": 32.5}, "vocab_size"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 0}, "partial_rotary_factor"),
    ({"attention_dropout": -0.1}, "attention_dropout"),
    ({"rope_scaling": {"rope_type": "linear", "factor": NAN}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}}, "rope_scaling.beta_fast"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": NAN}}, "rope_scaling.mscale"),
    (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}},
        "rope_scaling.original_max_position_embeddings",
    ),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}}, "rope_parameters.rope_theta"),
    (
        {"rope_parameters": PER_TYPE},
        "rope_parameters.sliding_attention.rope_theta",
    ),
    ({"rope_scaling": [4.0]}, "rope_scaling"),
    ({"rotary_scaling_factor": NAN}, "rotary_scaling_factor"),
    ({"mscale_all_dim": -1}, "mscale_all_dim"),
]


@pytest.mark.parametrize(("change", "field"), NUMERIC, ids=[str(c)[:60] for c, _ in NUMERIC])
def test_numeric_fields_are_named(change, field):
    refused({**BASE, **change}, field)


@pytest.mark.parametrize("form", ["dict", "object"])
@pytest.mark.parametrize(
    "rope",
    [
        {"type": "yarn", "factor": NAN, "mscale_all_dim": 1.0},  # was softmax_scale=nan
        {"type": "yarn", "factor": -4.0, "mscale_all_dim": 1.0},  # was accepted (log of a negative: 1.0)
        {"type": "yarn", "factor": 4.0, "mscale_all_dim": -100.0},  # was accepted, scale from a negative
        {"type": "yarn", "factor": 1e308, "mscale_all_dim": 1e308},  # overflows the correction
    ],
)
def test_a_derived_softmax_scale_names_the_rope_scaling_field(form, rope):
    config = {**BASE, **MLA, "rope_scaling": rope}
    msg = refused(config if form == "dict" else SimpleNamespace(**config, window_convention="hf"))
    assert "rope_scaling." in msg and "softmax_scale" not in msg, msg


def test_paddlefleet_mla_scale_fields_are_named():
    mla = {**BASE, **MLA, "model_type": "minifleet", "multi_latent_attention": True}
    refused({**mla, "rotary_scaling_factor": -4.0, "mscale_all_dim": 1.0}, "rotary_scaling_factor")
    refused({**mla, "rotary_scaling_factor": 1e308, "mscale_all_dim": 1e308}, "rotary_scaling_factor")


def test_valid_values_still_plan_to_the_reference_scale():
    """Positive control: a yarn correction and ordinary fields are accepted, and the scale is the
    formula written out here (DeepSeek-V3's yarn mscale), not something the check changed."""
    factor, mscale_all_dim = 40.0, 1.0
    config = {
        **BASE,
        **MLA,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "vocab_size": 129280,
        "rope_scaling": {"type": "yarn", "factor": factor, "mscale_all_dim": mscale_all_dim, "beta_fast": 32},
    }
    plan = plan_from_config(config)
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    assert plan[0].softmax_scale == pytest.approx((8 + 8) ** -0.5 * mscale**2, rel=1e-12)


def test_every_preset_passes_the_field_checks():
    from fastdeploy_paddlefleet.presets import list_presets

    for name in list_presets():
        assert len(plan_from_config(name)) >= 1, name


def test_seeded_random_numeric_fields_name_the_field():
    """A seeded generator of bad values for every top-level numeric field the plan knows."""
    from fastdeploy_paddlefleet.plan.fields import NUMERIC_FIELDS

    rng = random.Random(19)
    bad_values = [NAN, INF, -INF, -1, -1e-9, True, "1", [1], {"x": 1}]
    for name in sorted(NUMERIC_FIELDS):
        value = rng.choice(bad_values)
        msg = refused({**BASE, name: value}, name)
        assert msg.startswith(name), msg


def test_unhashable_values_are_named_not_a_type_error():
    refused({**BASE, "model_type": ["llama"]}, "model_type")  # was: unhashable type: 'list'
    refused({**BASE, "model_type": {"a": 1}}, "model_type")
    wrapper = {"model_type": ["gemma3"], "text_config": dict(BASE)}
    refused(wrapper, "model_type")
    refused({**BASE, "text_config": {"model_type": ["x"]}, "num_hidden_layers": None}, "model_type")


def test_minifleet_vocab_size_zero_is_named_before_paddle():
    """Was ``num_embeddings must be gather than 0`` from paddle's Embedding."""
    with pytest.raises(ValueError, match="vocab_size must be an integer in \\[1"):
        make_config({**MINI, "vocab_size": 0})
    with pytest.raises(ValueError, match="layernorm_epsilon"):
        make_config({**MINI, "layernorm_epsilon": -1e-6})
    with pytest.raises(ValueError, match="rms_norm_eps"):
        make_config({**MINI, "rms_norm_eps": NAN})
    with pytest.raises(ValueError, match="rope_theta"):
        make_config({**MINI, "rope_theta": -10000.0})


# ---- layer_types: every input form ----------------------------------------------------------------

BAD_TYPES = [["full_attention", "bogus"], ["full_attention", ["x"]], ["full_attention", None], [1, 2]]


def _forms(config: dict, tmp_path: Path, monkeypatch) -> dict[str, object]:
    """The same config as a dict, a config.json, a model directory, a preset and an attribute object."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    import fastdeploy_paddlefleet.presets as presets

    real_list, real_load = presets.list_presets, presets.load_preset
    monkeypatch.setattr(presets, "list_presets", lambda: [*real_list(), "hostile-preset"])
    monkeypatch.setattr(
        presets, "load_preset", lambda name: dict(config) if name == "hostile-preset" else real_load(name)
    )
    return {
        "dict": dict(config),
        "config.json": str(d / "config.json"),
        "model dir": str(d),
        "preset": "hostile-preset",
        "object": SimpleNamespace(**config),
    }


@pytest.mark.parametrize("model_type", [None, "qwen3", "exaone4", "minifleet"])
@pytest.mark.parametrize("layer_types", BAD_TYPES, ids=[str(b) for b in BAD_TYPES])
def test_unknown_layer_types_are_refused_in_every_form(tmp_path, monkeypatch, model_type, layer_types):
    """An unknown entry is refused, never planned as full attention (was: accepted without model_type)."""
    config = {**BASE, "sliding_window": 8, "layer_types": layer_types}
    if model_type is not None:
        config["model_type"] = model_type
    if model_type == "minifleet":
        config["sliding_window"] = [8, 0]
    for form, source in _forms(config, tmp_path, monkeypatch).items():
        msg = refused(source, "layer_types")
        assert "bogus" in msg or "not an attention" in msg or "entries" in msg, (form, msg)


def test_known_layer_types_plan_as_written(tmp_path, monkeypatch):
    """Positive control: the same forms with valid entries plan layer by layer as listed."""
    config = {**BASE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    for form, source in _forms(config, tmp_path, monkeypatch).items():
        if form == "object":
            source = SimpleNamespace(**config, window_convention="hf")  # HF rules for an object
        assert [layer.kind for layer in plan_from_config(source)] == ["sliding", "full"], form


def test_a_paddleformers_config_with_unknown_layer_types_is_refused():
    pytest.importorskip("paddle")
    transformers = pytest.importorskip("paddleformers.transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        layer_types=["full_attention", "bogus"],
    )
    refused(config, "layer_types", "bogus")


# ---- the CLI: field and file named, exit 2, nothing changed ----------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CLI_FIELDS = [
    ("rope_theta", -1.0),
    ("layernorm_epsilon", -1e-6),
    ("layernorm_epsilon", 0.0),
    ("rms_norm_eps", NAN),
    ("vocab_size", 0),
    ("mtp_num_layers", 10**9),
]


@pytest.mark.parametrize(("field", "value"), CLI_FIELDS, ids=[f"{f}={v}" for f, v in CLI_FIELDS])
@pytest.mark.parametrize("command", ["plan", "verify"])
def test_cli_names_the_field_and_the_file(tmp_path, capsys, command, field, value):
    """``fdfleet verify --config`` printed ``FAILED: max abs logit diff inf`` for a negative rope_theta."""
    if command == "verify":
        pytest.importorskip("paddle")
    raw = load_config("tiny")
    raw[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    before = snapshot(tmp_path)
    argv = ("plan", str(path)) if command == "plan" else ("verify", "--config", str(path), "--steps", "1")
    code, out, err = _cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-300:], err[-300:])
    assert len(lines) == 1 and lines[0].startswith("fdfleet: error:"), err
    assert field in lines[0] and str(path) in lines[0], lines[0]
    assert "FAILED" not in out and "logit" not in err
    if command == "verify":
        assert "--config" in lines[0]
    assert snapshot(tmp_path) == before


def test_cli_refuses_a_huge_config_file_by_name(tmp_path, capsys):
    path = tmp_path / "config.json"
    with path.open("wb") as f:
        f.truncate(5 * 2**30)
    code, _, err = _cli(capsys, "plan", str(tmp_path))
    assert code == 2 and str(path) in err and "bytes" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("field", "value"), [("rms_norm_eps", -1.0), ("rope_theta", NAN), ("vocab_size", 0)])
def test_paddleformers_config_fields_name_the_flag_and_file(tmp_path, capsys, field, value):
    """``verify --paddleformers ARCH --config FILE``: the field as written in FILE, before the
    PaddleFormers config class moves it (rope_theta into rope_parameters)."""
    pytest.importorskip("paddleformers")
    raw = {"model_type": "llama", **BASE, "hidden_size": 64, "vocab_size": 128, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    before = snapshot(tmp_path)
    code, out, err = _cli(capsys, "verify", "--paddleformers", "llama", "--config", str(path), "--steps", "1")
    lines = [line for line in err.splitlines() if line.strip() and line.startswith("fdfleet")]
    assert code == 2 and len(lines) == 1, err
    assert "--config" in lines[0] and str(path) in lines[0] and field in lines[0], lines[0]
    assert snapshot(tmp_path) == before


def test_paddleformers_bad_arch_names_the_flag(capsys):
    code, _, err = _cli(capsys, "verify", "--paddleformers", "bogus")
    assert code == 2 and err.startswith("fdfleet: error: --paddleformers") and "'bogus'" in err


FUZZ_FIELDS = (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "v_head_dim", "vocab_size", "sliding_window", "window_attn_skip_freq", "head_wise_swa_ratio",
    "softmax_type", "softmax_scale", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
    "swa_v_head_dim", "rope_theta", "swa_rope_theta", "layernorm_epsilon", "rms_norm_eps",
    "ffn_hidden_size", "intermediate_size", "mtp_num_layers", "num_experts", "max_position_embeddings",
    "kv_lora_rank", "multi_latent_attention", "qk_nope_head_dim", "qk_rope_head_dim", "model_type",
    "layer_types", "rope_scaling", "query_pre_attn_scalar", "window_convention",
)  # fmt: skip
FUZZ_VALUES = (
    None, True, False, 0, -1, 1, 2, 3, 7, 10**12, 0.5, -0.5, NAN, INF, "x", "", [], [1], [1, 0], ["x"], {},
    [8, 0], 1.5, 2**31, "minifleet", "gemma3_text", {"type": "yarn", "factor": "x"}, {"rope_type": ["yarn"]},
)  # fmt: skip


def test_seeded_random_configs_fail_named_or_plan():
    """A seeded generator: 1 to 3 fields of a preset set to hostile values. Planning (and minifleet's
    config, what ``verify --config`` builds) either succeeds or raises ValueError / TypeError, one
    line naming a config field; never another exception (was: ``int()`` / ``OverflowError`` /
    ``unhashable type``), never a hang."""
    from fastdeploy_paddlefleet.presets import list_presets

    rng = random.Random(1919)
    bases = {name: load_config(name) for name in list_presets()}
    start = time.perf_counter()
    for _ in range(600):
        name = rng.choice(sorted(bases))
        cfg = dict(bases[name])
        changed = [rng.choice(FUZZ_FIELDS) for _ in range(rng.randint(1, 3))]
        for field in changed:
            cfg[field] = rng.choice(FUZZ_VALUES)
        try:
            plan_from_config(cfg)
            if cfg.get("model_type") == "minifleet":
                make_config(cfg)
        except (ValueError, TypeError) as e:
            msg = str(e)
            assert "\n" not in msg and any(f in msg for f in FUZZ_FIELDS), (name, changed, msg)
    assert time.perf_counter() - start < 60
