"""FastDeploy's one cache shape for every layer, and each layer's part of it (stdlib only).

FastDeploy's GPU runner allocates every layer's key and value cache with one shape,
``[num_blocks, kv_heads, block_size, head_dim]`` where ``kv_heads = max(1,
model_config.num_key_value_heads // tp)`` and ``head_dim = model_config.head_dim`` (its attention
backend's ``get_kv_cache_shape``), and passes them flat ``[k0, v0, k1, v1, ...]`` in
``forward_meta.caches``. Its engine-side cache managers and its memory estimate read the same two
fields. A PaddleFleet model's layers need not agree with those fields (per-layer kv heads, a
``v_head_dim`` below the q/k head dim, MLA's 192/128 heads with no ``head_dim`` in the config), so:

* :func:`fit_fastdeploy_model_config` raises ``model_config.num_key_value_heads`` and
  ``model_config.head_dim`` to the largest kv head count and head dim (q/k or v) over the layers,
  so the single shape fits every layer. It must run when FastDeploy builds its ``ModelConfig``
  (before the runner sizes its attention backend): the plugin's registry routing calls it.
* :func:`layer_cache_views` gives each layer its part of the uniform cache: the leading
  ``Hkv_l`` heads, K in the leading ``qk_head_dim_l`` channels and V in the leading
  ``v_head_dim_l`` channels (the value padding). These are strided views, never copies; the
  backends and kernels address blocks through ``stride(0)``.
* :func:`uniform_cost` / :func:`uniform_budget`: what this costs against sizing each layer to its
  own need (``fdfleet plan``).
* :func:`check_fastdeploy_cache_settings` refuses, at load time and naming the setting, the cache
  layouts this plugin cannot read: block-wise fp8 / int8 / int4 KV (``kv_cache_quant_type``: scale
  tensors between K and V, uint8 data) and ``FD_ATTENTION_BACKEND=MLA_ATTN`` / ``DSA_ATTN`` (one
  compressed-latent tensor per layer).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..kvcache.layout import cache_bytes
from ..plan.layer import AttentionPlan, LayerAttention
from ._fields import field as _get

logger = logging.getLogger(__name__)

#: FD_ATTENTION_BACKEND values whose cache is not one K and one V tensor per layer
LATENT_CACHE_BACKENDS = ("MLA_ATTN", "DSA_ATTN")


@dataclass(frozen=True)
class UniformCache:
    """The single per-rank cache shape ``[num_blocks, num_kv_heads, block_size, head_dim]``."""

    num_kv_heads: int
    head_dim: int

    def fits(self, layer: LayerAttention) -> bool:
        """Whether ``layer``'s K and V fit in the leading heads and channels of this shape."""
        return (
            layer.num_kv_heads <= self.num_kv_heads
            and layer.qk_head_dim <= self.head_dim
            and layer.v_head_dim <= self.head_dim
        )


def uniform_cache(plan: AttentionPlan | Sequence[LayerAttention]) -> UniformCache:
    """The smallest single shape every layer of ``plan`` fits in: the largest kv head count
    and the largest head dim (q/k or v) over the layers (per TP rank, as the plan is)."""
    layers = list(plan)
    if not layers:
        raise ValueError("plan has no layers")
    return UniformCache(
        num_kv_heads=max(layer.num_kv_heads for layer in layers),
        head_dim=max(max(layer.qk_head_dim, layer.v_head_dim) for layer in layers),
    )


