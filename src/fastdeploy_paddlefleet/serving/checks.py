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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._fields import field as _get


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


def check_quantization(fd_config: Any, architecture: str) -> None:
    """Refuse weight quantization from ``--quantization`` or the checkpoint's ``quantization_config``."""
    mc = _get(fd_config, "model_config")
    cli = _get(mc, "quantization")
    if cli:
        raise ValueError(
            f"{architecture}: --quantization {cli!r} (model_config.quantization) is not applied by the "
            "paddlefleet plugin (PaddleFleet's linear layers have no FastDeploy quant_method); "
            "serve unquantized weights without --quantization"
        )
    ckpt = _get(mc, "quantization_config")
    if isinstance(ckpt, Mapping) and ckpt:
        method = ckpt.get("quant_method") or ckpt.get("quantization") or "?"
        raise ValueError(
            f"{architecture}: the checkpoint's config.json has quantization_config (quant_method="
            f"{method!r}), which the paddlefleet plugin does not apply (PaddleFleet's linear layers "
            f"have no FastDeploy quant_method); {convert_hint(method)}"
        )
    quant = _get(fd_config, "quant_config")
    if quant is not None:
        name = quant.name() if callable(getattr(quant, "name", None)) else type(quant).__name__
        raise ValueError(
            f"{architecture}: fd_config.quant_config ({name}) is set, and the paddlefleet plugin "
            "does not apply quantization; serve without --quantization / quantization_config"
        )


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
