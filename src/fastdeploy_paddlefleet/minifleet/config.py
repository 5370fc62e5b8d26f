"""minifleet's config: PaddleFleet ``TransformerConfig`` field names and defaults.

Deliberately independent of ``plan``: the window, sink and head-count rules
below are written from PaddleFleet's behaviour (HOST_INTERFACES.md), so that
``fdfleet verify`` checks the plan against a second, separate reading of the
same config fields. Only the input bounds are shared (``plan.fields``: file
size, count caps, numeric fields), so a bad field gets the same message from
``fdfleet plan`` and ``fdfleet verify --config``. Stdlib only.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from types import SimpleNamespace
from typing import Any

from ..plan.fields import check_caps, check_count, check_numeric_fields, read_json_file

# Old/new PaddleFleet (and HF) spellings of the same field: alias -> canonical name.
_ALIASES = {
    "num_layers": "num_hidden_layers",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "window_size": "sliding_window",
    "sliding_window_size": "sliding_window",
    "hybrid_layer_pattern": "window_attn_skip_freq",
    "intermediate_size": "ffn_hidden_size",
    "rms_norm_eps": "layernorm_epsilon",
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


class MiniFleetConfig(SimpleNamespace):
    """An attribute bag like PaddleFleet's ``TransformerConfig``: every raw field plus defaults.

    Being an attribute object (not a dict / HF ``PretrainedConfig``) matters:
    ``plan.plan_from_config`` reads it with PaddleFleet's rules (which layers
    slide, MTP layers, MLA), as the host's own ``TransformerConfig`` is read.
    """

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


def load_raw_config(config: dict | str | os.PathLike) -> dict[str, Any]:
    """A config dict from a dict, a preset name (``tiny``) or a JSON file path."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, MiniFleetConfig):
        return dict(vars(config))
    if not isinstance(config, str | os.PathLike):
        raise TypeError(f"config must be a dict, a preset name or a path, got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.isfile(path):
        return read_json_file(path)  # size capped before reading; errors name the file
    else:
        preset = resources.files("fastdeploy_paddlefleet.presets").joinpath(f"{path}.json")
        if not preset.is_file():
            raise ValueError(f"config {path!r} is neither a JSON file nor a preset name")
        data = json.loads(preset.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"config {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def make_config(config: dict | str | os.PathLike | MiniFleetConfig) -> MiniFleetConfig:
    """Resolve aliases and fill PaddleFleet's defaults (see HOST_INTERFACES.md)."""
    if isinstance(config, MiniFleetConfig):
        return config
    raw = {k: v for k, v in load_raw_config(config).items() if not k.startswith("_")}
    # before the aliases are resolved, so that the message names the field as written
    check_caps(raw)  # before any per-layer list is built
    check_numeric_fields(raw)  # NaN / negative / zero epsilons, RoPE bases, sizes: named by field
    for alias, name in _ALIASES.items():
        if raw.get(name) is None and raw.get(alias) is not None:
            raw[name] = raw[alias]
    for name in _REQUIRED:
        if raw.get(name) is None:
            raise ValueError(f"config field {name!r} is required (got None)")
    c = dict(raw)

    def size(name: str, fallback: int) -> int:
        """A head count or dim: ``fallback`` when unset (None or 0, PaddleFleet's "not given"),
        else an int in range, refused by name (``int('x')`` / ``int(nan)`` named nothing)."""
        value = c.get(name)
        return fallback if value is None or value == 0 else check_count(name, value, 1)

    heads = check_count("num_attention_heads", c["num_attention_heads"], 1)
    c["num_key_value_heads"] = size("num_key_value_heads", heads)
    c["head_dim"] = size("head_dim", check_count("hidden_size", c["hidden_size"], 1) // heads)
    c["v_head_dim"] = size("v_head_dim", c["head_dim"])
    c["swa_num_attention_heads"] = size("swa_num_attention_heads", heads)
    c["swa_num_key_value_heads"] = size("swa_num_key_value_heads", c["num_key_value_heads"])
    c["swa_head_dim"] = size("swa_head_dim", c["head_dim"])
    # TransformerConfig: swa_v_head_dim falls back to v_head_dim (never to swa_head_dim)
    c["swa_v_head_dim"] = size("swa_v_head_dim", c["v_head_dim"])
    c["rope_theta"] = float(c.get("rope_theta") or 10000.0)
    c["swa_rope_theta"] = float(c.get("swa_rope_theta") or c["rope_theta"])
    defaults = {
        "softmax_scale": None,
        "softmax_type": "vanilla",
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True,  # PaddleFleet's default
        "sliding_window": None,
        "window_attn_skip_freq": None,
        "head_wise_swa_ratio": 0.0,
        "multi_latent_attention": False,
        "mtp_num_layers": 0,
        "num_empty_layers_add_in_head": 0,
        "q_lora_rank": None,
        "gated_attention": False,
        "layernorm_epsilon": 1e-6,
        "ffn_hidden_size": 4 * int(c["hidden_size"]),
        "num_experts": 0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    }
    for name, value in defaults.items():
        if c.get(name) is None:
            c[name] = value
    if c["softmax_type"] not in ("vanilla", "off-by-one", "learnable"):
        raise ValueError(
            f"config field 'softmax_type' must be vanilla/off-by-one/learnable, got {c['softmax_type']!r}"
        )
    if c["multi_latent_attention"]:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            if c.get(name) is None:
                raise ValueError(f"config field {name!r} is required with multi_latent_attention (got None)")
    for hq, hkv, what in (
        (heads, c["num_key_value_heads"], "num_attention_heads/num_key_value_heads"),
        (
            c["swa_num_attention_heads"],
            c["swa_num_key_value_heads"],
            "swa_num_attention_heads/swa_num_key_value_heads",
        ),
    ):
        if hq % hkv:
            raise ValueError(f"config fields {what} must divide evenly, got {hq}/{hkv}")
    window_left_size(c["sliding_window"])  # validates its form
    for name in ("mtp_num_layers", "num_empty_layers_add_in_head"):
        if isinstance(c[name], bool) or not isinstance(c[name], int) or c[name] < 0:
            raise ValueError(f"config field {name!r} must be an int >= 0, got {c[name]!r}")
    return MiniFleetConfig(**c)


def is_window_layer(config: MiniFleetConfig, layer_index: int) -> bool:
    """PaddleFleet's rule for which layers are sliding-window (``is_swa``) layers.

    ``layer_index`` is 0-based, counted after the empty head layers; MTP
    layers continue after ``num_hidden_layers``. Only ``sliding_window``
    (truthy) and ``window_attn_skip_freq`` decide; ``layer_types`` and
    ``use_sliding_window`` are not read. (PaddleFleet:
    ``transformer/attention.py`` ``Attention.__init__`` with
    ``transformer/utils.py`` ``is_layer_window_attention``.)
    """
    window = config.sliding_window
    if not window:
        return False
    freq = config.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return layer_index % freq != 0
    if isinstance(freq, list | tuple):
        if len(freq) <= layer_index:
            raise ValueError(
                f"config field 'window_attn_skip_freq' has no entry for layer {layer_index}: {freq}"
            )
        return bool(freq[layer_index])
    raise ValueError(f"config field 'window_attn_skip_freq' must be an int or a list, got {freq!r}")


def window_left_size(sliding_window: Any) -> int | None:
    """PaddleFleet's left window size ``W`` (int ``W`` or tuple ``(W, right)``); ``None`` when unset.

    It is what the FlashMask path adds to a key's row to get its first masked
    row (``j + W``): a query sees W keys including itself. A size <= 0 truncates nothing.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, list | tuple):
        if len(sliding_window) != 2 or int(sliding_window[1]) != 0:
            raise ValueError(f"config field 'sliding_window' must be (left, 0), got {sliding_window!r}")
        return int(sliding_window[0])
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"config field 'sliding_window' must be an int or (left, 0), got {sliding_window!r}")
    return sliding_window


def layer_head_wise_ratio(config: MiniFleetConfig, layer_index: int) -> float:
    """``head_wise_swa_ratio`` of one layer (a float, or this plugin's per-layer list)."""
    r = config.head_wise_swa_ratio
    if isinstance(r, list | tuple):
        if len(r) <= layer_index:
            raise ValueError(f"config field 'head_wise_swa_ratio' has no entry for layer {layer_index}: {r}")
        r = r[layer_index]
    return float(r or 0.0)
