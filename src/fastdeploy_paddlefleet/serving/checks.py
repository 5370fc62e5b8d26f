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
  the setting would be silently ignored. Refused, naming the setting.
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
            "have no FastDeploy quant_method); serve an unquantized (bf16/fp16/fp32) checkpoint"
        )
    quant = _get(fd_config, "quant_config")
    if quant is not None:
        name = quant.name() if callable(getattr(quant, "name", None)) else type(quant).__name__
        raise ValueError(
            f"{architecture}: fd_config.quant_config ({name}) is set, and the paddlefleet plugin "
            "does not apply quantization; serve without --quantization / quantization_config"
        )


def check_fd_config(fd_config: Any, architecture: str) -> None:
    """Every load-time refusal above (raises ``ValueError`` naming the setting)."""
    check_loader(fd_config, architecture)
    check_quantization(fd_config, architecture)
