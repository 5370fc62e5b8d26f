"""Checkpoint tensors -> the host model's parameters (FastDeploy's ``set_state_dict`` / ``load_weights``).

Names are the host model's own (``decoder.layers.1.self_attn.core_attention.softmax_offset``),
optionally prefixed ``model.``. A full-size tensor of a tensor-parallel weight is cut to this
rank's part (``model.fdfleet_tp_shards``); experts that other expert-parallel ranks own are
skipped (``model.fdfleet_foreign_prefixes``).

All or nothing: every tensor's name, shape (after the TP cut) and dtype (castable to the
parameter's) is checked before the first parameter is assigned, from the tensors' metadata only
(no copy), so a bad tensor anywhere in the checkpoint leaves every parameter as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import paddle

logger = logging.getLogger(__name__)

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_UNCHANGED = "no parameter was changed (every tensor is checked before the first assignment)"


def _meta(value: Any) -> tuple[list[int], str]:
    """``(shape, dtype name)`` of a paddle / numpy / torch tensor or a nested list, without a copy
    where the value already is an array."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        value = np.asarray(value)
    return [int(s) for s in value.shape], str(value.dtype).rsplit(".", 1)[-1]


def _castable(src: str, dst: str) -> bool:
    """Whether a checkpoint dtype may be cast to a parameter's: float to float, integer / bool to
    integer, bool to bool; never integers into floats (a bf16 weight exported as uint16 bits would be
    read as numbers)."""
    if dst in _FLOATS:
        return src in _FLOATS
    if dst in _INTS:
        return src in _INTS or src == "bool"
    return src == dst


def _cut_shape(shape: list[int], axis: int, segments: Sequence[tuple[int, int]]) -> list[int] | None:
    """The shape ``parallel.cut`` gives, or ``None`` when a segment lies outside ``shape[axis]``."""
    if not 0 <= axis < len(shape) or any(not 0 <= a <= b <= shape[axis] for a, b in segments):
        return None
    out = list(shape)
    out[axis] = sum(b - a for a, b in segments)
    return out


def _plan(
    own: Mapping[str, Any], shards: Mapping[str, Any], foreign: tuple[str, ...], state_dict: Mapping[str, Any]
) -> list[tuple[str, Any]]:
    """Check every tensor against the model's parameters ``own``: ``[(key, value) to assign]``; raise
    naming the first bad one (``ValueError`` name / shape, ``TypeError`` dtype) before any assignment."""
    todo: list[tuple[str, Any]] = []
    unexpected: list[str] = []
    for name, value in state_dict.items():
        key = name[len("model.") :] if name not in own and name.startswith("model.") else name
        if key not in own and foreign and key.startswith(foreign):
            continue  # an expert another expert-parallel rank owns
        if key not in own:
            unexpected.append(name)
            continue
        target = own[key]
        try:
            shape, dtype = _meta(value)
        except (TypeError, ValueError) as e:
            what = f"{type(value).__name__}: {e}"
            raise TypeError(f"weight {name!r} is not a tensor ({what}); {_UNCHANGED}") from e
        want = [int(s) for s in target.shape]
        if key in shards and shape != want:  # a full-size weight: this TP rank's part is cut from it
            cut = _cut_shape(shape, *shards[key])
            shape = cut if cut is not None else shape
        if shape != want:
            raise ValueError(f"weight {name!r} has shape {shape}, the model expects {want}; {_UNCHANGED}")
        target_dtype = str(target.dtype).rsplit(".", 1)[-1]
        if not _castable(dtype, target_dtype):
            hint = ""
            if dtype == "uint16" and target_dtype in _FLOATS:  # paddle's .numpy() of a bfloat16 tensor
                hint = " (a bfloat16 tensor's .numpy() gives its bits as uint16: pass the tensor itself)"
            raise TypeError(
                f"weight {name!r} has dtype {dtype}, which does not cast to the parameter's {target_dtype}"
                f"{hint}; {_UNCHANGED}"
            )
        todo.append((key, value))
    if unexpected:
        examples = sorted(unexpected)[:5]
        raise ValueError(
            f"{len(unexpected)} weight names are not in the model, e.g. {examples}; {_UNCHANGED}"
        )
    return todo


def assign_weights(model: paddle.nn.Layer, state_dict: Mapping[str, Any]) -> list[str]:
    """Load ``{name: array or tensor}`` into ``model``; return the model's names not given.

    Unknown names or wrong shapes raise ``ValueError``, dtypes that do not cast ``TypeError``; either
    leaves every parameter unchanged (all tensors are checked before the first assignment).
    """
    own = model.state_dict()
    shards = getattr(model, "fdfleet_tp_shards", None) or {}
    foreign = tuple(getattr(model, "fdfleet_foreign_prefixes", None) or ())
    todo = _plan(own, shards, foreign, state_dict)
    for key, value in todo:
        target = own[key]
        tensor = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
        if key in shards and list(tensor.shape) != list(target.shape):  # full-size weight, TP rank's part
            from .parallel import cut

            tensor = cut(tensor, *shards[key])
        target.set_value(tensor.astype(target.dtype))
    missing = sorted(set(own) - {key for key, _ in todo})
    if missing:
        logger.warning("set_state_dict: %d model weights not given, e.g. %s", len(missing), missing[:5])
    return missing
