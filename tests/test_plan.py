"""plan_from_config: presets, input forms, aliases, conventions, sinks, MLA, TP.

Expected values are written out from the model cards / DESIGN.md rules, not
read back from the code.
"""

from __future__ import annotations

import json
import math
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy_paddlefleet.plan import AttentionPlan, MLADims, load_config, plan_from_config


def base(**kw):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 128}
    cfg.update(kw)
    return cfg


# ---------------------------------------------------------------- presets


def test_gpt_oss_20b():
    plan = plan_from_config("gpt-oss-20b")
    assert isinstance(plan, AttentionPlan) and len(plan) == 24 and plan.convention == "hf"
    for layer in plan:
        assert (layer.num_q_heads, layer.num_kv_heads, layer.qk_head_dim, layer.v_head_dim) == (64, 8, 64, 64)
        assert layer.sink == "learnable"
        assert layer.softmax_scale == pytest.approx(64**-0.5)
        if layer.index % 2 == 0:
            assert layer.kind == "sliding" and layer.window_left == 127 and layer.sliding_kv_heads == (0, 8)
        else:
            assert layer.kind == "full" and layer.window_left is None and layer.sliding_kv_heads is None


def test_deepseek_v3_mla():
    plan = plan_from_config("deepseek-v3")
    assert len(plan) == 61 and plan.convention == "none"
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    for layer in plan:
        assert (layer.kind, layer.num_q_heads, layer.num_kv_heads) == ("full", 128, 128)
        assert (layer.qk_head_dim, layer.v_head_dim) == (192, 128)
        assert layer.mla == MLADims(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, q_lora_rank=1536
        )
        assert layer.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)
        assert layer.sink == "vanilla"


def test_tiny_covers_every_kind():
    plan = plan_from_config("tiny")
    assert plan.convention == "paddlefleet-tuple"
    got = [(x.kind, x.window_left, x.sliding_kv_heads, x.sink, x.qk_head_dim, x.v_head_dim) for x in plan]
    assert got == [
        ("full", None, None, "off-by-one", 16, 16),
        ("sliding", 7, (0, 2), "learnable", 16, 8),
        ("headwise", 7, (1, 2), "learnable", 16, 8),
        ("full", None, None, "off-by-one", 16, 16),
        ("sliding", 7, (0, 2), "learnable", 16, 8),
    ]


def test_gemma3_pattern_and_scale():
    plan = plan_from_config("gemma3-27b")
    assert len(plan) == 62
    full = [x.index for x in plan if x.kind == "full"]
    assert full == list(range(5, 62, 6))
    assert all(x.window_left == 1023 for x in plan if x.kind == "sliding")
    assert all(x.softmax_scale == pytest.approx(168**-0.5) for x in plan)
    assert all((x.num_q_heads, x.num_kv_heads, x.qk_head_dim) == (32, 16, 128) for x in plan)


def test_mimo_like_sliding_layers_own_heads():
    plan = plan_from_config("mimo-v2-flash-like")
    for x in plan:
        is_full = x.index == 0 or (x.index + 1) % 6 == 0
        assert x.kind == ("full" if is_full else "sliding")
        assert x.num_kv_heads == (4 if is_full else 8)
        assert x.sink == ("vanilla" if is_full else "learnable")
        assert (x.qk_head_dim, x.v_head_dim, x.num_q_heads) == (192, 128, 64)
        assert x.window_left == (None if is_full else 127)


def test_ernie_headwise():
    plan = plan_from_config("ernie-4.5-21b-a3b-headwise")
    assert len(plan) == 28
    for x in plan:
        assert (x.kind, x.num_q_heads, x.num_kv_heads, x.qk_head_dim) == ("headwise", 20, 4, 128)
        assert x.sliding_kv_heads == (1, 4) and x.window_left == 4095
        assert [x.head_window(h) for h in range(4)] == [None, 4095, 4095, 4095]


def test_tiny_mla():
    plan = plan_from_config("tiny-mla")
    assert [x.kind for x in plan] == ["full", "full", "full"]  # PaddleFleet's MLA layers never slide
    for x in plan:
        # one kv head per query head, whatever num_key_value_heads (2) says
        assert (x.num_q_heads, x.num_kv_heads, x.qk_head_dim, x.v_head_dim) == (4, 4, 24, 16)
        assert x.sink == "learnable"
        assert x.mla.q_lora_rank is None and x.mla.kv_lora_rank == 32
        assert x.softmax_scale == pytest.approx(24**-0.5)


