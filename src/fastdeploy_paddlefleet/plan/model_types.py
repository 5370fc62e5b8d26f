"""Per-model-type rules for HF-style configs (stdlib only).

A published ``config.json`` states only what differs from its config class's
defaults, and which layers slide is decided by each model type's reference
code (HF transformers' ``configuration_<type>.py`` / ``modeling_<type>.py``),
not by one generic rule. :func:`hf_overrides` reproduces, per ``model_type``,
what that reference code resolves, so a dict, a ``config.json``, a model
directory and a ``PretrainedConfig`` object of the same model plan alike.

What the plan cannot express (chunked local attention, block-sparse
attention, cross-layer KV sharing, bidirectional attention) is refused by
name; a ``model_type`` with window-ish fields but no known rule is refused
too (an explicit error beats a guess). Sources, file and function, are
cited per rule below (transformers ``main``, 2026).

:func:`text_model` unwraps multimodal ``...ForConditionalGeneration``
configs to their ``text_config``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()

#: fields that only PaddleFleet / this plugin's own configs carry: such a config keeps the generic reading
PADDLEFLEET_FIELDS: tuple[str, ...] = (
    "window_attn_skip_freq",
    "hybrid_layer_pattern",
    "head_wise_swa_ratio",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "swa_head_dim",
    "swa_v_head_dim",
    "add_swa_attention_sink_bias",
    "add_full_attention_sink_bias",
    "softmax_type",
    "num_layers",
    "num_query_groups",
    "kv_channels",
)

#: fields that say something about which keys a layer sees (an unknown model type with one is refused)
WINDOW_FIELDS: tuple[str, ...] = (
    "sliding_window",
    "window_size",
    "sliding_window_size",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "use_sliding_window",
    "layer_types",
)

#: aliases the generic reader accepts that HF's reference code never reads: blanked for HF model types
_NOT_HF: tuple[str, ...] = (
    "num_layers",
    "num_query_groups",
    "kv_channels",
    "window_size",
    "sliding_window_size",
    "window_attn_skip_freq",
    "hybrid_layer_pattern",
    "sliding_window_pattern",
    "use_sliding_window",
)

#: attention the plan cannot express: field -> what it is (checked on every HF-style config)
UNSUPPORTED_FIELDS: dict[str, str] = {
    "attention_chunk_size": "chunked local attention (Llama-4 iRoPE: keys only within the query's chunk)",
    "blocksparse_block_size": "block-sparse attention (Phi-3-small)",
    "blocksparse_num_local_blocks": "block-sparse attention (Phi-3-small)",
    "blocksparse_vert_stride": "block-sparse attention (Phi-3-small)",
    "dense_attention_every_n_layers": "block-sparse attention on the other layers (Phi-3-small)",
    "num_kv_shared_layers": "cross-layer KV sharing (later layers read an earlier layer's cache)",
}

#: layer_types entries the plan maps: sliding, full, and layers without a core attention (skipped at patch)
_LAYER_TYPES_OK = ("full_attention", "sliding_attention", "linear_attention")

#: multimodal wrapper model_type -> the text model_type HF builds from a ``text_config`` without one
TEXT_MODEL_TYPES: dict[str, str] = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "mistral3": "mistral",
}


class _Reader:
    """Raw access to a mapping or attribute object: ``_MISSING`` when the key/attribute is absent."""

    def __init__(self, config: Any, origin: str):
        self.config, self.origin = config, origin
        self.extra: dict[str, Any] = {}  # read before the config (defaults filled in)

    def raw(self, name: str) -> Any:
        if name in self.extra:
            return self.extra[name]
        if isinstance(self.config, Mapping):
            return self.config.get(name, _MISSING)
        return getattr(self.config, name, _MISSING)

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw(name)
        return default if value is _MISSING else value

    def present(self, name: str) -> bool:
        """Set to something other than None."""
        return self.get(name) is not None


@dataclass(frozen=True)
class Rule:
    """One model type: its config class's attention defaults and which layers slide.

    ``defaults`` are the config class's own defaults, applied only to a dict
    (``config.json``) that lacks the key (a config object already has them; a
    key present as ``null`` stays ``None``, as HF keeps it). ``slides(r, n,
    window)`` lists which of ``n`` layers slide when the config gives no
    ``layer_types`` (``window`` is the resolved ``sliding_window``, None = none).
    ``resolve_window`` maps the read ``sliding_window`` to the one the
    reference code uses. ``extra`` adds model-specific overrides.
    """

    cite: str
    defaults: dict[str, Any] = field(default_factory=dict)
    slides: Callable[[_Reader, int, int | None], list[bool]] | None = None
    resolve_window: Callable[[_Reader, Any], Any] | None = None
    extra: Callable[[_Reader, dict[str, Any]], dict[str, Any]] | None = None
    last_layer_full: bool = False
    reads_window: bool = True


def _every(r: _Reader, n: int, window: int | None) -> list[bool]:
    return [window is not None] * n


def _pattern(default: int, key: str | None = "sliding_window_pattern"):
    """Layer ``i`` slides iff ``(i + 1) % P != 0``; ``P`` from ``key`` when the config has it."""

    def slides(r: _Reader, n: int, window: int | None) -> list[bool]:
        p = default
        if key is not None:
            p = r.get(key)
            if p is None and r.origin != "dict":  # a config object keeps the resolved pattern here
                p = r.get("_" + key)
            p = default if p is None else p
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {p!r}")
        return [window is not None and (i + 1) % p != 0 for i in range(n)]

    return slides


def _qwen_window(r: _Reader, window: Any) -> Any:
    # Qwen2Config: self.sliding_window = sliding_window if self.use_sliding_window else None
    return window if r.get("use_sliding_window") else None


def _qwen_slides(r: _Reader, n: int, window: int | None) -> list[bool]:
    # "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
    m = r.get("max_window_layers")
    if window is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
        raise ValueError(f"max_window_layers must be an integer >= 0, got {m!r}")
    return [window is not None and i >= m for i in range(n)]


def _gemma4_extra(r: _Reader, out: dict[str, Any]) -> dict[str, Any]:
    """Gemma4TextAttention.__init__: full layers use ``global_head_dim`` (and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``); sliding layers ``head_dim`` /
    ``num_key_value_heads``; ``self.scaling = 1.0`` on every layer."""
    head_dim, kv = r.get("head_dim"), r.get("num_key_value_heads")
    global_dim = r.get("global_head_dim")
    global_kv = r.get("num_global_key_value_heads") if r.get("attention_k_eq_v") else None
    return {
        "head_dim": global_dim or head_dim,
        "num_key_value_heads": global_kv or kv,
        "v_head_dim": None,
        "swa_head_dim": head_dim,
        "swa_v_head_dim": head_dim,
        "swa_num_key_value_heads": kv,
        "swa_num_attention_heads": None,
        "softmax_scale": 1.0,
    }


_GEMMA = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2304}
_QWEN = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

RULES: dict[str, Rule] = {
    "gemma2": Rule(
        "configuration_gemma2.py Gemma2Config (defaults; __post_init__: layer_types default "
        "'sliding_attention' iff (i + 1) % 2, i.e. even layers); modeling_gemma2.py "
        "eager_attention_forward (softcap: tanh(scores / softcap) * softcap on the scaled scores)",
        {
            **_GEMMA,
            "num_hidden_layers": 26,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
        },
        _pattern(2, None),
    ),  # fmt: skip
    "gemma3_text": Rule(
        "configuration_gemma3.py Gemma3TextConfig (defaults; __post_init__: _sliding_window_pattern = "
        "kwargs.get('sliding_window_pattern', 6); layer i slides iff (i + 1) % pattern)",
        {
            **_GEMMA,
            "num_hidden_layers": 26,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": None,
        },
        _pattern(6),
    ),  # fmt: skip
    "gemma4_text": Rule(
        "configuration_gemma4.py Gemma4TextConfig (defaults; __post_init__: pattern 6, last layer "
        "forced to full_attention); modeling_gemma4.py Gemma4TextAttention.__init__ (dims, scaling 1.0)",
        {
            **_GEMMA,
            "num_hidden_layers": 30,
            "sliding_window": 512,
            "global_head_dim": 512,
            "attention_k_eq_v": False,
            "num_kv_shared_layers": 0,
        },
        _pattern(6, None),
        extra=_gemma4_extra,
        last_layer_full=True,
    ),  # fmt: skip
    "cohere2": Rule(
        "configuration_cohere2.py Cohere2Config.__init__ (_sliding_window_pattern = "
        "kwargs.get('sliding_window_pattern', 4); layer i slides iff (i + 1) % pattern)",
        {"sliding_window": 4096},
        _pattern(4),
    ),
    "gpt_oss": Rule(
        "configuration_gpt_oss.py GptOssConfig.__init__ (sliding_window 128; layer_types default "
        "'sliding_attention' iff (i + 1) % 2); modeling_gpt_oss.py GptOssAttention (learnable sinks)",
        {"sliding_window": 128},
        _pattern(2, None),
    ),
    **{
        t: Rule(
            f"configuration_{t}.py {c}.__init__ (sliding_window = sliding_window if use_sliding_window "
            "else None; layer_types default 'sliding_attention' iff sliding_window is not None and "
            "i >= max_window_layers)",
            dict(_QWEN),
            _qwen_slides,
            resolve_window=_qwen_window,
        )
        for t, c in (
            ("qwen2", "Qwen2Config"),
            ("qwen2_moe", "Qwen2MoeConfig"),
            ("qwen3", "Qwen3Config"),
            ("qwen3_moe", "Qwen3MoeConfig"),
        )
    },
    **{
        t: Rule(
            f"configuration_{t}.py {c} (sliding_window default {w}); modeling_{t}.py: every layer "
            "uses config.sliding_window (create_sliding_window_causal_mask when it is set)",
            {"sliding_window": w},
            _every,
        )
        for t, c, w in (
            ("mistral", "MistralConfig", 4096),
            ("mixtral", "MixtralConfig", None),
            ("phi3", "Phi3Config", None),
            ("starcoder2", "Starcoder2Config", None),
        )
    },
    **{
        t: Rule(
            f"configuration_{t}.py {c}: no sliding window (any window field is not read)", reads_window=False
        )
        for t, c in (
            ("llama", "LlamaConfig"),
            ("deepseek_v2", "DeepseekV2Config"),
            ("deepseek_v3", "DeepseekV3Config"),
        )
    },
    "llama4_text": Rule(
        "configuration_llama4.py Llama4TextConfig (attention_chunk_size default 8192); "
        "modeling_llama4.py: RoPE layers use a chunked causal mask",
        {"attention_chunk_size": 8192},
    ),
}

#: model types refused outright: model_type -> (field named in the message, what it is)
REFUSED_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "phi3small": ("model_type", "block-sparse attention (Phi-3-small, remote code)"),
}


def _convention_says_paddlefleet(r: _Reader, convention: str | None) -> bool | None:
    for conv in (convention, r.get("window_convention")):
        if conv is not None:
            return conv != "hf"
    return None


def _refuse(field_name: str, value: Any, what: str, model_type: Any) -> ValueError:
    return ValueError(
        f"{field_name}={value!r} (model_type {model_type!r}): {what} is not supported by the plan "
        "(per-layer full, sliding-window or head-wise causal attention); refusing rather than "
        "planning it as something else"
    )


def _check_unsupported(r: _Reader, model_type: Any, defaults: Mapping[str, Any]) -> None:
    if model_type in REFUSED_MODEL_TYPES:
        name, what = REFUSED_MODEL_TYPES[model_type]
        raise _refuse(name, model_type, what, model_type)
    for name, what in UNSUPPORTED_FIELDS.items():
        value = r.raw(name)
        if value is _MISSING and r.origin == "dict":
            value = defaults.get(name, _MISSING)
        if value is _MISSING or value is None or value is False or value == 0:
            continue
        raise _refuse(name, value, what, model_type)
    bidir = r.get("use_bidirectional_attention")
    if bidir and bidir != "vision":  # "vision": image tokens only; text tokens stay causal
        raise _refuse(
            "use_bidirectional_attention", bidir, "bidirectional (non-causal) attention", model_type
        )
    if r.get("is_causal") is False:
        raise _refuse("is_causal", False, "non-causal attention", model_type)


def hf_overrides(config: Any, origin: str, convention: str | None = None) -> dict[str, Any]:
    """Field overrides that make the generic reader in ``plan.config`` plan ``config`` the
    way its model type's reference code runs. A value ``None`` means "treat as absent".

    ``origin``: ``dict`` (a mapping or ``config.json``), ``pretrained`` (a
    ``PretrainedConfig``) or ``object`` (any other attribute object: PaddleFleet's
    ``TransformerConfig``). Returns ``{}`` for configs read with the generic rules
    (no ``model_type``, or PaddleFleet / plugin fields present); for PaddleFleet
    configs, only blanks fields PaddleFleet never reads. Raises ``ValueError``
    naming the field for attention the plan cannot express and for a model type
    with window fields whose rule is unknown.
    """
    r = _Reader(config, origin)
    pf = _convention_says_paddlefleet(r, convention)
    if pf is None:
        window = r.get("sliding_window")
        pf = origin == "object" or isinstance(window, list | tuple) or r.get("model_type") == "minifleet"
    if pf:  # PaddleFleet's core attention has no soft-capping
        return {"attn_logit_softcapping": None}
    model_type = r.get("model_type")
    if model_type is None or any(r.present(name) for name in PADDLEFLEET_FIELDS):
        return {}
    rule = RULES.get(model_type)
    _check_unsupported(r, model_type, rule.defaults if rule else {})
    if rule is None:
        return _unknown(r, model_type)

    view = _Reader(config, origin)
    if origin == "dict":  # the config class's defaults for the keys this config.json leaves out
        view.extra = {k: v for k, v in rule.defaults.items() if r.raw(k) is _MISSING}
    out: dict[str, Any] = {name: None for name in _NOT_HF}
    out.update(view.extra)
    if not rule.reads_window:
        out.update(sliding_window=None, layer_types=None)
        return out
    window = view.get("sliding_window")
    if rule.resolve_window is not None:
        window = rule.resolve_window(view, window)
    n = view.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_hidden_layers must be an integer >= 1, got {n!r}")
    layer_types = view.get("layer_types")
    if layer_types is None:
        flags = rule.slides(view, n, window) if rule.slides is not None else [False] * n
        layer_types = ["sliding_attention" if s else "full_attention" for s in flags]
    else:
        layer_types = check_layer_types(layer_types, n)
        if window is None:  # a sliding layer without a window attends to every key
            layer_types = ["full_attention" if t == "sliding_attention" else t for t in layer_types]
    if rule.last_layer_full and layer_types:
        layer_types = [*layer_types[:-1], "full_attention"]
    out["sliding_window"] = window
    out["layer_types"] = layer_types
    if rule.extra is not None:
        out.update(rule.extra(view, out))
    return out


def check_layer_types(layer_types: Any, n: int | None) -> list[str]:
    """``layer_types`` as a list after checking its entries (each one of ``_LAYER_TYPES_OK``, an
    unknown one refused, never planned as full attention) and, unless ``n`` is None, its length."""
    if not isinstance(layer_types, list | tuple) or (n is not None and len(layer_types) != n):
        want = "a list" if n is None else f"{n} entries (num_hidden_layers)"
        shown = repr(layer_types) if len(repr(layer_types)) <= 200 else f"{repr(layer_types)[:200]}..."
        raise ValueError(f"layer_types must list {want}, got {shown}")
    bad = sorted({repr(t) for t in layer_types if not (isinstance(t, str) and t in _LAYER_TYPES_OK)})
    if bad:
        raise ValueError(
            f"layer_types has {', '.join(bad)[:300]}: not an attention the plan can express "
            f"(it knows {', '.join(_LAYER_TYPES_OK)})"
        )
    return list(layer_types)


def _unknown(r: _Reader, model_type: str) -> dict[str, Any]:
    """A model type without a rule: explicit ``layer_types`` (HF's shared masking reads exactly
    ``layer_types`` + ``sliding_window``) are planned; any other window field is refused."""
    layer_types = r.get("layer_types")
    if layer_types is not None:
        check_layer_types(layer_types, r.get("num_hidden_layers", len(layer_types)))
    guessed = [
        name
        for name in WINDOW_FIELDS
        if name != "layer_types"
        and r.present(name)
        and not (name == "use_sliding_window" and not r.get(name))
    ]
    if layer_types is None and guessed:
        known = ", ".join(sorted(RULES))
        raise ValueError(
            f"model_type {model_type!r}: no known rule for which layers slide, but the config sets "
            f"{', '.join(guessed)}; refusing to guess (known model types: {known}; or give layer_types)"
        )
    return {name: None for name in ("window_size", "sliding_window_size", "sliding_window_pattern")}


def text_model(config: Any) -> tuple[Any, str | None]:
    """``(text config, what it was taken from)`` of a multimodal wrapper, else ``(config, None)``.

    A config with a ``text_config`` and no ``num_hidden_layers`` of its own is a
    ``...ForConditionalGeneration`` wrapper: its text model is planned. A
    ``text_config`` dict without a ``model_type`` gets the one the wrapper's
    config class builds (``TEXT_MODEL_TYPES``).
    """
    r = _Reader(config, "dict" if isinstance(config, Mapping) else "object")
    text = r.get("text_config")
    if text is None or r.present("num_hidden_layers"):
        return config, None
    if not isinstance(text, Mapping) and not hasattr(text, "__dict__"):
        raise ValueError(f"text_config must be a mapping or a config object, got {type(text).__name__}")
    wrapper_type = r.get("model_type")
    archs = r.get("architectures")
    arch = archs[0] if isinstance(archs, list | tuple) and archs else None
    if isinstance(text, Mapping) and text.get("model_type") is None and wrapper_type in TEXT_MODEL_TYPES:
        text = {**text, "model_type": TEXT_MODEL_TYPES[wrapper_type]}
    return text, f"text_config of {arch or wrapper_type or 'a multimodal config'}"


__all__ = ["RULES", "UNSUPPORTED_FIELDS", "check_layer_types", "hf_overrides", "text_model"]
