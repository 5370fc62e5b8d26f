"""Build the per-layer attention plan from a model config (stdlib only).

``plan_from_config(config, tp_size, tp_rank)`` reads a dict, a ``config.json``
path (or a preset name) or any attribute object (a PaddleFleet
``TransformerConfig``, a PaddleFormers / HF ``PretrainedConfig``) and returns an
:class:`AttentionPlan` with one :class:`LayerAttention` per layer for that
rank. The mapping from config fields to the plan is documented in
``docs/plan.md``; the semantics are DESIGN.md's "Canonical attention
semantics". Impossible configs raise ``ValueError`` naming the field and value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .fields import LIMITS, MAX_INT, check_caps, check_numeric_fields, read_json_file
from .layer import SINK_KINDS, AttentionPlan, LayerAttention, MLADims
from .model_types import check_layer_types, hf_overrides, text_model

CONVENTIONS: tuple[str, ...] = ("hf", "paddlefleet", "paddlefleet-tuple", "paddlefleet-int")

# canonical name -> names read, first non-None wins (new name first, then old ones)
ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "num_layers"),
    "num_key_value_heads": ("num_key_value_heads", "num_query_groups"),
    "head_dim": ("head_dim", "kv_channels"),
    "sliding_window": ("sliding_window", "window_size", "sliding_window_size"),
    "window_attn_skip_freq": ("window_attn_skip_freq", "hybrid_layer_pattern"),
}


class _Fields:
    """Uniform, alias-aware read access to a dict or an attribute object."""

    def __init__(self, config: Any):
        if isinstance(config, Mapping):
            self._read: Callable[[str], Any] = config.get
            self.origin = "dict"
        else:
            self._read = lambda name: getattr(config, name, None)
            is_pretrained = any(c.__name__.lower() == "pretrainedconfig" for c in type(config).__mro__)
            self.origin = "pretrained" if is_pretrained else "object"
        #: read before the config: a model type's resolved values (``model_types``); None = absent
        self.overrides: dict[str, Any] = {}

    def named(self, name: str) -> tuple[str, Any]:
        """``(field name actually found, value)``; ``(name, None)`` when absent."""
        for alias in ALIASES.get(name, (name,)):
            value = self.overrides[alias] if alias in self.overrides else self._read(alias)
            if value is not None:
                return alias, value
        return name, None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.named(name)[1]
        return default if value is None else value


def _int(value: Any, field: str, minimum: int = 1) -> int:
    maximum = LIMITS.get(field, MAX_INT)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{field} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def _positive(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{field} must be a finite positive number, got {value!r}")
    return float(value)


def _required(f: _Fields, name: str, why: str = "") -> tuple[str, int]:
    field, value = f.named(name)
    if value is None:
        raise ValueError(f"missing required field {name!r}{why}")
    return field, _int(value, field)


def load_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """Read a config as a dict: a mapping (copied), a ``config.json`` path, a model
    directory holding ``config.json``, or a preset name (see ``presets``).

    An existing path wins over a preset of the same name.
    """
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, str | Path):
        raise TypeError(f"config source must be a path, preset name or mapping, got {type(source).__name__}")
    if not str(source).strip():
        raise ValueError("config source is empty: give a config.json path, a model directory or a preset")
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"config {str(source)!r}: a directory without a config.json")
        path = path / "config.json"
    elif path.exists() and not path.is_file():
        raise ValueError(f"config {str(source)!r}: not a regular file")
    if path.is_file():
        return read_json_file(path)
    name = str(source)
    if "/" not in name and "\\" not in name and not name.endswith(".json"):
        from ..presets import list_presets, load_preset

        if name in list_presets():
            return load_preset(name)
        raise ValueError(
            f"config {name!r}: no such file and no such preset (presets: {', '.join(list_presets())})"
        )
    raise ValueError(f"config {name!r}: no such file")


def _paddlefleet_rules(f: _Fields, convention: str | None) -> bool:
    """Whether the config is read with PaddleFleet's rules (True) or HF's (False).

    The ``convention=`` argument, else a ``window_convention`` field: ``hf`` or
    ``paddlefleet`` (``paddlefleet-int`` / ``paddlefleet-tuple`` mean the same).
    Else PaddleFleet for an attribute object that is not a ``PretrainedConfig``
    (PaddleFleet's ``TransformerConfig``, minifleet's config), a ``(left, right)``
    window (a form only PaddleFleet has) or ``model_type == "minifleet"``; HF otherwise.
    """
    for source, conv in (("convention", convention), ("window_convention", f.get("window_convention"))):
        if conv is not None:
            if conv not in CONVENTIONS:
                raise ValueError(f"{source} must be one of {', '.join(CONVENTIONS)}, got {conv!r}")
            return conv != "hf"
    if isinstance(f.get("sliding_window"), list | tuple) or f.get("model_type") == "minifleet":
        return True
    return f.origin == "object"


def _window(f: _Fields, paddlefleet: bool, convention: str | None = None) -> tuple[int | None, bool, str]:
    """``(window_left, window_set, convention)``; ``window_left`` None means no finite window.

    HF: ``window_set`` is True when the config names a window at all (infinite
    ``-1`` included), used to reject ``layer_types`` that slide without one.
    PaddleFleet: ``window_set`` is whether layers can be sliding (``is_swa``)
    layers at all: a truthy ``sliding_window`` (``transformer/utils.py``
    ``is_layer_window_attention``). Its FlashMask path
    (``startend_row_indices_add_sliding_window``) puts key ``j``'s first masked
    row at ``j + W`` for an int ``W`` and a ``(W, right)`` tuple alike: W keys
    including the query, ``window_left = W - 1``; ``-1`` truncates nothing (the
    layers still take the sliding-layer heads and sink). A ``convention`` (argument
    or ``window_convention``) naming the other form than the value's is an error.
    """
    named = convention if convention is not None else f.get("window_convention")
    field, raw = f.named("sliding_window")
    if paddlefleet:
        if not raw:
            return None, False, "none"
        if isinstance(raw, list | tuple):
            if len(raw) != 2:
                raise ValueError(f"{field} as a sequence must be (left, right), got {raw!r}")
            left, right = raw
            if right != 0:
                raise ValueError(f"{field}={raw!r}: a right window must be 0 for causal attention")
            conv = "paddlefleet-tuple"
        else:
            left, conv = raw, "paddlefleet-int"
        if named in ("paddlefleet-int", "paddlefleet-tuple") and named != conv:
            source = "convention" if convention is not None else "window_convention"
            raise ValueError(f"{source}={named!r} does not apply to {field}={raw!r}")
        if isinstance(left, bool) or not isinstance(left, int):
            raise ValueError(f"{field} must be an int or (left, right) ints, got {raw!r}")
        if left == 0 or left < -1:  # (0, 0): PaddleFleet would slide nothing yet use the sliding heads
            raise ValueError(f"{field}={raw!r}: a window must be positive or -1 (infinite)")
        return (left - 1 if left > 0 else None), True, conv
    if raw is None or f.get("use_sliding_window") is False:
        return None, False, "none"
    if isinstance(raw, list | tuple):
        raise ValueError(
            f"{field}={raw!r} is a (left, right) tuple, PaddleFleet's form, but the config is read "
            "with HF rules (convention='hf')"
        )
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{field} must be an int or (left, right) ints, got {raw!r}")
    if raw == -1:
        return None, True, "none"  # infinite window: nothing slides
    if raw == 0 or raw < -1:
        raise ValueError(f"{field}={raw!r}: a window must be positive or -1 (infinite)")
    return raw - 1, True, "hf"


def _mtp_layers(f: _Fields) -> int:
    """PaddleFleet's multi-token-prediction layers: ``mtp_num_layers``, else ``num_nextn_predict_layers``."""
    for name in ("mtp_num_layers", "num_nextn_predict_layers"):
        value = f.get(name)
        if value is not None:
            return _int(value, name, 0)
    return 0


