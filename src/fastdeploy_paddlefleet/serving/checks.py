"""Load-time checks of FastDeploy's ``fd_config`` for ``PaddleFleetForCausalLM``.

Each refusal is a ``ValueError`` naming the FastDeploy setting (and the loader
where it is one), raised when FastDeploy builds the model class, before any
weight is read. What is refused and why (``docs/fastdeploy.md``):

* The loaders that work: v1 (``default_v1``, FastDeploy's default), v0
  (``default``, also FastDeploy's worker fallback from v1: ``serving.pretrained``
  answers its ``get_pretrain_cls``) and ``dummy``.
* **RL loader** (``load_config.dynamic_load_weight``): FastDeploy looks up
  ``<architecture>RL`` and builds it under ``paddle.LazyGuard`` for weights pushed
  later by the trainer, through name mappings this plugin does not provide.
* **Weight quantization** (``--quantization``, or ``quantization_config`` in the
  checkpoint's ``config.json``): FastDeploy applies it through its own linear
  layers' ``quant_method``; a PaddleFleet model's linears are PaddleFleet's, so
  the setting would be silently ignored. Refused, naming the setting; for a gpt-oss
  MXFP4 or DeepSeek-V3 FP8 checkpoint the message names the converter
  (``fdfleet convert dequantize SRC DST``, ``docs/convert.md``).
* **KV cache quantization only** is accepted: a quantization config whose only setting is
  ``kv_cache_quant_type`` (``--quantization '{"quantization": "mix_quant", "kv_cache_quant_type":
  "block_wise_fp8"}'``, or the same ``quantization_config`` in ``config.json``; FastDeploy builds a
  ``MixQuantConfig`` with no dense / MoE type). The plugin's attention writes and reads the
  quantized cache itself (:func:`kv_cache_quant_of`); the format is parsed by
  ``kvcache.quant.kv_cache_quant``, which refuses the zero-point and 240-bound formats by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..kvcache.quant import KVCacheQuant, kv_cache_quant
from ._fields import field as _get

#: keys of a quantization config that quantizes only the KV cache (any other set key quantizes weights)
KV_ONLY_KEYS = frozenset(
    {
        "quantization",
        "kv_cache_quant_type",
        "is_channel_wise",
        "has_zero_point",
        "is_quantized",
        "is_moe_quantized",
    }
)
#: FastDeploy's quant config fields that name a weight quantization (``MixQuantConfig``)
WEIGHT_QUANT_FIELDS = ("dense_quant_type", "moe_quant_type", "image_moe_quant_type")
#: FastDeploy's quant config names that may carry only a KV cache type
KV_ONLY_METHODS = ("mix_quant", "kvcache")


def _value(x: Any) -> Any:
    """An enum's ``.value``, else ``x``."""
    return getattr(x, "value", x)


def check_loader(fd_config: Any, architecture: str) -> None:
    """Refuse the RL loader with a message naming it."""
    load = _get(fd_config, "load_config")
    if load is None:
        return
    if bool(_get(load, "dynamic_load_weight")):
        raise ValueError(
            f"{architecture}: FastDeploy's RL loader (load_config.dynamic_load_weight=True, "
            f"--dynamic-load-weight, which builds '{architecture}RL') is not supported by the "
            "paddlefleet plugin: it has no trainer-to-inference weight name mapping; "
            "serve with --load-choices default_v1 and without --dynamic-load-weight"
        )


def _weight_settings(section: Mapping[str, Any]) -> list[str]:
    """The set keys of a quantization dict that are not a KV-cache-only setting (``[]``: KV only)."""
    out = [
        f"{k}={v!r}"
        for k, v in section.items()
        if k not in KV_ONLY_KEYS and v not in (None, False, "", [], {})
    ]
    method = section.get("quantization")
    if method not in (None, *KV_ONLY_METHODS):
        out.insert(0, f"quantization={method!r}")
    if not section.get("kv_cache_quant_type"):
        out.insert(0, "no kv_cache_quant_type")
    return out