def fastdeploy_kv_heads(num_key_value_heads: int, tp_size: int) -> int:
    """Kv heads per rank as FastDeploy's runner computes them: ``max(1, num_key_value_heads // tp)``."""
    return max(1, int(num_key_value_heads) // int(tp_size))


def fit_fastdeploy_model_config(model_config: Any, plan: AttentionPlan | None = None) -> dict[str, Any]:
    """Raise ``model_config.num_key_value_heads`` / ``head_dim`` so FastDeploy's one cache shape
    fits every layer; return ``{field: (old, new)}`` for what changed (empty when it already fits).

    ``plan``: the model's unsharded plan (``tp_size == 1``); by default read from
    ``model_config.model`` (the model directory). FastDeploy divides ``num_key_value_heads`` by
    the TP size with a floor of one, the same sharding the plan applies per layer, so the largest
    unsharded count gives the largest per-rank count on every rank. ``num_attention_heads`` must
    stay a multiple of it (FastDeploy's attention buffers assume it): ``ValueError`` otherwise.
    Idempotent; never lowers a field. A per-layer ``head_wise_swa_ratio`` list (this plugin's
    extension) becomes FastDeploy's scalar default 0.0 there: FastDeploy's own attention backend,
    built by the runner whatever the model, compares it with a float.
    """
    if plan is None:
        from ..plan import plan_from_config

        model_dir = _get(model_config, "model")
        if not model_dir:
            raise ValueError(f"model_config.model must name the model directory, got {model_dir!r}")
        plan = plan_from_config(str(model_dir))
    if plan.tp_size != 1:
        raise ValueError(f"fit_fastdeploy_model_config needs the unsharded plan, got tp_size={plan.tp_size}")
    need = uniform_cache(plan)
    changes: dict[str, Any] = {}
    kv = _get(model_config, "num_key_value_heads")
    kv = None if kv is None or int(kv) <= 0 else int(kv)  # FastDeploy's default is -1 (unset)
    if kv is None or kv < need.num_kv_heads:
        changes["num_key_value_heads"] = (kv, need.num_kv_heads)
    head_dim = _get(model_config, "head_dim")
    if head_dim is None or int(head_dim) < need.head_dim:
        changes["head_dim"] = (head_dim, need.head_dim)
    heads = _get(model_config, "num_attention_heads")
    new_kv = changes.get("num_key_value_heads", (None, kv))[1]
    if heads is not None and new_kv and int(heads) % new_kv:
        raise ValueError(
            f"model_config.num_attention_heads={heads} is not a multiple of num_key_value_heads={new_kv} "
            f"(the largest kv head count over the layers, which FastDeploy's single cache shape needs)"
        )
    ratio = _get(model_config, "head_wise_swa_ratio")
    if isinstance(ratio, list | tuple):
        # a per-layer list is this plugin's extension (the model reads it from config.json); FastDeploy's
        # own attention backend, which the runner builds even though this model never calls it, takes
        # a float (``ratio > 0.0`` in its __init__): give it the scalar default
        changes["head_wise_swa_ratio"] = (list(ratio), 0.0)
    for name, (_, new) in changes.items():
        if isinstance(model_config, dict):
            model_config[name] = new
        else:
            setattr(model_config, name, new)
    if changes:
        logger.info(
            "FastDeploy cache shape sized for every layer: %s",
            ", ".join(f"model_config.{k} {old} -> {new}" for k, (old, new) in changes.items()),
        )
    return changes


def _kv_cache_quant_type(fd_config: Any) -> str | None:
    """The KV cache quantization FastDeploy will apply, from any place it can be set."""
    quant = _get(fd_config, "quant_config")
    value = _get(quant, "kv_cache_quant_type")
    if value:
        return str(value)
    mc = _get(fd_config, "model_config") if _get(fd_config, "model_config") is not None else fd_config
    for field in ("quantization", "quantization_config"):
        section = _get(mc, field)
        if isinstance(section, Mapping) and section.get("kv_cache_quant_type"):
            return str(section["kv_cache_quant_type"])
    return None


def check_fastdeploy_cache_settings(fd_config: Any = None, environ: Mapping[str, str] | None = None) -> None:
    """Refuse, naming the setting, FastDeploy cache layouts other than one K and one V tensor per
    layer in the model dtype: ``FD_ATTENTION_BACKEND=MLA_ATTN`` / ``DSA_ATTN`` and a
    ``kv_cache_quant_type`` (block-wise fp8 puts scale tensors between layers' K/V; int8 / fp8 /
    int4 caches hold uint8 data the kernels do not dequantize)."""
    env = os.environ if environ is None else environ
    backend = (env.get("FD_ATTENTION_BACKEND") or "").strip()
    if backend.upper() in LATENT_CACHE_BACKENDS:
        raise ValueError(
            f"FD_ATTENTION_BACKEND={backend} makes FastDeploy allocate one compressed-latent cache tensor "
            "per layer; the paddlefleet plugin caches the K and V its core attention sees (one of each "
            "per layer). Unset FD_ATTENTION_BACKEND (or use APPEND_ATTN) with --model-impl paddlefleet"
        )
    quant = _kv_cache_quant_type(fd_config) if fd_config is not None else None
    if quant and quant.lower() not in ("none", "null"):
        raise ValueError(
            f"kv_cache_quant_type={quant!r}: quantized KV caches (uint8 data; block-wise fp8 adds scale "
            "tensors between the layers' K and V) are not supported by the paddlefleet plugin's attention; "
            "remove kv_cache_quant_type from the quantization config"
        )


def check_cache_list(caches: Sequence[Any], num_layers: int) -> None:
    """Refuse ``forward_meta.caches`` laid out other than ``[k0, v0, k1, v1, ...]`` in a float dtype,
    naming the FastDeploy setting that produces it: one tensor per layer (``MLA_ATTN`` / ``DSA_ATTN``),
    four per layer (block-wise fp8: ``[k, v, k_scales, v_scales]``), or integer data (a quantized cache)."""
    items = list(caches)
    if items and all(isinstance(c, tuple | list) for c in items):
        return  # already paired (our own runner)
    if num_layers and len(items) == num_layers:
        raise ValueError(
            f"forward_meta.caches holds one tensor per layer ({len(items)} for {num_layers} layers): "
            "FD_ATTENTION_BACKEND=MLA_ATTN / DSA_ATTN caches a compressed latent, which the paddlefleet "
            "plugin cannot read; unset FD_ATTENTION_BACKEND"
        )
    if num_layers and len(items) == 4 * num_layers:
        raise ValueError(
            f"forward_meta.caches holds four tensors per layer ({len(items)} for {num_layers} layers): "
            "kv_cache_quant_type=block_wise_fp8 puts scale tensors between the layers' K and V, which the "
            "paddlefleet plugin does not read; remove kv_cache_quant_type"
        )
    for i, c in enumerate(items[:2]):
        name = str(getattr(c, "dtype", "")).rsplit(".", 1)[-1]
        if name.startswith(("uint", "int")):
            raise TypeError(
                f"forward_meta.caches[{i}] has dtype {name}: a quantized KV cache (kv_cache_quant_type), "
                "which the paddlefleet plugin does not read; remove kv_cache_quant_type"
            )


def layer_cache_views(
    caches: Sequence[tuple[Any, Any]], plan: AttentionPlan | Sequence[LayerAttention]
) -> list[tuple[Any, Any]]:
    """Each layer's ``(key, value)`` as views of its part of the cache pair it was given.

    ``caches[l] = (key [NB, H, BS, D], value [NB, H, BS, D'])`` with ``H >= Hkv_l``,
    ``D >= qk_head_dim_l``, ``D' >= v_head_dim_l`` (FastDeploy's uniform shape, or our own
    per-layer sizing). Returns ``key[:, :Hkv_l, :, :qk_head_dim_l]`` and
    ``value[:, :Hkv_l, :, :v_head_dim_l]``: strided views sharing the cache's memory (tensors that
    already have the layer's shape are returned as they are). ``ValueError`` names the
    ``model_config`` field to raise when a cache is too small.
    """
    layers = list(plan)
    if len(caches) < len(layers):
        raise ValueError(f"{len(caches)} key/value cache pairs for {len(layers)} attention layers")
    out = []
    for layer in layers:
        key, value = caches[layer.index]
        pair = []
        for what, cache, dim in (("key", key, layer.qk_head_dim), ("value", value, layer.v_head_dim)):
            shape = [int(s) for s in cache.shape]
            if len(shape) != 4:
                raise ValueError(
                    f"layer {layer.index}: the {what} cache must be [num_blocks, kv_heads, block_size, "
                    f"head_dim], got shape {shape}"
                )
            if shape[1] < layer.num_kv_heads or shape[3] < dim:
                raise ValueError(
                    f"layer {layer.index}: the {what} cache {shape} is too small for {layer.num_kv_heads} "
                    f"kv heads of dim {dim}; FastDeploy sizes it from model_config.num_key_value_heads "
                    "and model_config.head_dim, which must hold the largest layer "
                    "(fit_fastdeploy_model_config)"
                )
            if shape[1] != layer.num_kv_heads or shape[3] != dim:
                cache = cache[:, : layer.num_kv_heads, :, :dim]
            pair.append(cache)
        out.append((pair[0], pair[1]))
    return out


@dataclass(frozen=True)
class UniformCost:
    """Bytes per token (one TP rank, all layers, K + V) of the uniform shape against per-layer sizing."""

    num_kv_heads: int
    head_dim: int
    bytes_per_token_uniform: int
    bytes_per_token_per_layer_sizing: int

    @property
    def overhead(self) -> float:
        """Uniform over per-layer bytes (1.0: no waste)."""
        return self.bytes_per_token_uniform / self.bytes_per_token_per_layer_sizing

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "bytes_per_token_uniform": self.bytes_per_token_uniform,
            "bytes_per_token_per_layer_sizing": self.bytes_per_token_per_layer_sizing,
            "overhead": round(self.overhead, 4),
        }