def _paddlefleet_flags(f: _Fields, total: int, window_set: bool, mla: bool) -> list[bool]:
    """PaddleFleet's ``is_swa`` of each layer (``transformer/attention.py`` ``Attention.__init__``).

    Layer ``i`` is 0-based, counted after ``num_empty_layers_add_in_head``; MTP
    layers continue after ``num_hidden_layers``. Only ``sliding_window`` and
    ``window_attn_skip_freq`` decide (``transformer/utils.py``
    ``is_layer_window_attention``): none -> every layer, an int ``N`` ->
    ``i % N != 0``, a list -> ``bool(list[i])``. ``layer_types``,
    ``use_sliding_window`` and ``sliding_window_pattern`` are not read. MLA
    layers build their core attention without ``is_swa``: never sliding.
    """
    if not window_set or mla:
        return [False] * total
    field, skip = f.named("window_attn_skip_freq")
    if skip is None:
        return [True] * total
    if isinstance(skip, list | tuple):
        if len(skip) < total:
            raise ValueError(
                f"{field} has {len(skip)} entries but the model has {total} layers "
                f"(num_hidden_layers plus MTP layers): {list(skip)!r}"
            )
        if any(isinstance(v, str) or not isinstance(v, int) for v in skip):
            raise ValueError(f"{field} entries must be 0/1 (or bools), got {list(skip)!r}")
        return [bool(v) for v in skip[:total]]
    freq = _int(skip, field)
    return [i % freq != 0 for i in range(total)]