# ---------------------------------------------------------------- input forms


def test_path_and_directory(tmp_path):
    cfg = base(sliding_window=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for src in (tmp_path / "config.json", str(tmp_path / "config.json"), tmp_path):
        plan = plan_from_config(src)
        assert plan.source == str(src)
        assert [x.window_left for x in plan] == [15] * 4
    assert load_config(tmp_path) == cfg


def test_attribute_object_is_paddlefleet_int():
    ns = types.SimpleNamespace(**base(sliding_window=16))
    plan = plan_from_config(ns)
    assert plan.convention == "paddlefleet-int" and plan.extras["rules"] == "paddlefleet"
    # PaddleFleet's FlashMask path: key j's first masked row is j + 16, 16 keys including the query
    assert [x.window_left for x in plan] == [15] * 4


def test_pretrained_config_like_object_is_hf():
    class PretrainedConfig:  # stand-in base with the HF / PaddleFormers class name
        pass

    class MyConfig(PretrainedConfig):
        def __init__(self):
            self.__dict__.update(base(sliding_window=16))

    plan = plan_from_config(MyConfig())
    assert plan.convention == "hf" and plan[0].window_left == 15


def test_real_paddleformers_gpt_oss_config():
    pytest.importorskip("paddleformers")
    from paddleformers.transformers import GptOssConfig

    cfg = GptOssConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    plan = plan_from_config(cfg)
    assert plan.convention == "hf"
    assert [x.kind for x in plan] == ["sliding", "full", "sliding", "full"]
    assert plan[0].window_left == cfg.sliding_window - 1
    assert all(x.sink == "learnable" for x in plan)


def test_tuple_window_and_explicit_convention():
    # every form of W means W keys including the query: window_left = W - 1
    assert plan_from_config(base(sliding_window=[9, 0]))[0].window_left == 8
    assert plan_from_config(base(sliding_window=(9, 0)), convention="paddlefleet-tuple")[0].window_left == 8
    assert plan_from_config(base(sliding_window=9), convention="paddlefleet-int")[0].window_left == 8
    assert plan_from_config(base(sliding_window=9, window_convention="paddlefleet"))[0].window_left == 8
    ns = types.SimpleNamespace(**base(sliding_window=9))
    p = plan_from_config(ns, convention="hf")
    assert p.convention == "hf" and p[0].window_left == 8 and p.extras["rules"] == "hf"
    with pytest.raises(ValueError, match="PaddleFleet's form"):
        plan_from_config(base(sliding_window=[9, 0]), convention="hf")


def test_which_rules_read_a_config():
    """PaddleFleet's rules: an attribute object, a tuple window, model_type minifleet, or asked for."""
    both = base(sliding_window=8, window_attn_skip_freq=2, layer_types=["sliding_attention"] * 4)
    assert plan_from_config(both).extras["rules"] == "hf"  # a plain dict: HF (layer_types wins)
    assert [x.kind for x in plan_from_config(both)] == ["sliding"] * 4
    for cfg, kw in (
        (types.SimpleNamespace(**both), {}),
        (both, {"convention": "paddlefleet"}),
        (dict(both, window_convention="paddlefleet"), {}),
        (dict(both, sliding_window=[8, 0]), {}),
        (dict(both, model_type="minifleet"), {}),
    ):
        plan = plan_from_config(cfg, **kw)
        assert plan.extras["rules"] == "paddlefleet"
        # PaddleFleet reads window_attn_skip_freq only (transformer/utils.py is_layer_window_attention)
        assert [x.kind for x in plan] == ["full", "sliding", "full", "sliding"]
        assert plan[1].window_left == 7


def test_paddlefleet_ignores_use_sliding_window_and_pattern():
    ns = types.SimpleNamespace(**base(sliding_window=8, use_sliding_window=False, sliding_window_pattern=2))
    assert [x.kind for x in plan_from_config(ns)] == ["sliding"] * 4


def test_paddlefleet_mtp_layers_continue_the_layer_count():
    ns = types.SimpleNamespace(
        **base(sliding_window=8, window_attn_skip_freq=[0, 1, 0, 1, 1, 0], mtp_num_layers=2)
    )
    plan = plan_from_config(ns)
    assert [x.index for x in plan] == list(range(6))
    assert [x.kind for x in plan] == ["full", "sliding", "full", "sliding", "sliding", "full"]
    ns.mtp_num_layers = None
    ns.num_nextn_predict_layers = 1  # the HF name, when TransformerConfig has no mtp_num_layers
    assert len(plan_from_config(ns)) == 5
    ns.window_attn_skip_freq = [0, 1, 0, 1]  # no entry for the MTP layer
    with pytest.raises(ValueError, match="window_attn_skip_freq"):
        plan_from_config(ns)
    assert len(plan_from_config(base(num_nextn_predict_layers=1))) == 4  # HF configs: no MTP entries


def test_paddlefleet_infinite_window_keeps_sliding_heads():
    """-1: PaddleFleet's layers are still is_swa (sliding heads, dims, sink) but nothing is truncated."""
    ns = types.SimpleNamespace(
        **base(sliding_window=-1, window_attn_skip_freq=[1, 0, 0, 0], swa_num_key_value_heads=2)
    )
    ns.add_swa_attention_sink_bias = True
    plan = plan_from_config(ns)
    assert plan.convention == "none"
    assert [(x.kind, x.num_kv_heads, x.sink, x.window_left) for x in plan[:2]] == [
        ("full", 2, "learnable", None),
        ("full", 4, "vanilla", None),
    ]


def test_paddlefleet_mla_never_slides_and_sets_its_own_scale():
    ns = types.SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, multi_latent_attention=True,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4, sliding_window=4,
        softmax_scale=0.5, rotary_scaling_factor=40.0, mscale_all_dim=1.0,
    )  # fmt: skip
    plan = plan_from_config(ns)
    assert [x.kind for x in plan] == ["full", "full"]
    mscale = 0.1 * math.log(40.0) + 1.0
    assert all(x.num_kv_heads == 4 and x.softmax_scale == pytest.approx(mscale**2 / 4.0) for x in plan)


