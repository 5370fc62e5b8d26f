"""Bounds of a model config, checked before anything is read or built (stdlib only).

Two kinds of checks, both raising ``ValueError`` that names the config field
(never a value derived from it, e.g. a softmax scale computed from
``rope_scaling``):

* **caps** (:func:`check_caps`, :func:`read_json_file`): a config file's size
  before it is parsed, and layer / MTP layer / head counts before any
  per-layer list is made, so a hostile config is refused at once instead of
  exhausting memory;
* **numeric fields** (:func:`check_numeric_fields`): every number the plan,
  minifleet or a host model reads (norm epsilons, RoPE bases and scaling,
  vocabulary and hidden sizes, ...): NaN, infinity, a negative value and zero
  where zero means nothing are refused.

``plan.config`` and ``minifleet.config`` both call these, so ``fdfleet plan``
and ``fdfleet verify --config`` give the same message for the same field.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

#: upper bounds, each refused by name before a config is read or expanded
MAX_INT = 2**31 - 1
MAX_LAYERS = 10_000
MAX_MTP_LAYERS = 64
MAX_HEADS = 65_536
MAX_HEAD_DIM = 65_536
#: a config.json is a few KiB (a per-layer list for 10,000 layers is ~300 KiB); more is not a config
MAX_CONFIG_BYTES = 16 * 2**20

#: count field -> its cap (``check_caps`` and ``plan.config._int`` read it)
LIMITS: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "num_layers"), MAX_LAYERS),
    **dict.fromkeys(("mtp_num_layers", "num_nextn_predict_layers"), MAX_MTP_LAYERS),
    **dict.fromkeys(
        ("num_attention_heads", "num_key_value_heads", "num_query_groups", "swa_num_attention_heads")
        + ("swa_num_key_value_heads",),
        MAX_HEADS,
    ),
    **dict.fromkeys(
        ("head_dim", "kv_channels", "v_head_dim", "swa_head_dim", "swa_v_head_dim", "kv_lora_rank")
        + ("qk_nope_head_dim", "qk_rope_head_dim", "qk_nope_head_dim + qk_rope_head_dim"),
        MAX_HEAD_DIM,
    ),
}


def regular_file_size(path: str | Path, what: str) -> int:
    """The size of ``path`` after checking it is a regular file (symbolic links followed):
    ``ValueError`` naming ``what`` and the path for a FIFO, socket, device, directory or a missing
    file. Opening a FIFO blocks until a writer comes, a device can be endless: model files are
    regular files or nothing."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r}: cannot read: {e.strerror or e}") from None
    _check_regular(st.st_mode, path, what)
    return st.st_size


def _check_regular(mode: int, path: str | Path, what: str) -> None:
    import stat as stat_mod

    if not stat_mod.S_ISREG(mode):
        kind = (
            "a FIFO (named pipe)"
            if stat_mod.S_ISFIFO(mode)
            else "a socket"
            if stat_mod.S_ISSOCK(mode)
            else "a device"
            if stat_mod.S_ISCHR(mode) or stat_mod.S_ISBLK(mode)
            else "a directory"
            if stat_mod.S_ISDIR(mode)
            else "not a regular file"
        )
        raise ValueError(f"{what} {str(path)!r} is {kind}: only regular files are read")