def _kv_format(section: Any, where: str) -> KVCacheQuant | None:
    """``kvcache.quant.kv_cache_quant`` of a config's ``kv_cache_quant_type`` (a dict or FastDeploy's
    quant config), the error naming ``where``; ``has_zero_point=True`` (a zero-point cache whatever
    the type) refused by name."""
    value = _get(section, "kv_cache_quant_type")
    value = getattr(value, "value", value)  # FastDeploy's enum
    channel_wise, has_zero_point = _get(section, "is_channel_wise"), _get(section, "has_zero_point")
    try:
        fmt = kv_cache_quant(value, None if channel_wise is None else bool(channel_wise))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    if fmt is not None and has_zero_point:
        raise ValueError(
            f"{where}: has_zero_point={has_zero_point!r} makes kv_cache_quant_type={value!r} a zero-point "
            "cache, which the paddlefleet plugin does not serve; remove has_zero_point"
        )
    return fmt


#: the ``quant_method`` values ``fdfleet convert dequantize`` reads (``convert.dequantize.METHODS``)
CONVERTIBLE = ("mxfp4", "fp8")


def convert_hint(method: Any) -> str:
    """What to do with a checkpoint quantized by ``method``: the converter command where it reads
    that format (gpt-oss MXFP4, DeepSeek-V3 block FP8), else an unquantized checkpoint."""
    if method in CONVERTIBLE:
        return (
            "write a bf16 copy and serve that: fdfleet convert dequantize SRC DST "
            "(python -m fastdeploy_paddlefleet.convert dequantize SRC DST; docs/convert.md)"
        )
    return (
        "serve an unquantized (bf16/fp16/fp32) checkpoint (fdfleet convert dequantize reads "
        f"{' and '.join(CONVERTIBLE)} checkpoints only)"
    )


def kv_cache_quant_of(fd_config: Any, architecture: str = "PaddleFleetForCausalLM") -> KVCacheQuant | None:
    """The KV cache format FastDeploy will allocate for ``fd_config`` (``None``: unquantized), after
    refusing, naming the setting, any weight quantization (``--quantization``, the checkpoint's
    ``quantization_config``, ``fd_config.quant_config``) and any KV format the plugin does not serve.

    Accepted: a quantization config whose only setting is ``kv_cache_quant_type`` (FastDeploy's
    ``mix_quant`` with no dense / MoE type, e.g. ``--quantization '{"quantization": "mix_quant",
    "kv_cache_quant_type": "block_wise_fp8"}'``)."""
    mc = _get(fd_config, "model_config")
    found: list[tuple[str, KVCacheQuant | None]] = []
    cli = _get(mc, "quantization")
    if cli:
        section = cli if isinstance(cli, Mapping) else {"quantization": cli}
        bad = _weight_settings(section)
        if bad:
            raise ValueError(
                f"{architecture}: --quantization {cli!r} (model_config.quantization: {', '.join(bad)}) "
                "quantizes weights, which the paddlefleet plugin does not apply (PaddleFleet's linear "
                "layers have no FastDeploy quant_method); serve unquantized weights, quantizing at most "
                'the KV cache: --quantization \'{"quantization": "mix_quant", "kv_cache_quant_type": '
                '"block_wise_fp8"}\''
            )
        where = f"{architecture}: --quantization kv_cache_quant_type"
        found.append((where, _kv_format(section, where)))
    ckpt = _get(mc, "quantization_config")
    if isinstance(ckpt, Mapping) and ckpt:
        bad = _weight_settings(ckpt)
        if bad:
            method = ckpt.get("quant_method") or ckpt.get("quantization") or "?"
            raise ValueError(
                f"{architecture}: the checkpoint's config.json has quantization_config (quant_method="
                f"{method!r}; {', '.join(bad)}), which the paddlefleet plugin does not apply (PaddleFleet's "
                f"linear layers have no FastDeploy quant_method); {convert_hint(method)} (a "
                "quantization_config with only kv_cache_quant_type is served)"
            )
        where = f"{architecture}: the checkpoint's quantization_config kv_cache_quant_type"
        found.append((where, _kv_format(ckpt, where)))
    quant = _get(fd_config, "quant_config")
    if quant is not None:
        name = quant.name() if callable(getattr(quant, "name", None)) else type(quant).__name__
        weights = [f"{f}={_get(quant, f)!r}" for f in WEIGHT_QUANT_FIELDS if _get(quant, f) is not None]
        kv_type = _get(quant, "kv_cache_quant_type")
        if name not in KV_ONLY_METHODS or weights or kv_type is None:
            what = ", ".join(weights) if weights else ("no kv_cache_quant_type" if kv_type is None else name)
            raise ValueError(
                f"{architecture}: fd_config.quant_config ({name}: {what}) quantizes weights, and the "
                "paddlefleet plugin does not apply weight quantization; serve without --quantization / "
                "quantization_config, or with one that sets only kv_cache_quant_type"
            )
        where = f"{architecture}: fd_config.quant_config.kv_cache_quant_type"
        found.append((where, _kv_format(quant, where)))
    # FastDeploy gives the checkpoint's config priority; every source that is set must name one format
    fmts = {f.name if f else None: (w, f) for w, f in found}
    if len(fmts) > 1:
        listed = "; ".join(f"{w} -> {n}" for n, (w, _) in fmts.items())
        raise ValueError(f"{architecture}: the KV cache quantization settings disagree ({listed})")
    return found[-1][1] if found else None