def test_infinite_window_and_no_window():
    for cfg in (
        base(sliding_window=-1),
        base(),
        base(sliding_window=[-1, 0]),
        base(sliding_window=8, use_sliding_window=False),
    ):
        plan = plan_from_config(cfg)
        assert plan.convention == "none" and all(x.kind == "full" and x.window_left is None for x in plan)


def test_aliases_old_field_names():
    old = {
        "num_layers": 3,
        "num_attention_heads": 8,
        "num_query_groups": 2,
        "kv_channels": 32,
        "window_size": [5, 0],
        "window_attn_skip_freq": 3,
    }
    plan = plan_from_config(old)
    assert len(plan) == 3
    assert [x.kind for x in plan] == ["full", "sliding", "sliding"]
    assert all((x.num_kv_heads, x.qk_head_dim, x.v_head_dim) == (2, 32, 32) for x in plan)
    assert plan[1].window_left == 4
    assert plan_from_config(base(sliding_window_size=10))[0].window_left == 9
    mimo = base(sliding_window=10, hybrid_layer_pattern=[0, 1, 1, 0])
    assert [x.kind for x in plan_from_config(mimo)] == ["full", "sliding", "sliding", "full"]


def test_defaults():
    plan = plan_from_config({"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64})
    x = plan[0]
    assert (x.num_kv_heads, x.qk_head_dim, x.v_head_dim, x.sink) == (4, 16, 16, "vanilla")
    assert x.softmax_scale == pytest.approx(0.25)
    assert x.q_head_range == (0, 4) and x.kv_head_range == (0, 4)


def test_softmax_scale_precedence():
    assert plan_from_config(base(softmax_scale=0.5, query_pre_attn_scalar=100))[0].softmax_scale == 0.5
    assert plan_from_config(base(query_pre_attn_scalar=100))[0].softmax_scale == pytest.approx(0.1)
    assert plan_from_config(base(head_dim=64))[0].softmax_scale == pytest.approx(0.125)


# ---------------------------------------------------------------- which layers slide


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({}, [1, 1, 1, 1, 1, 1]),
        ({"window_attn_skip_freq": 2}, [0, 1, 0, 1, 0, 1]),
        ({"window_attn_skip_freq": 3}, [0, 1, 1, 0, 1, 1]),
        ({"window_attn_skip_freq": [1, 0, 0, 1, 1, 0]}, [1, 0, 0, 1, 1, 0]),
        ({"sliding_window_pattern": 3}, [1, 1, 0, 1, 1, 0]),
        ({"layer_types": ["full_attention", "sliding_attention"] * 3}, [0, 1, 0, 1, 0, 1]),
        # layer_types wins over a skip frequency
        ({"layer_types": ["sliding_attention"] * 6, "window_attn_skip_freq": 2}, [1] * 6),
        # skip frequency wins over a Gemma pattern
        ({"window_attn_skip_freq": 2, "sliding_window_pattern": 3}, [0, 1, 0, 1, 0, 1]),
    ],
)
def test_which_layers_slide(extra, expected):
    plan = plan_from_config(base(num_hidden_layers=6, sliding_window=4, **extra))
    assert [int(x.kind == "sliding") for x in plan] == expected
    assert all(x.window_left == (3 if x.kind == "sliding" else None) for x in plan)


