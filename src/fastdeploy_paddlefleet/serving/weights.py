"""Checkpoint tensors -> the host model's parameters (FastDeploy's ``set_state_dict`` / ``load_weights``).

Names are the host model's own (``decoder.layers.1.self_attn.core_attention.softmax_offset``),
optionally prefixed ``model.``. A full-size tensor of a tensor-parallel weight is cut to this
rank's part (``model.fdfleet_tp_shards``); experts that other expert-parallel ranks own are
skipped (``model.fdfleet_foreign_prefixes``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import paddle

logger = logging.getLogger(__name__)


def assign_weights(model: paddle.nn.Layer, state_dict: Mapping[str, Any]) -> list[str]:
    """Load ``{name: array or tensor}`` into ``model``; return the model's names not given.

    Unknown names or wrong shapes raise ``ValueError``.
    """
    own = model.state_dict()
    shards = getattr(model, "fdfleet_tp_shards", None) or {}
    unexpected: list[str] = []
    loaded: set[str] = set()
    foreign = getattr(model, "fdfleet_foreign_prefixes", None) or ()
    for name, value in state_dict.items():
        key = name[len("model.") :] if name not in own and name.startswith("model.") else name
        if key not in own and foreign and key.startswith(foreign):
            continue  # an expert another expert-parallel rank owns
        if key not in own:
            unexpected.append(name)
            continue
        target = own[key]
        tensor = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
        if key in shards and list(tensor.shape) != list(target.shape):  # full-size weight, TP rank's part
            from .parallel import cut

            tensor = cut(tensor, *shards[key])
        if list(tensor.shape) != list(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {list(tensor.shape)}, the model expects {list(target.shape)}"
            )
        target.set_value(tensor.astype(target.dtype))
        loaded.add(key)
    if unexpected:
        raise ValueError(
            f"{len(unexpected)} weight names are not in the model, e.g. {sorted(unexpected)[:5]}"
        )
    missing = sorted(set(own) - loaded)
    if missing:
        logger.warning("set_state_dict: %d model weights not given, e.g. %s", len(missing), missing[:5])
    return missing