def open_regular(path: str | Path, what: str) -> tuple[BinaryIO, int]:
    """``(binary file, size)`` of ``path`` opened for reading, refused (``ValueError`` naming
    ``what`` and the path) unless it is a regular file: checked on the open file itself, so a FIFO
    put in its place after a check neither blocks (opened non-blocking) nor is read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        _check_regular(st.st_mode, path, what)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return f, st.st_size


def read_json_file(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The JSON object in ``path``, refused by file name (and ``what`` it is) when not a regular file,
    larger than ``MAX_CONFIG_BYTES`` (both checked before a byte is read), not UTF-8, not JSON, nested
    too deeply or not an object."""
    path = Path(path)
    try:
        size = regular_file_size(path, what)
        if size > MAX_CONFIG_BYTES:
            raise ValueError(
                f"{path}: {size} bytes, more than a config.json may hold ({MAX_CONFIG_BYTES} bytes, "
                "plan.fields.MAX_CONFIG_BYTES): not a model config"
            )
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since stat()
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: more than {MAX_CONFIG_BYTES} bytes: not a model config")
        data = json.loads(raw.decode("utf-8-sig"))  # a UTF-8 byte-order mark is fine
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): not a config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON: nested too deeply") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read(config: Any) -> Callable[[str], Any]:
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` of count field ``name`` as an int in ``[minimum, LIMITS.get(name, MAX_INT)]``;
    ``ValueError`` naming the field and the range otherwise (a bool or a float is not a count)."""
    maximum = LIMITS.get(name, MAX_INT)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """``repr`` of a config value, cut so that one refused value never floods the terminal."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def check_caps(config: Any) -> None:
    """Refuse layer, MTP layer and head counts above their caps (``LIMITS``) by field name,
    before anything per layer is built. ``config``: a mapping or an attribute object; absent
    (``None``) fields pass (a missing required one is named later, where it is required)."""
    read = _read(config)
    for name, minimum in (
        ("num_hidden_layers", 1),
        ("num_layers", 1),
        ("mtp_num_layers", 0),
        ("num_nextn_predict_layers", 0),
        ("num_attention_heads", 1),
        ("num_key_value_heads", 1),
        ("num_query_groups", 1),
        ("swa_num_attention_heads", 1),
        ("swa_num_key_value_heads", 1),
    ):
        value = read(name)
        if value is not None:
            check_count(name, value, minimum)
    model_type = read("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"model_type must be a string, got {_short(model_type)}")
    for name in ("layer_types", "window_attn_skip_freq", "hybrid_layer_pattern", "head_wise_swa_ratio"):
        value = read(name)
        if isinstance(value, list | tuple) and len(value) > MAX_LAYERS + MAX_MTP_LAYERS:
            raise ValueError(
                f"{name} has {len(value)} entries, more than the {MAX_LAYERS + MAX_MTP_LAYERS} layers "
                "a model may have (plan.fields.MAX_LAYERS + MAX_MTP_LAYERS)"
            )


# ---- numeric fields ---------------------------------------------------------------------------------


def _number(name: str, value: Any, *, low: float, low_open: bool, high: float = math.inf) -> None:
    """A finite real in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and value <= high
    )
    if not ok:
        bracket = "(" if low_open else "["
        upper = "inf)" if high == math.inf else f"{high:g}]"
        raise ValueError(f"{name} must be a finite number in {bracket}{low:g}, {upper}, got {_short(value)}")


def _positive(name: str, value: Any) -> None:
    _number(name, value, low=0.0, low_open=True)


def _non_negative(name: str, value: Any) -> None:
    _number(name, value, low=0.0, low_open=False)


def _fraction(name: str, value: Any) -> None:
    _number(name, value, low=0.0, low_open=True, high=1.0)


def _probability(name: str, value: Any) -> None:
    _number(name, value, low=0.0, low_open=False, high=1.0)


def _int_at_least(minimum: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        check_count(name, value, minimum)

    return check


#: top-level numeric field -> its check (what zero or a negative value would mean decides the check)
NUMERIC_FIELDS: dict[str, Callable[[str, Any], None]] = {
    # RoPE bases and norm epsilons: 0 or less gives inf/NaN logits, never a model
    **dict.fromkeys(("rope_theta", "swa_rope_theta", "rotary_base", "rotary_emb_base"), _positive),
    **dict.fromkeys(
        ("layernorm_epsilon", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"),
        _positive,
    ),
    "rotary_scaling_factor": _positive,
    "mscale": _non_negative,
    "mscale_all_dim": _non_negative,
    "partial_rotary_factor": _fraction,
    "rotary_percent": _fraction,
    "routed_scaling_factor": _positive,
    **dict.fromkeys(("attention_dropout", "hidden_dropout", "attention_probs_dropout_prob"), _probability),
    "initializer_range": _non_negative,
    # sizes: an embedding or a linear layer of zero rows is not a model
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "intermediate_size", "ffn_hidden_size"),
        _int_at_least(1),
    ),
    "max_position_embeddings": _int_at_least(1),
    "q_lora_rank": _int_at_least(1),
    **dict.fromkeys(
        ("num_experts", "n_routed_experts", "num_local_experts", "n_shared_experts", "first_k_dense_replace")
        + ("num_empty_layers_add_in_head", "moe_intermediate_size", "num_experts_per_tok", "moe_topk")
        + ("moe_k",),
        _int_at_least(0),  # 0: a dense model's MoE fields
    ),
}

#: numeric fields inside ``rope_scaling`` / ``rope_parameters`` (HF's RoPE parameters)
ROPE_FIELDS: dict[str, Callable[[str, Any], None]] = {
    "factor": _positive,
    "rope_theta": _positive,
    "mscale": _non_negative,
    "mscale_all_dim": _non_negative,
    "beta_fast": _positive,
    "beta_slow": _positive,
    "low_freq_factor": _positive,
    "high_freq_factor": _positive,
    "attention_factor": _positive,
    "partial_rotary_factor": _fraction,
    "original_max_position_embeddings": _int_at_least(1),
}


def check_numeric_fields(config: Any) -> None:
    """Refuse NaN, infinity, negative and (where meaningless) zero values of every known numeric
    field of ``config`` (a mapping or an attribute object), naming the field: ``rope_theta``,
    ``rms_norm_eps``, ``rope_scaling.factor``, ... Absent (``None``) fields pass."""
    read = _read(config)
    for name, check in NUMERIC_FIELDS.items():
        value = read(name)
        if value is not None:
            check(name, value)
    for name in ("rope_scaling", "rope_parameters"):
        rope = read(name)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"{name} must be a mapping (JSON object) or null, got {_short(rope)}")
        # newer HF configs give one set per layer type: {"full_attention": {...}, "sliding_attention": ...}
        nested = bool(rope) and all(isinstance(v, Mapping) for v in rope.values())
        for prefix, params in ((f"{name}.{k}", v) for k, v in rope.items()) if nested else ((name, rope),):
            for key, check in ROPE_FIELDS.items():
                value = params.get(key)
                if value is not None:
                    check(f"{prefix}.{key}", value)


__all__ = [
    "LIMITS",
    "MAX_CONFIG_BYTES",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYERS",
    "MAX_MTP_LAYERS",
    "check_caps",
    "check_count",
    "check_numeric_fields",
    "read_json_file",
    "regular_file_size",
]