def test_swa_overrides():
    cfg = base(
        sliding_window=[3, 0],
        window_attn_skip_freq=2,
        head_dim=32,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=1,
        swa_head_dim=16,
    )
    plan = plan_from_config(cfg)
    full, slide = plan[0], plan[1]
    assert (full.num_q_heads, full.num_kv_heads, full.qk_head_dim, full.v_head_dim) == (8, 4, 32, 32)
    # swa_v_head_dim falls back to v_head_dim (itself head_dim), never to swa_head_dim
    assert (slide.num_q_heads, slide.num_kv_heads, slide.qk_head_dim, slide.v_head_dim) == (4, 1, 16, 32)
    plan = plan_from_config(dict(cfg, v_head_dim=24))
    assert (plan[0].v_head_dim, plan[1].v_head_dim) == (24, 24)
    plan = plan_from_config(dict(cfg, v_head_dim=24, swa_v_head_dim=8))
    assert (plan[0].v_head_dim, plan[1].v_head_dim) == (24, 8)


@pytest.mark.parametrize(
    "ratio,hkv,expected",
    [
        (0.0, 4, (0, 4)),
        (1.0, 4, (0, 4)),
        (0.5, 4, (2, 4)),
        (0.25, 4, (3, 4)),
        (0.75, 8, (2, 8)),
        (0.9, 4, (1, 4)),
    ],
)
def test_headwise_split_last_heads_slide(ratio, hkv, expected):
    plan = plan_from_config(base(num_key_value_heads=hkv, sliding_window=8, head_wise_swa_ratio=ratio))
    x = plan[0]
    n_slide = hkv - expected[0]
    assert x.kind == ("sliding" if n_slide == hkv else "headwise")
    assert x.sliding_kv_heads == expected
    # the first Hkv - int(r * Hkv) heads are full (DESIGN.md)
    assert [x.head_window(h) is None for h in range(hkv)] == [h < hkv - n_slide for h in range(hkv)]


def test_sinks_per_layer_kind():
    cfg = base(sliding_window=8, window_attn_skip_freq=2, softmax_type="off-by-one")
    assert [x.sink for x in plan_from_config(cfg)] == ["off-by-one"] * 4
    cfg["add_swa_attention_sink_bias"] = True
    assert [x.sink for x in plan_from_config(cfg)] == ["off-by-one", "learnable"] * 2
    cfg["add_full_attention_sink_bias"] = True
    cfg["add_swa_attention_sink_bias"] = False
    assert [x.sink for x in plan_from_config(cfg)] == ["learnable", "off-by-one"] * 2
    for hf in ({"model_type": "gpt_oss"}, {"use_sinks": True}, {"attention_sinks": True}):
        assert {x.sink for x in plan_from_config(base(**hf))} == {"learnable"}


def test_mla_detected_from_hf_fields():
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_size": 64,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "head_dim": 4,  # HF DeepSeek sets head_dim = rope dim; MLA ignores it
    }
    x = plan_from_config(cfg)[0]
    assert (x.qk_head_dim, x.v_head_dim, x.num_kv_heads) == (16, 8, 4)
    assert x.softmax_scale == pytest.approx(0.25)
    # an explicit multi_latent_attention=False wins over MLA dims a config class may default
    assert plan_from_config(dict(cfg, multi_latent_attention=False))[0].mla is None
    # yarn without mscale_all_dim: no correction
    x = plan_from_config(dict(cfg, rope_scaling={"type": "yarn", "factor": 4.0}))[0]
    assert x.softmax_scale == pytest.approx(0.25)


# ---------------------------------------------------------------- tensor parallel


