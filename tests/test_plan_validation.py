"""One test per validation rule: impossible configs raise ValueError naming the field and value."""

from __future__ import annotations

import json
import types

import pytest

from fastdeploy_paddlefleet.plan import load_config, plan_from_config


def base(**kw):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16}
    cfg.update(kw)
    return cfg


def raises(cfg, *fragments, **kw):
    with pytest.raises(ValueError) as e:
        plan_from_config(cfg, **kw)
    msg = str(e.value)
    for frag in fragments:
        assert frag in msg, msg
    assert "\n" not in msg
    return msg


def test_heads_not_divisible_by_kv_heads():
    raises(base(num_key_value_heads=3), "num_attention_heads=8", "num_key_value_heads=3")


def test_old_name_in_message():
    raises(
        {"num_layers": 1, "num_attention_heads": 6, "num_query_groups": 4, "kv_channels": 8},
        "num_query_groups=4",
    )


def test_swa_heads_not_divisible():
    cfg = base(sliding_window=8, swa_num_key_value_heads=3)
    raises(cfg, "swa_num_key_value_heads=3", "num_attention_heads=8")


def test_heads_not_divisible_by_tp():
    raises(base(), "num_attention_heads=8", "tp_size=3", tp_size=3)


def test_kv_heads_not_divisible_by_tp():
    raises(
        base(num_attention_heads=12, num_key_value_heads=6), "num_key_value_heads=6", "tp_size=4", tp_size=4
    )


def test_tp_not_multiple_of_kv_heads():
    raises(
        base(num_attention_heads=24, num_key_value_heads=3), "tp_size=4", "num_key_value_heads=3", tp_size=4
    )


@pytest.mark.parametrize("rank", [-1, 2])
def test_tp_rank_out_of_range(rank):
    raises(base(), "tp_rank", repr(rank), tp_size=2, tp_rank=rank)


def test_tp_size_not_positive():
    raises(base(), "tp_size", "0", tp_size=0)


@pytest.mark.parametrize("window", [0, -2, [0, 0], [-5, 0]])
def test_window_zero_or_below_minus_one(window):
    raises(base(sliding_window=window), "sliding_window", repr(window))


def test_window_nonzero_right():
    raises(base(sliding_window=[4, 2]), "sliding_window", "[4, 2]")


def test_window_not_an_int():
    raises(base(sliding_window="128"), "sliding_window", "'128'")


def test_window_field_alias_named():
    raises(base(window_size=0), "window_size", "0")


def test_unknown_convention():
    raises(base(sliding_window=4), "convention", "'flash'", convention="flash")


def test_tuple_with_int_convention():
    raises(base(sliding_window=[4, 0]), "sliding_window", "convention='hf'", convention="hf")


def test_int_window_with_tuple_convention():
    raises(
        base(sliding_window=4, window_convention="paddlefleet-tuple"), "window_convention", "sliding_window=4"
    )


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_outside_unit_interval(ratio):
    raises(base(sliding_window=8, head_wise_swa_ratio=ratio), "head_wise_swa_ratio", repr(ratio))


def test_ratio_gives_no_sliding_head():
    raises(base(sliding_window=8, head_wise_swa_ratio=0.2), "head_wise_swa_ratio=0.2", "no sliding head")


def test_ratio_list_wrong_length():
    raises(base(sliding_window=8, head_wise_swa_ratio=[0.5, 0.5]), "head_wise_swa_ratio", "[0.5, 0.5]")


def test_ratio_list_on_full_layer():
    cfg = base(sliding_window=8, window_attn_skip_freq=2, head_wise_swa_ratio=[0.5, 0, 0, 0])
    raises(cfg, "head_wise_swa_ratio[0]=0.5")


def test_skip_frequency_list_wrong_length():
    raises(base(sliding_window=8, window_attn_skip_freq=[0, 1, 1]), "window_attn_skip_freq", "[0, 1, 1]")


def test_skip_frequency_list_bad_entry():
    raises(
        base(sliding_window=8, window_attn_skip_freq=[0, 1, 2, 1]), "window_attn_skip_freq", "[0, 1, 2, 1]"
    )


def test_skip_frequency_zero():
    raises(base(sliding_window=8, window_attn_skip_freq=0), "window_attn_skip_freq", "0")


def test_layer_types_wrong_length():
    raises(base(sliding_window=8, layer_types=["full_attention"]), "layer_types", "['full_attention']")


def test_layer_types_sliding_without_window():
    raises(base(layer_types=["sliding_attention"] * 4), "layer_types", "sliding_window")


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads"])
def test_missing_required_field(field):
    cfg = base()
    del cfg[field]
    raises(cfg, "missing required field", field)


def test_missing_hidden_size_without_head_dim():
    cfg = base()
    del cfg["head_dim"]
    raises(cfg, "missing required field", "hidden_size")


def test_missing_field_on_attribute_object():
    ns = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64)
    raises(ns, "missing required field", "num_attention_heads")


def test_unknown_softmax_type():
    raises(base(softmax_type="sparsemax"), "softmax_type", "'sparsemax'")


def test_bad_head_count_type():
    raises(base(num_attention_heads=8.0), "num_attention_heads", "8.0")


def test_nonpositive_softmax_scale():
    raises(base(softmax_scale=0), "softmax_scale", "0")


def test_mla_missing_field():
    cfg = base(multi_latent_attention=True, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8)
    raises(cfg, "missing required field", "v_head_dim")
    del cfg["kv_lora_rank"]
    raises(cfg, "missing required field", "kv_lora_rank")


def test_bad_source(tmp_path):
    with pytest.raises(ValueError, match="no such preset"):
        load_config("no-such-model")
    with pytest.raises(ValueError, match="no such file"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        load_config(arr)
