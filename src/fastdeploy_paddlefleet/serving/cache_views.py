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
  layouts this plugin cannot read: ``FD_ATTENTION_BACKEND=MLA_ATTN`` / ``DSA_ATTN`` (one
  compressed-latent tensor per layer) and the ``kv_cache_quant_type`` formats
  ``kvcache.quant.kv_cache_quant`` refuses (zero-point, int4, fp8 with a 240 bound).
* Quantized caches (``kv_cache_quant_type`` ``block_wise_fp8``, ``float8_e4m3fn``, ``int8``):
  FastDeploy allocates ``uint8`` codes in the same shape and, for ``block_wise_fp8``, a key and a
  value scale tensor ``[num_blocks, kv_heads, block_size]`` (model dtype) per layer, passed as
  ``[k, v, k_scales, v_scales]`` per layer (``worker/gpu_model_runner.py`` ``initialize_kv_cache``).
  :func:`quantized_layer_cache_views` gives each layer a
  :class:`~fastdeploy_paddlefleet.backends.base.QuantizedKVCache` of views (leading heads and
  channels of the codes, leading heads of the scales); a static format's scales are the layer's
  dequant multipliers from the checkpoint (``serving/kv_scales.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..kvcache.layout import cache_bytes
from ..kvcache.quant import KVCacheQuant, kv_cache_quant
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
    layer (plus a dynamic format's scales): ``FD_ATTENTION_BACKEND=MLA_ATTN`` / ``DSA_ATTN`` and a
    ``kv_cache_quant_type`` that ``kvcache.quant.kv_cache_quant`` refuses (zero-point, int4, the
    240-bound fp8). ``block_wise_fp8``, ``float8_e4m3fn`` and ``int8`` pass."""
    env = os.environ if environ is None else environ
    backend = (env.get("FD_ATTENTION_BACKEND") or "").strip()
    if backend.upper() in LATENT_CACHE_BACKENDS:
        raise ValueError(
            f"FD_ATTENTION_BACKEND={backend} makes FastDeploy allocate one compressed-latent cache tensor "
            "per layer; the paddlefleet plugin caches the K and V its core attention sees (one of each "
            "per layer). Unset FD_ATTENTION_BACKEND (or use APPEND_ATTN) with --model-impl paddlefleet"
        )
    quant = _kv_cache_quant_type(fd_config) if fd_config is not None else None
    kv_cache_quant(quant)  # ValueError naming a refused or unknown format


def check_cache_list(caches: Sequence[Any], num_layers: int, quant: KVCacheQuant | None = None) -> None:
    """Refuse ``forward_meta.caches`` laid out other than ``[k0, v0, k1, v1, ...]`` in a float dtype
    (``quant`` None) or as ``quant`` stores it (:func:`split_quantized_caches`), naming the FastDeploy
    setting that produces it: one tensor per layer (``MLA_ATTN`` / ``DSA_ATTN``), four per layer
    (block-wise fp8: ``[k, v, k_scales, v_scales]``) or integer data for a model loaded without
    ``kv_cache_quant_type``."""
    items = list(caches)
    if quant is not None:
        split_quantized_caches(items, num_layers, quant)
        return
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
            "kv_cache_quant_type=block_wise_fp8's layout ([k, v, k_scales, v_scales]), but the model was "
            "loaded without kv_cache_quant_type; give the same quantization config to the model and the cache"
        )
    for i, c in enumerate(items[:2]):
        name = str(getattr(c, "dtype", "")).rsplit(".", 1)[-1]
        if name.startswith(("uint", "int")):
            raise TypeError(
                f"forward_meta.caches[{i}] has dtype {name}: a quantized KV cache (kv_cache_quant_type), "
                "but the model was loaded without kv_cache_quant_type; give the same quantization config "
                "to the model and the cache"
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


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", "")).rsplit(".", 1)[-1]


def split_quantized_caches(
    caches: Sequence[Any], num_layers: int, quant: KVCacheQuant
) -> list[tuple[Any, Any, Any, Any]]:
    """A quantized ``forward_meta.caches`` -> per layer ``(key, value, key_scales, value_scales)``
    (the scales ``None`` for a static format).

    FastDeploy's layout (and the plugin's runner's): ``block_wise_fp8`` four tensors per layer
    ``[k, v, k_scales, v_scales]`` (codes ``uint8 [NB, H, BS, D]``, scales ``[NB, H, BS]`` float);
    static formats two ``uint8`` tensors per layer. Entries already grouped per layer (tuples of 4
    or 2, or :class:`QuantizedKVCache`) pass. ``ValueError`` / ``TypeError`` name the entry."""
    from ..backends.base import QuantizedKVCache

    items = list(caches)
    per = 4 if quant.dynamic else 2
    if items and all(isinstance(c, QuantizedKVCache) for c in items):
        groups = [(c.key, c.value, c.key_scale, c.value_scale) for c in items]
    elif items and all(isinstance(c, tuple | list) for c in items):
        if any(len(c) != per for c in items):
            raise ValueError(
                f"forward_meta.caches: kv_cache_quant_type={quant.name!r} needs {per} tensors per layer, "
                f"got groups of {sorted({len(c) for c in items})}"
            )
        groups = [tuple(c) + (None,) * (4 - per) for c in items]
    else:
        if len(items) % per or len(items) // per < num_layers:
            raise ValueError(
                f"forward_meta.caches holds {len(items)} tensors for {num_layers} layers: "
                f"kv_cache_quant_type={quant.name!r} caches {per} per layer "
                f"({'[k, v, k_scales, v_scales]' if quant.dynamic else '[k, v] uint8'})"
            )
        groups = [tuple(items[i : i + per]) + (None,) * (4 - per) for i in range(0, len(items), per)]
    if len(groups) < num_layers:
        raise ValueError(f"forward_meta.caches holds {len(groups)} layers' caches, the plan has {num_layers}")
    seen: dict[int, str] = {}
    for layer, group in enumerate(groups[:num_layers]):
        for kind, t in zip(("key", "value", "key_scales", "value_scales"), group, strict=True):
            if t is None:
                continue
            where = f"layer {layer} {kind}"
            first = seen.setdefault(id(t), where)
            if first != where:
                raise ValueError(
                    f"forward_meta.caches: the {where} tensor is the same tensor as the {first} tensor; "
                    "every cache tensor must be distinct"
                )
            name = _dtype_name(t)
            if kind in ("key", "value") and name != "uint8":
                raise TypeError(
                    f"forward_meta.caches: the {where} cache has dtype {name}, kv_cache_quant_type="
                    f"{quant.name!r} stores uint8 codes (is the same quantization config given to the cache?)"
                )
            if kind.endswith("scales") and name not in ("float16", "bfloat16", "float32"):
                raise TypeError(
                    f"forward_meta.caches: the {where} tensor has dtype {name}, expected the model's "
                    "float dtype"
                )
    return groups


def quantized_layer_cache_views(
    caches: Sequence[Any],
    plan: AttentionPlan | Sequence[LayerAttention],
    quant: KVCacheQuant,
    static_scales: Mapping[int, tuple[Any, Any]] | None = None,
) -> list[Any]:
    """Each layer's :class:`~fastdeploy_paddlefleet.backends.base.QuantizedKVCache` of views.

    ``caches``: a quantized ``forward_meta.caches`` (:func:`split_quantized_caches`), codes
    ``uint8 [NB, H, BS, D]`` with ``H >= Hkv_l`` and ``D`` at least the layer's dims (FastDeploy's
    uniform shape or the runner's own), dynamic scales ``[NB, H, BS]``. Returns codes
    ``key[:, :Hkv_l, :, :qk_l]`` / ``value[:, :Hkv_l, :, :v_l]`` and scales ``[:, :Hkv_l, :]`` (strided
    views sharing the cache's memory); a static format's scales are ``static_scales[layer.index]``
    (dequant multipliers ``[Hkv_l]`` or ``[Hkv_l * D]``, ``serving/kv_scales.py``), with its quant
    multipliers ``static_scales.quant_multipliers(layer.index)`` where it has them (FastDeploy's
    ``cache_k_scale``, which the write multiplies by): ``ValueError`` naming the checkpoint tensor when
    absent."""
    from ..backends.base import QuantizedKVCache

    layers = list(plan)
    groups = split_quantized_caches(caches, max((la.index for la in layers), default=-1) + 1, quant)
    codes = [(g[0], g[1]) for g in groups]
    views = layer_cache_views(codes, layers)
    out = []
    for layer, (key, value) in zip(layers, views, strict=True):
        mult: tuple[Any, Any] = (None, None)
        if quant.dynamic:
            scales = []
            for what, t, cache in (
                ("key", groups[layer.index][2], key),
                ("value", groups[layer.index][3], value),
            ):
                shape = [int(d) for d in t.shape]
                want = [int(d) for d in cache.shape[:3]]
                if len(shape) != 3 or shape[0] != want[0] or shape[2] != want[2] or shape[1] < want[1]:
                    raise ValueError(
                        f"layer {layer.index}: the {what} scales {shape} do not match the {what} codes "
                        f"[num_blocks, kv_heads, block_size] = {want} (block_wise_fp8: one scale per token "
                        "and kv head)"
                    )
                scales.append(t if shape[1] == want[1] else t[:, : want[1], :])
            k_scale, v_scale = scales
        else:
            pair = (static_scales or {}).get(layer.index)
            if pair is None:
                namer = getattr(static_scales, "tensor_name", None)
                name = namer(layer.index, "k") if namer else "{layer prefix}.cachek_matmul.activation_scale"
                raise ValueError(
                    f"layer {layer.index}: kv_cache_quant_type={quant.name!r} needs the checkpoint's static "
                    f"cache scales, and {name!r} was not loaded"
                )
            k_scale, v_scale = pair
            # FastDeploy's own quant multipliers (cache_k_scale), which the write multiplies by
            mults = getattr(static_scales, "quant_multipliers", None)
            mult = (mults(layer.index) if mults is not None else None) or mult
        out.append(QuantizedKVCache(key, value, k_scale, v_scale, quant, *mult))
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
    "quantized_layer_cache_views",
    "split_quantized_caches",
    "uniform_budget",
    "uniform_cache",
    "uniform_cost",
]