def test_tp_halves_heads_and_slices_sinks():
    one = plan_from_config("gpt-oss-20b")
    for rank in (0, 1):
        plan = plan_from_config("gpt-oss-20b", tp_size=2, tp_rank=rank)
        assert (plan.tp_size, plan.tp_rank) == (2, rank)
        for a, b in zip(one, plan, strict=True):
            assert (b.num_q_heads, b.num_kv_heads) == (a.num_q_heads // 2, a.num_kv_heads // 2)
            assert b.q_head_range == (32 * rank, 32 * rank + 32)
            assert b.kv_head_range == (4 * rank, 4 * rank + 4)
            assert b.window_left == a.window_left and b.kind == a.kind


def test_tp_replicates_kv_heads():
    cfg = base(num_attention_heads=8, num_key_value_heads=2)
    got = [plan_from_config(cfg, tp_size=4, tp_rank=r)[0] for r in range(4)]
    assert [x.kv_head_range for x in got] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all((x.num_q_heads, x.num_kv_heads) == (2, 1) for x in got)


def test_tp_headwise_local_kind():
    """PaddleFleet masks head-wise SWA with each rank's own kv head count: the
    last int(r * kv_per_rank) local kv heads slide on every rank."""
    cfg = base(num_attention_heads=8, num_key_value_heads=4, sliding_window=8, head_wise_swa_ratio=0.5)
    for r in (0, 1):
        x = plan_from_config(cfg, tp_size=2, tp_rank=r)[0]
        assert (x.kind, x.sliding_kv_heads, x.window_left) == ("headwise", (1, 2), 7)
    cfg["head_wise_swa_ratio"] = 0.25  # int(0.25 * 2) == 0 sliding heads per rank
    with pytest.raises(ValueError, match="tp_size=2"):
        plan_from_config(cfg, tp_size=2, tp_rank=0)
    cfg["head_wise_swa_ratio"] = 1.0
    x = plan_from_config(cfg, tp_size=2, tp_rank=1)[0]
    assert (x.kind, x.sliding_kv_heads) == ("sliding", (0, 2))


@settings(max_examples=60, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4, 8]),
    ratio=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
)
def test_tp_shards_agree_with_global_heads(hkv, group, tp, ratio):
    """Every rank's local q head reads the kv head the global GQA rule gives, and
    a local kv head slides iff it is among the rank's last int(r * kv_per_rank)."""
    hq = hkv * group
    if hq % tp or (hkv >= tp and hkv % tp) or (hkv < tp and tp % hkv):
        return
    kv_local = max(hkv // tp, 1)
    n_slide = kv_local if ratio in (0.0, 1.0) else int(ratio * kv_local)
    if n_slide == 0:
        return
    cfg = {
        "num_hidden_layers": 1,
        "num_attention_heads": hq,
        "num_key_value_heads": hkv,
        "head_dim": 8,
        "sliding_window": 4,
        "head_wise_swa_ratio": ratio,
    }
    covered = []
    for rank in range(tp):
        x = plan_from_config(cfg, tp_size=tp, tp_rank=rank)[0]
        q0, q1 = x.q_head_range
        covered.extend(range(q0, q1))
        assert x.num_q_heads == q1 - q0 == hq // tp
        for j in range(x.num_q_heads):
            global_kv = (q0 + j) // group
            local_kv = j // x.group_size
            assert x.kv_head_range[0] + local_kv == global_kv
            slides = local_kv >= kv_local - n_slide
            assert (x.head_window(local_kv) == 3) == slides
    assert covered == list(range(hq))


def test_paddleformers_deepseek_config_is_mla_despite_base_class_flag():
    """PaddleFormers' PretrainedConfig defaults multi_latent_attention=False on
    every model; a DeepseekV3Config is still MLA (its dims decide)."""
    pytest.importorskip("paddleformers")
    from paddleformers.transformers.deepseek_v3.configuration import DeepseekV3Config

    cfg = DeepseekV3Config(
        num_hidden_layers=1,
        num_attention_heads=4,
        hidden_size=64,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    assert getattr(cfg, "multi_latent_attention", False) is False
    x = plan_from_config(cfg)[0]
    assert (x.qk_head_dim, x.v_head_dim, x.mla.kv_lora_rank) == (24, 16, 16)


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [(0.0, (0, 4)), (0.2, (0, 4)), (1.0, (0, 4)), (0.5, (2, 4)), (0.75, (1, 4))],
)
def test_paddlefleet_headwise_ratio_all_heads_edge_cases(ratio, expected):
    """n = int(r * Hkv): 0 < n < Hkv slides the last n kv heads, anything else every head."""
    ns = types.SimpleNamespace(**base(sliding_window=8, head_wise_swa_ratio=ratio))
    plan = plan_from_config(ns)
    assert all(x.sliding_kv_heads == expected and x.window_left == 7 for x in plan)
    assert all(x.kind == ("sliding" if expected == (0, 4) else "headwise") for x in plan)