def _sliding_flags(f: _Fields, n: int, window_set: bool) -> list[bool]:
    """Whether each layer is a sliding-window layer (before the window is known finite)."""
    layer_types = f.get("layer_types")
    if layer_types is not None:
        flags = [t == "sliding_attention" for t in check_layer_types(layer_types, n)]
        if any(flags) and not window_set:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return flags
    if not window_set:
        return [False] * n
    field, skip = f.named("window_attn_skip_freq")
    if skip is None:
        pattern = f.get("sliding_window_pattern")
        if pattern is None:
            return [True] * n
        p = _int(pattern, "sliding_window_pattern")
        return [(i + 1) % p != 0 for i in range(n)]
    if isinstance(skip, list | tuple):
        if len(skip) != n:
            raise ValueError(f"{field} has {len(skip)} entries but num_hidden_layers={n}: {list(skip)!r}")
        if any(v not in (0, 1) for v in skip):
            raise ValueError(f"{field} entries must be 0 or 1, got {list(skip)!r}")
        return [v == 1 for v in skip]
    freq = _int(skip, field)
    return [i % freq != 0 for i in range(n)]


def _ratios(f: _Fields, n: int) -> list[float]:
    raw = f.get("head_wise_swa_ratio", 0.0)
    values = list(raw) if isinstance(raw, list | tuple) else [raw] * n
    if len(values) != n:
        raise ValueError(
            f"head_wise_swa_ratio has {len(values)} entries but the model has {n} layers "
            f"(num_hidden_layers, plus MTP layers under PaddleFleet's rules): {raw!r}"
        )
    for r in values:
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 <= r <= 1.0:
            raise ValueError(f"head_wise_swa_ratio must be in [0, 1], got {raw!r}")
    return [float(r) for r in values]


