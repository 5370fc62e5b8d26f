"""Hostile model configs through the Python API (``plan_from_config``, ``load_config``, ``kv_budget``):
a named ``ValueError`` / ``TypeError`` for every impossible, unbounded or malformed value, checked
before anything is built (a 10**8-layer config is refused at once, not built until memory runs out).
"""

from __future__ import annotations

import json
import math
import time

import pytest

from fastdeploy_paddlefleet.kvcache.layout import kv_budget
from fastdeploy_paddlefleet.plan import load_config, plan_from_config

BASE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


class Full(dict):
    """A whole config (not a change to ``BASE``)."""


def no(key: str, **extra) -> Full:
    return Full({**{k: v for k, v in BASE.items() if k != key}, **extra})


CASES = [
    # sizes: types, bounds
    ({"num_hidden_layers": 10**8}, "num_hidden_layers"),  # hung, growing memory
    ({"num_hidden_layers": 10_001}, "num_hidden_layers"),
    ({"num_hidden_layers": 1e8}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),  # a bool is not a count
    ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": -3}, "num_hidden_layers"),
    ({"num_hidden_layers": [2]}, "num_hidden_layers"),
    ({"num_attention_heads": 10**9, "num_key_value_heads": 10**9}, "num_attention_heads"),  # was accepted
    ({"num_attention_heads": 2.0}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 8}, "num_key_value_heads=8"),  # more kv heads than heads
    ({"head_dim": 10**12}, "head_dim"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": 16.5}, "head_dim"),
    ({"v_head_dim": 0}, "v_head_dim"),
    (no("head_dim", hidden_size=2), "hidden_size=2"),  # was ZeroDivisionError
    (no("head_dim", hidden_size=0), "hidden_size"),
    (no("head_dim"), "hidden_size"),
    (no("num_attention_heads"), "num_attention_heads"),
    (no("num_hidden_layers"), "num_hidden_layers"),
    # scales
    ({"softmax_scale": math.inf}, "softmax_scale"),  # was accepted
    ({"softmax_scale": math.nan}, "softmax_scale"),
    ({"softmax_scale": 0}, "softmax_scale"),
    ({"softmax_scale": -0.1}, "softmax_scale"),
    ({"softmax_scale": True}, "softmax_scale"),
    ({"softmax_scale": "0.1"}, "softmax_scale"),
    ({"query_pre_attn_scalar": math.inf}, "query_pre_attn_scalar"),  # was scale 0, accepted
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"query_pre_attn_scalar": -4}, "query_pre_attn_scalar"),
    ({"attn_logit_softcapping": math.inf}, "attn_logit_softcapping"),
    # windows
    ({"sliding_window": -5}, "sliding_window"),
    ({"sliding_window": 10**30}, "window"),
    ({"sliding_window": "8"}, "sliding_window"),
    ({"sliding_window": 8.0}, "sliding_window"),
    ({"sliding_window": True}, "sliding_window"),
    ({"sliding_window": [8, 0, 0]}, "sliding_window"),
    ({"sliding_window": [8, 4]}, "sliding_window"),  # a right window
    ({"sliding_window": 8, "head_wise_swa_ratio": math.nan}, "head_wise_swa_ratio"),
    ({"sliding_window": 8, "head_wise_swa_ratio": 1.5}, "head_wise_swa_ratio"),
    ({"sliding_window": 8, "head_wise_swa_ratio": -0.5}, "head_wise_swa_ratio"),
    ({"sliding_window": 8, "head_wise_swa_ratio": [0.5]}, "head_wise_swa_ratio"),
    ({"sliding_window": 8, "window_attn_skip_freq": 0}, "window_attn_skip_freq"),
    ({"sliding_window": 8, "window_attn_skip_freq": [1, 2]}, "window_attn_skip_freq"),
    ({"sliding_window": 8, "window_attn_skip_freq": [1]}, "window_attn_skip_freq"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    # other fields
    ({"softmax_type": "softmax+1"}, "softmax_type"),
    ({"swa_num_key_value_heads": 3, "sliding_window": 8}, "swa_num_key_value_heads=3"),
]