def check_quantization(fd_config: Any, architecture: str) -> None:
    """Refuse weight quantization from ``--quantization`` or the checkpoint's ``quantization_config``
    (a config with only ``kv_cache_quant_type`` is accepted: :func:`kv_cache_quant_of`)."""
    kv_cache_quant_of(fd_config, architecture)


#: the parameter dtypes the plugin serves (``model_config.dtype``)
MODEL_DTYPES = ("float32", "float16", "bfloat16")

#: integer settings the plugin reads, ``(section, field, minimum)``: a cast would truncate 4.7 to 4
#: and read ``True`` as 1, so a float or a bool is refused by name (``None``: unset, FastDeploy's default)
INT_SETTINGS = (
    ("cache_config", "block_size", 1),
    ("parallel_config", "tensor_parallel_size", 1),
    ("parallel_config", "tensor_parallel_rank", 0),
    ("parallel_config", "expert_parallel_size", 1),
    ("model_config", "seed", 0),
    ("speculative_config", "num_speculative_tokens", 0),
)


def check_model_dtype(fd_config: Any, architecture: str) -> None:
    """``model_config.dtype`` is a float dtype the plugin serves (``float32``, ``float16``,
    ``bfloat16``; unset: the builder's default): an ``int8`` model would embed and multiply in
    integers. Weight quantization is a separate setting (refused above)."""
    dtype = _get(_get(fd_config, "model_config"), "dtype")
    if dtype is None:
        return
    if isinstance(dtype, str):  # FastDeploy's form: "bfloat16"
        name = dtype
    elif type(dtype).__module__.split(".")[0] in ("paddle", "torch", "numpy"):  # str(): "paddle.float16"
        name = str(dtype).rsplit(".", 1)[-1]
    else:
        name = None
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"{architecture}: model_config.dtype={dtype!r} (--dtype) is not a dtype the paddlefleet plugin "
            f"serves; expected one of {', '.join(MODEL_DTYPES)}"
        )


def check_int_settings(fd_config: Any, architecture: str) -> None:
    """Each of :data:`INT_SETTINGS` that is set is an int (not a bool, not ``4.7``) >= its minimum."""
    from ..backends.base import host_int

    for section, name, low in INT_SETTINGS:
        value = _get(_get(fd_config, section), name)
        if value is not None:
            try:
                host_int(f"{architecture}: {section}.{name}", value, low)
            except TypeError as e:
                raise TypeError(f"{e} (an integer setting)") from None


def check_fd_config(fd_config: Any, architecture: str) -> None:
    """Every load-time refusal above (raises ``ValueError`` / ``TypeError`` naming the setting)."""
    check_loader(fd_config, architecture)
    check_quantization(fd_config, architecture)
    check_model_dtype(fd_config, architecture)
    check_int_settings(fd_config, architecture)