def _mla(f: _Fields) -> tuple[MLADims, int] | None:
    """``(MLADims, v_head_dim)`` for an MLA model, else None."""
    kv_lora = f.get("kv_lora_rank")
    nope, rope = f.get("qk_nope_head_dim"), f.get("qk_rope_head_dim")
    flag = f.get("multi_latent_attention")
    # An explicit False wins over MLA dims a PaddleFleet config may default; a
    # PaddleFormers PretrainedConfig sets it False on every model (deepseek_v3
    # too, whose attention is always MLA), so there the dims decide.
    if flag is not None and not flag and f.origin != "pretrained":
        return None
    if not flag and (kv_lora is None or (nope is None and rope is None)):
        return None
    why = " for multi-latent attention"
    for name, value in (("kv_lora_rank", kv_lora), ("qk_nope_head_dim", nope), ("qk_rope_head_dim", rope)):
        if value is None:
            raise ValueError(f"missing required field {name!r}{why}")
    q_lora = f.get("q_lora_rank")
    dims = MLADims(
        kv_lora_rank=_int(kv_lora, "kv_lora_rank"),
        qk_nope_head_dim=_int(nope, "qk_nope_head_dim", 0),
        qk_rope_head_dim=_int(rope, "qk_rope_head_dim", 0),
        q_lora_rank=None if q_lora is None else _int(q_lora, "q_lora_rank"),
    )
    _int(dims.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim")
    return dims, _required(f, "v_head_dim", why)[1]


def _yarn_mscale_sq(f: _Fields, paddlefleet: bool = False) -> float:
    """DeepSeek-V3's yarn correction of the softmax scale: ``mscale(factor, mscale_all_dim) ** 2``
    with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` (1 when factor <= 1).

    PaddleFleet's MLA (``transformer/multi_latent_attention.py``) reads its own
    ``rotary_scaling_factor`` and ``mscale_all_dim`` fields when they are set.
    """
    factor, mscale_all_dim = f.get("rotary_scaling_factor"), f.get("mscale_all_dim")
    if paddlefleet and factor is not None and mscale_all_dim is not None:
        names = "rotary_scaling_factor and mscale_all_dim"
    else:
        rope_field = "rope_scaling" if f.get("rope_scaling") else "rope_parameters"
        rope = f.get(rope_field)
        if not isinstance(rope, Mapping) or (rope.get("type") or rope.get("rope_type")) != "yarn":
            return 1.0
        mscale_all_dim, factor = rope.get("mscale_all_dim"), rope.get("factor", 1.0)
        if not mscale_all_dim:
            return 1.0
        names = f"{rope_field}.factor and {rope_field}.mscale_all_dim"
    # the fields themselves are finite and in range (fields.check_numeric_fields); their product may not be
    if factor <= 1.0:
        return 1.0
    try:
        mscale_sq = (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    except OverflowError:
        mscale_sq = math.inf
    if not 0 < mscale_sq < math.inf:
        raise ValueError(
            f"{names} ({factor!r}, {mscale_all_dim!r}) give a yarn softmax correction of "
            f"{mscale_sq!r}: not a finite positive number"
        )
    return mscale_sq


def _shard(
    index: int, hq: int, hkv: int, names: tuple[str, str], tp: int, rank: int
) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """Per-rank ``(q heads, kv heads, q_head_range, kv_head_range)`` of one layer."""
    q_name, kv_name = names
    if hq % hkv:
        raise ValueError(f"layer {index}: {q_name}={hq} is not divisible by {kv_name}={hkv}")
    if hq % tp:
        raise ValueError(f"layer {index}: {q_name}={hq} is not divisible by tp_size={tp}")
    hq_l = hq // tp
    if hkv >= tp:
        if hkv % tp:
            raise ValueError(f"layer {index}: {kv_name}={hkv} is not divisible by tp_size={tp}")
        kv_l = hkv // tp
        kv_range = (rank * kv_l, (rank + 1) * kv_l)
    else:  # fewer kv heads than ranks: each rank holds one replicated kv head
        if tp % hkv:
            raise ValueError(f"layer {index}: tp_size={tp} is not a multiple of {kv_name}={hkv}")
        kv_l = 1
        kv_index = rank * hkv // tp
        kv_range = (kv_index, kv_index + 1)
    return hq_l, kv_l, (rank * hq_l, (rank + 1) * hq_l), kv_range


def plan_from_config(
    config: Any, tp_size: int = 1, tp_rank: int = 0, convention: str | None = None
) -> AttentionPlan:
    """The attention plan of ``config`` on TP rank ``tp_rank`` of ``tp_size``.

    ``config``: a dict, a ``config.json`` path / model directory / preset name
    (``str`` or ``Path``), or an attribute object. ``convention`` (``hf`` or
    ``paddlefleet``) forces whose rules read the config (which layers slide,
    MTP layers, MLA, defaults); by default PaddleFleet's for a ``TransformerConfig``-like
    attribute object, a ``(left, right)`` window or ``model_type == "minifleet"``,
    HF's otherwise (docs/plan.md). Both read an int window ``W`` as W keys
    including the query (``window_left = W - 1``).
    """
    tp = _int(tp_size, "tp_size")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be an integer in [0, {tp}), got {tp_rank!r}")
    if isinstance(config, str | Path):
        source, config = str(config), load_config(config)
    else:
        source = "<dict>" if isinstance(config, Mapping) else f"<{type(config).__name__}>"
    check_caps(config)  # counts bounded before any per-layer list is made
    config, wrapped = text_model(config)  # a multimodal wrapper plans its text model
    if wrapped:
        source = f"{source} ({wrapped})"
        check_caps(config)
    check_numeric_fields(config)
    f = _Fields(config)
    f.overrides = hf_overrides(config, f.origin, convention)  # the model type's own defaults and rules

    _, n = _required(f, "num_hidden_layers")
    heads_field, heads = _required(f, "num_attention_heads")
    mla = _mla(f)
    pf = _paddlefleet_rules(f, convention)
    total = n + (_mtp_layers(f) if pf else 0)
    kv_field, kv = f.named("num_key_value_heads")
    kv = heads if kv is None else _int(kv, kv_field)
    head_dim_field, head_dim = f.named("head_dim")
    if head_dim is None:
        if mla is None:
            hidden_field, hidden = _required(f, "hidden_size", " (head_dim is not set)")
            head_dim = hidden // heads
            if head_dim == 0:
                raise ValueError(
                    f"{hidden_field}={hidden} is smaller than {heads_field}={heads}: "
                    "head_dim would be 0 (set head_dim)"
                )
    else:
        head_dim = _int(head_dim, head_dim_field)
    v_dim = f.get("v_head_dim")
    v_dim = None if v_dim is None else _int(v_dim, "v_head_dim")

    softmax_type = f.get("softmax_type", "vanilla")
    if softmax_type not in SINK_KINDS:
        raise ValueError(f"softmax_type must be one of {', '.join(SINK_KINDS)}, got {softmax_type!r}")
    model_type = f.get("model_type")
    hf_sinks = not pf and (
        model_type == "gpt_oss" or bool(f.get("use_sinks")) or bool(f.get("attention_sinks"))
    )
    scale = f.get("softmax_scale")
    if scale is not None:
        scale = _positive(scale, "softmax_scale")
    elif f.get("query_pre_attn_scalar") is not None and not pf:
        scale = _positive(f.get("query_pre_attn_scalar"), "query_pre_attn_scalar") ** -0.5
    if pf and mla is not None:
        scale = None  # PaddleFleet's MLA sets its own scale, whatever softmax_scale says

    soft_cap = f.get("attn_logit_softcapping")
    soft_cap = None if soft_cap is None else _positive(soft_cap, "attn_logit_softcapping")
    window_left, window_set, conv = _window(f, pf, convention)
    if window_left is not None and window_left > MAX_INT:
        raise ValueError(f"sliding_window gives window_left={window_left}, more than {MAX_INT}")
    if pf:
        if f.get("layer_types") is not None:  # not read by PaddleFleet, but an unknown entry is a typo
            check_layer_types(f.get("layer_types"), None)
        flags = _paddlefleet_flags(f, total, window_set, mla is not None)
    else:
        flags = _sliding_flags(f, n, window_set)
    ratios = _ratios(f, total)
    per_layer_ratio = isinstance(f.get("head_wise_swa_ratio"), list | tuple)

    layers = []
    for i in range(total):
        # is_swa: the layer takes the sliding-layer heads, dims and sink; PaddleFleet makes a
        # layer is_swa even when its window truncates nothing (-1, or a (0, 0) tuple)
        sliding = flags[i] and (window_left is not None or pf)
        if sliding:
            hq_field, hq = f.named("swa_num_attention_heads")
            hq_field, hq = (heads_field, heads) if hq is None else (hq_field, _int(hq, hq_field))
            hkv_field, hkv = f.named("swa_num_key_value_heads")
            hkv_field, hkv = (kv_field, kv) if hkv is None else (hkv_field, _int(hkv, hkv_field))
            qk = f.get("swa_head_dim")
            qk = head_dim if qk is None else _int(qk, "swa_head_dim")
            vd = f.get("swa_v_head_dim")
            # PaddleFleet's TransformerConfig: swa_v_head_dim defaults to v_head_dim (itself head_dim)
            vd = (v_dim if v_dim is not None else head_dim) if vd is None else _int(vd, "swa_v_head_dim")
        else:
            hq_field, hq, hkv_field, hkv = heads_field, heads, kv_field, kv
            qk, vd = head_dim, (head_dim if v_dim is None else v_dim)
        if mla is not None:  # core attention sees one kv head per query head
            qk, vd, hkv, hkv_field = mla[0].qk_head_dim, mla[1], hq, hq_field

        if sliding and not pf and ratios[i] not in (0.0, 1.0) and int(ratios[i] * hkv) == 0:
            # no HF rule defines a ratio that slides no head; PaddleFleet slides every head then
            raise ValueError(
                f"layer {i}: head_wise_swa_ratio={ratios[i]!r} gives no sliding head of {hkv_field}={hkv}"
            )
        if not sliding and per_layer_ratio and not flags[i] and ratios[i] not in (0.0, 1.0):
            raise ValueError(f"layer {i} is not a sliding layer but head_wise_swa_ratio[{i}]={ratios[i]!r}")

        flag = f.get("add_swa_attention_sink_bias" if sliding else "add_full_attention_sink_bias")
        sink = "learnable" if flag or hf_sinks else softmax_type
        if scale is not None:
            layer_scale = scale
        else:
            layer_scale = qk**-0.5 * (_yarn_mscale_sq(f, pf) if mla is not None else 1.0)

        hq_l, kv_l, q_range, kv_range = _shard(i, hq, hkv, (hq_field, hkv_field), tp, tp_rank)
        # PaddleFleet splits head-wise heads per rank (transformer/utils.py
        # startend_row_indices_add_sliding_window masks with the rank's own kv head count):
        # n = int(r * kv_l); 0 < n < kv_l -> the LAST n local kv heads slide, else ALL do (r = 0 too).
        local = None
        if sliding and window_left is not None:
            n_slide = int(ratios[i] * kv_l)
            if not pf and n_slide == 0 and ratios[i] not in (0.0, 1.0):
                raise ValueError(
                    f"layer {i}: head_wise_swa_ratio={ratios[i]!r} gives no sliding head of the "
                    f"{kv_l} kv head(s) per rank at tp_size={tp}"
                )
            if not 0 < n_slide < kv_l:
                n_slide = kv_l
            local = (kv_l - n_slide, kv_l)
        if local is None:
            kind = "full"
        else:
            kind = "sliding" if local == (0, kv_l) else "headwise"
        layers.append(
            LayerAttention(
                index=i,
                kind=kind,
                num_q_heads=hq_l,
                num_kv_heads=kv_l,
                qk_head_dim=qk,
                v_head_dim=vd,
                softmax_scale=layer_scale,
                window_left=None if local is None else window_left,
                sliding_kv_heads=local,
                sink=sink,
                mla=None if mla is None else mla[0],
                q_head_range=q_range,
                kv_head_range=kv_range,
                logits_soft_cap=soft_cap,
            )
        )

    any_sliding = window_left is not None and any(flags)
    extras = {"model_type": model_type} if model_type else {}
    if wrapped:
        extras["text_config_of"] = wrapped
    extras["rules"] = "paddlefleet" if pf else "hf"
    return AttentionPlan(
        layers=tuple(layers),
        convention=conv if any_sliding else "none",
        tp_size=tp,
        tp_rank=tp_rank,
        source=source,
        extras=extras,
    )