def uniform_cost(
    plan: AttentionPlan | Sequence[LayerAttention], dtype: Any = "bf16", kv_cache_quant: Any = None
) -> UniformCost:
    """What FastDeploy's single shape costs for ``plan`` against sizing each layer to its own need;
    quantized (``kv_cache_quant``), one byte per element plus a dynamic format's scales
    (``[num_blocks, kv_heads, block_size]`` per K and V in ``dtype``, the model's) both ways."""
    layers = list(plan)
    shape = uniform_cache(layers)
    per_layer = sum(layer.num_kv_heads * (layer.qk_head_dim + layer.v_head_dim) for layer in layers)
    token_heads = sum(layer.num_kv_heads for layer in layers)
    return UniformCost(
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        bytes_per_token_uniform=cache_bytes(
            len(layers) * 2 * shape.num_kv_heads * shape.head_dim,
            len(layers) * shape.num_kv_heads,
            dtype,
            kv_cache_quant,
        ),
        bytes_per_token_per_layer_sizing=cache_bytes(per_layer, token_heads, dtype, kv_cache_quant),
    )


def uniform_budget(plan: AttentionPlan | Sequence[LayerAttention], budget: Any) -> dict[str, Any]:
    """FastDeploy's single shape against per-layer sizing for a :class:`~.layout.KVBudget` of ``plan``:
    the shape, bytes per token both ways, and the blocks and whole requests the budget's memory holds
    with the single shape (``num_blocks`` / ``max_requests`` of the budget are per-layer sizing)."""
    from ..kvcache.layout import GIB

    cost = uniform_cost(plan, budget.dtype, getattr(budget, "kv_cache_quant", None))
    per_block = cost.bytes_per_token_uniform * budget.block_size
    num_blocks = int(budget.memory_gib * GIB) // per_block
    return {
        **cost.to_dict(),
        "extra_bytes_per_token": cost.bytes_per_token_uniform - cost.bytes_per_token_per_layer_sizing,
        "bytes_per_block_uniform": per_block,
        "num_blocks_uniform": num_blocks,
        "max_requests_uniform": num_blocks // budget.blocks_per_request,
    }


__all__ = [
    "LATENT_CACHE_BACKENDS",
    "UniformCache",
    "UniformCost",
    "check_cache_list",
    "check_fastdeploy_cache_settings",
    "fastdeploy_kv_heads",
    "fit_fastdeploy_model_config",
    "layer_cache_views",
    "uniform_budget",
    "uniform_cache",
    "uniform_cost",
]