@pytest.mark.parametrize(("change", "field"), CASES, ids=[str(c)[:60] for c, _ in CASES])
def test_bad_configs_are_named(change, field):
    cfg = dict(change) if isinstance(change, Full) else {**BASE, **change}
    start = time.perf_counter()
    with pytest.raises((ValueError, TypeError)) as e:
        plan_from_config(cfg)
    assert time.perf_counter() - start < 5, "refused, but only after building"
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(tp_size=0), ValueError, "tp_size"),
        (dict(tp_size=True), ValueError, "tp_size"),
        (dict(tp_size=3), ValueError, "tp_size=3"),
        (dict(tp_rank=-1), ValueError, "tp_rank"),
        (dict(tp_rank="0"), ValueError, "tp_rank"),
        (dict(tp_size=2, tp_rank=2), ValueError, "tp_rank"),
        (dict(convention="fancy"), ValueError, "convention"),
    ],
)
def test_bad_tp_and_convention(kw, exc, match):
    with pytest.raises(exc, match=match):
        plan_from_config(dict(BASE), **kw)


# ---- files --------------------------------------------------------------------------------------


def test_file_errors_name_the_file(tmp_path):
    cases = {
        "nested.json": ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),  # RecursionError
        "binary.json": (bytes(range(256)) * 4, "not UTF-8"),  # did not name the file
        "malformed.json": ('{"num_hidden_layers": 2,', "invalid JSON"),
        "list.json": ("[1, 2]", "expected a JSON object"),
        "empty.json": ("", "invalid JSON"),
    }
    for name, (content, what) in cases.items():
        p = tmp_path / name
        p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
        with pytest.raises(ValueError) as e:
            load_config(str(p))
        assert name in str(e.value) and what in str(e.value), str(e.value)
        with pytest.raises(ValueError, match=name):
            plan_from_config(str(p))


def test_paths_that_are_not_config_files(tmp_path):
    d = tmp_path / "no such file"
    d.mkdir()
    with pytest.raises(ValueError, match="directory without a config.json"):
        load_config(str(d))  # said "no such file" about a directory that exists
    with pytest.raises(ValueError, match="not a regular file"):
        load_config("/dev/null")
    with pytest.raises(ValueError, match="no such file"):
        load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such preset"):
        load_config("nosuchpreset")
    with pytest.raises(ValueError, match="empty"):
        load_config("  ")
    with pytest.raises(TypeError, match="config source"):
        load_config(42)
    with pytest.raises(TypeError, match="config source"):
        load_config(None)


def test_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode())
    assert load_config(str(p)) == BASE
    assert len(plan_from_config(str(tmp_path))) == 2  # the directory form too


def test_json_infinity_in_a_file_is_refused(tmp_path):
    p = tmp_path / "inf.json"
    p.write_text(json.dumps(BASE)[:-1] + ', "softmax_scale": Infinity}')
    with pytest.raises(ValueError, match="softmax_scale"):
        plan_from_config(str(p))


# ---- KV budget ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(memory_gib=math.inf), "memory_gib"),  # was OverflowError
        (dict(memory_gib=1e300), "memory_gib"),  # was OverflowError
        (dict(memory_gib=math.nan), "memory_gib"),
        (dict(memory_gib=0), "memory_gib"),
        (dict(memory_gib="40"), "memory_gib"),
        (dict(memory_gib=True), "memory_gib"),
        (dict(context=10**15), "context"),  # was accepted
        (dict(context=0), "context"),
        (dict(context=8192.0), "context"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=10**12), "block_size"),
        (dict(dtype="junk"), "dtype"),
    ],
)
def test_bad_budgets_are_named(kw, match):
    plan = plan_from_config(dict(BASE))
    with pytest.raises(ValueError, match=match):
        kv_budget(plan, **kw)
