"""Swap every PaddleFleet core attention of a model for a :class:`PagedCoreAttention`.

``patch_core_attention`` walks ``named_sublayers()``; every sublayer with a
``self_attn`` is a transformer layer (decoder and MTP layers alike) and takes
the next layer index of its own count: decoder layers ``0..N-1``, then MTP
layers ``N..``, the plan's order (``layer_number`` is 0-based in PaddleFleet's
current layer specs, counts the empty head layers, restarts at 0 for MTP
layers, and has been 1-based in older versions, so it is not used). A layer whose ``self_attn`` has
no ``core_attention`` (gated-delta-net / KDA linear attention) is skipped with
a reason. Everything is checked before anything is replaced: a mismatch
between the plan and a module, or a layer the backend cannot run, raises
``ValueError`` and leaves the model untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import paddle

from ..adapter.context import StepContextHolder
from ..adapter.core_attention import PagedCoreAttention, backend_layer
from ..backends.base import AttentionBackend
from ..plan.layer import AttentionPlan, LayerAttention
from .report import PatchedLayer, PatchReport, SkippedLayer

logger = logging.getLogger(__name__)

_HOLDER_ATTR = "_fdfleet_step_holder"


def _sink_kind_of(core: paddle.nn.Layer) -> str:
    """The sink kind a PaddleFleet core attention was built with, from its ``softmax_offset``."""
    if getattr(core, "_parameters", {}).get("softmax_offset") is not None:
        return "learnable"
    return "vanilla" if getattr(core, "softmax_offset", None) is None else "off-by-one"


def _check_matches(core: paddle.nn.Layer, layer: LayerAttention, name: str) -> None:
    """``ValueError`` when the plan entry disagrees with the module's own attributes.

    An MLA layer's kv head count is not compared: PaddleFleet's MLA builds its
    core attention without ``num_key_value_heads``, so the module reports the
    config's kv heads while K/V carry one head per query head (the plan's
    count); the adapter checks ``key.shape[-2]`` against the plan at run time.
    """
    pairs: tuple[tuple[str, str], ...] = (
        ("num_attention_heads_per_partition", "num_q_heads"),
        ("num_query_groups_per_partition", "num_kv_heads"),
        ("k_channels", "qk_head_dim"),
        ("v_channels", "v_head_dim"),
    )
    if layer.mla is not None:
        pairs = tuple(p for p in pairs if p[0] != "num_query_groups_per_partition")
    for attr, field in pairs:
        have = getattr(core, attr, None)
        want = getattr(layer, field)
        if have is not None and int(have) != want:
            raise ValueError(f"{name}: module {attr}={have} but plan layer {layer.index} has {field}={want}")
    sink = _sink_kind_of(core)
    if sink != layer.sink:
        raise ValueError(
            f"{name}: module softmax_offset makes a {sink!r} sink but plan layer {layer.index} "
            f"has sink={layer.sink!r}"
        )
    if sink == "learnable":
        shape = list(core.softmax_offset.shape)
        if shape != [layer.num_q_heads]:
            raise ValueError(f"{name}: softmax_offset shape {shape} != [num_q_heads={layer.num_q_heads}]")
    scale = getattr(core, "softmax_scale", None)
    if scale is not None and not math.isclose(float(scale), layer.softmax_scale, rel_tol=1e-6):
        raise ValueError(
            f"{name}: module softmax_scale={scale} but plan layer {layer.index} has "
            f"softmax_scale={layer.softmax_scale}"
        )


def _transformer_layers(model: paddle.nn.Layer) -> list[tuple[str, paddle.nn.Layer]]:
    """``(path, self_attn)`` of every transformer layer, in ``named_sublayers()`` order."""
    found = []
    for name, sub in model.named_sublayers():
        attn = getattr(sub, "self_attn", None)
        if isinstance(attn, paddle.nn.Layer):
            found.append((f"{name}.self_attn", attn))
    return found


def patch_core_attention(
    model: paddle.nn.Layer,
    plan: AttentionPlan,
    backend: AttentionBackend | str,
    holder: StepContextHolder | None = None,
) -> PatchReport:
    """Replace each ``self_attn.core_attention`` of ``model`` with a paged adapter.

    ``plan`` gives each layer's ``LayerAttention`` (looked up by ``index``);
    ``backend`` is an instance or a name for ``get_backend``; ``holder`` is the
    step-context holder the adapters read (a new one when ``None``), attached
    to the model (see :func:`step_holder`).
    """
    if isinstance(backend, str):
        from ..backends import get_backend

        backend = get_backend(backend)
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"backend must be an AttentionBackend or a name, got {type(backend).__name__}")
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    holder = holder if holder is not None else getattr(model, _HOLDER_ATTR, None) or StepContextHolder()
    by_index = {layer.index: layer for layer in plan}
    report = PatchReport(backend=backend.name)
    todo: list[tuple[paddle.nn.Layer, paddle.nn.Layer, LayerAttention, str]] = []
    for index, (attn_name, attn) in enumerate(_transformer_layers(model)):
        core = getattr(attn, "core_attention", None)
        if core is None:
            reason = f"{type(attn).__name__} has no core_attention (e.g. linear attention); left as is"
            report.skipped.append(SkippedLayer(name=attn_name, reason=reason))
            continue
        name = f"{attn_name}.core_attention"
        if isinstance(core, PagedCoreAttention):
            raise ValueError(f"{name} is already patched; call unpatch_core_attention(model) first")
        layer = by_index.get(index)
        if layer is None:
            raise ValueError(
                f"{name}: plan has no layer with index {index} (plan indices {sorted(by_index)})"
            )
        _check_matches(core, layer, name)
        backend.check_layer(backend_layer(layer, backend))  # raises for combos the backend cannot run
        todo.append((attn, core, layer, name))
    for attn, core, layer, name in todo:
        attn.core_attention = PagedCoreAttention(core, layer, backend, holder)
        report.patched.append(
            PatchedLayer(name=name, layer_index=layer.index, kind=layer.kind, sink=layer.sink)
        )
    object.__setattr__(model, _HOLDER_ATTR, holder)
    logger.info(
        "patched %d core attention(s) with backend %r, skipped %d",
        report.num_patched,
        backend.name,
        len(report.skipped),
    )
    return report


def unpatch_core_attention(model: paddle.nn.Layer) -> int:
    """Put the original core attentions back; returns how many were restored."""
    restored = 0
    for _, attn in _transformer_layers(model):
        core = getattr(attn, "core_attention", None)
        if isinstance(core, PagedCoreAttention):
            attn.core_attention = core.original()
            restored += 1
    return restored


def step_holder(model: paddle.nn.Layer) -> StepContextHolder:
    """The :class:`StepContextHolder` a patched model's adapters read."""
    holder = getattr(model, _HOLDER_ATTR, None)
    if holder is None:
        raise ValueError(
            f"model {type(model).__name__} has no step holder: patch it with patch_core_attention"
        )
    return holder


def cache_plan(plan: AttentionPlan, backend: AttentionBackend) -> AttentionPlan:
    """``plan`` as ``backend`` sees it (MLA values padded where needed): allocate KV caches from this."""
    layers: Any = tuple(backend_layer(layer, backend) for layer in plan)
    return dataclasses.replace(plan, layers=layers)
