"""Static KV cache scales from the checkpoint (``kv_cache_quant_type`` ``float8_e4m3fn`` / ``int8``).

A static quantized cache is written and read at scales calibrated offline and stored in the
checkpoint beside each attention layer, under FastDeploy's names
``{layer prefix}.cachek_matmul.activation_scale`` and ``{layer prefix}.cachev_matmul.activation_scale``
(``model_executor/layers/quantization/kv_cache.py``), where the layer prefix is the attention
module's path (``decoder.layers.3.self_attn``; a leading ``model.`` is accepted as for weights).
Each holds ``s`` per kv head ``[kv_heads]`` or per channel ``[kv_heads * head_dim]`` (``int8`` is
always per channel). FastDeploy's loader casts ``s`` to the model dtype ``T`` and keeps two
multipliers (``model_executor/layers/quantization/kv_cache.py`` ``load_scale``; the v1 loader's
``Attention.weight_loader``, ``layers/attention/attention.py:247-251``):

* the **quant multiplier** ``cache_k_scale = max_bound / s``, in ``T``: what its cache write multiplies
  by (``QuantToC8``);
* the **dequant multiplier** ``cache_k_out_scale = s / max_bound`` (``load_scale``; the v1 loader's
  ``process_weights_after_loading`` takes ``1 / cache_k_scale``).

:meth:`StaticKVScales.finish` keeps both, per layer, cut to this tensor-parallel rank's kv heads
(``layer.kv_head_range``) as the kv heads themselves are cut: the dequant multiplier (``s / max_bound``)
as the mapping's values, the quant multiplier (:func:`quant_multiplier`) in
:meth:`~StaticKVScales.quant_multipliers`, which the cache write uses as it is. ``T(1 / dequant)`` is
NOT the same value: for about a quarter of scales it is one ulp of ``T`` off (``docs/kv_quant.md``).
A layer whose tensor is missing is refused, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from ..kvcache.quant import KVCacheQuant
from ..plan.layer import AttentionPlan, LayerAttention

logger = logging.getLogger(__name__)

K_SUFFIX = "cachek_matmul.activation_scale"
V_SUFFIX = "cachev_matmul.activation_scale"
#: FastDeploy's other static-cache tensors (zero points, ``in_scale`` variants): a served checkpoint
#: may hold them; they are dropped (block_wise_fp8 computes its scales, zero-point formats are refused)
OTHER_SUFFIXES = (
    "cachek_matmul.activation_zero_point",
    "cachev_matmul.activation_zero_point",
    "cachek_matmul.in_scale",
    "cachev_matmul.in_scale",
)


def is_cache_scale_name(name: str) -> bool:
    """Whether ``name`` is one of FastDeploy's static KV cache tensors."""
    return name.endswith((K_SUFFIX, V_SUFFIX, *OTHER_SUFFIXES))


class StaticKVScales(Mapping):
    """``{layer index: (key_scale, value_scale)}``: each layer's dequant multipliers (model dtype,
    ``[Hkv_l]`` or ``[Hkv_l * D]`` on this rank) once :meth:`finish` ran.

    ``prefixes``: ``{layer index: attention module path}`` (the patch report's names less
    ``.core_attention``)."""

    def __init__(self, prefixes: Mapping[int, str], quant: KVCacheQuant) -> None:
        if quant.dynamic:
            raise ValueError(f"kv_cache_quant_type={quant.name!r} computes its scales: no checkpoint scales")
        self.prefixes = dict(prefixes)
        self.quant = quant
        self._raw: dict[str, Any] = {}
        self._scales: dict[int, tuple[Any, Any]] = {}
        self._quant: dict[int, tuple[Any, Any]] = {}

    # -- Mapping --------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self._scales[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._scales)

    def __len__(self) -> int:
        return len(self._scales)

    def quant_multipliers(self, index: int) -> tuple[Any, Any] | None:
        """Layer ``index``'s quant multipliers ``(key, value)`` (FastDeploy's ``cache_k_scale`` /
        ``cache_v_scale``, model dtype, shaped like the dequant multipliers) once :meth:`finish` ran;
        ``None`` for a layer it did not load."""
        return self._quant.get(index)

    def tensor_name(self, index: int, which: str) -> str:
        """The checkpoint name of layer ``index``'s ``"k"`` or ``"v"`` scale."""
        prefix = self.prefixes.get(index, f"<layer {index} prefix>")
        return f"{prefix}.{K_SUFFIX if which == 'k' else V_SUFFIX}"

    def take(self, state_dict: MutableMapping[str, Any]) -> int:
        """Move every static cache tensor out of ``state_dict`` (the model has no parameter for it);
        keep the scales. Returns how many were taken."""
        names = [n for n in state_dict if is_cache_scale_name(n)]
        for name in names:
            value = state_dict.pop(name)
            key = name[len("model.") :] if name.startswith("model.") else name
            if key.endswith((K_SUFFIX, V_SUFFIX)):
                self._raw[key] = value
        return len(names)

    def take_from(self, pairs: Any) -> int:
        """Keep the static cache scales of ``(name, tensor)`` pairs, dropping the rest (weights that
        PaddleFormers already loaded)."""
        n = 0
        for name, value in pairs:
            if is_cache_scale_name(name):
                n += self.take({name: value})
        return n

    def finish(self, plan: AttentionPlan, dtype: Any) -> None:
        """Turn the taken tensors into each layer's dequant multipliers ``s / max_bound`` in
        ``dtype`` (FastDeploy's ``load_scale``) and quant multipliers ``max_bound / s``
        (:func:`quant_multiplier`), cut to this rank's kv heads. ``ValueError`` names a missing tensor
        or one of the wrong size."""
        import paddle

        for layer in plan:
            pair, mults = [], []
            for which, dim in (("k", layer.qk_head_dim), ("v", layer.v_head_dim)):
                name = self.tensor_name(layer.index, which)
                raw = self._raw.get(name)
                if raw is None:
                    raise ValueError(
                        f"kv_cache_quant_type={self.quant.name!r}: the checkpoint has no {name!r} (layer "
                        f"{layer.index}'s static {which.upper()} cache scale); a static quantized cache "
                        "needs calibrated scales: use kv_cache_quant_type=block_wise_fp8 for a checkpoint "
                        "without them"
                    )
                t = raw if isinstance(raw, paddle.Tensor) else paddle.to_tensor(raw)
                t = local_scale(t.cast(dtype).reshape([-1]), layer, dim, self.quant, name)
                pair.append(t / self.quant.max_bound)  # FastDeploy's cache_k_out_scale, in the model dtype
                mults.append(quant_multiplier(t, self.quant.max_bound))  # its cache_k_scale
            self._scales[layer.index] = (pair[0], pair[1])
            self._quant[layer.index] = (mults[0], mults[1])
        logger.info(
            "static %s cache scales loaded for %d layers (%s)",
            self.quant.name,
            len(self._scales),
            "per channel" if self.quant.channel_wise else "per kv head",
        )


def quant_multiplier(t: Any, max_bound: float) -> Any:
    """FastDeploy's quant multiplier of the checkpoint scales ``t`` (a paddle tensor in the model dtype
    ``T``): ``max_bound / t`` rounded once to ``T`` (``cache_k_scale``). On a GPU it is FastDeploy's
    own expression (``Attention.weight_loader``: ``max_bound / loaded_weight``), the same op on the same
    dtype; paddle's GPU division is IEEE-rounded (fp32), and for fp16 / bf16 rounds the fp32 quotient
    once to ``T`` (exact enough: fp32 has more than ``2p + 2`` bits). Elsewhere (CPU: no fp16 / bf16
    division in paddle, and its fp32 one is not always correctly rounded) the same value through a
    float64 quotient rounded once to ``T``."""
    import paddle

    if t.place.is_gpu_place():
        return max_bound / t
    return (paddle.full_like(t, max_bound, dtype="float64") / t.astype("float64")).astype(t.dtype)


def local_scale(t: Any, layer: LayerAttention, head_dim: int, quant: KVCacheQuant, name: str) -> Any:
    """This rank's part of a flat scale tensor ``t``: ``[Hkv_l]`` (per kv head) or ``[Hkv_l * D]``
    (per channel, ``quant.channel_wise``), from a tensor that is already this size or covers every
    kv head (cut at ``layer.kv_head_range``). ``ValueError`` naming ``name`` otherwise."""
    unit = head_dim if quant.channel_wise else 1
    n = int(t.shape[0])
    local = layer.num_kv_heads * unit
    start, stop = layer.kv_head_range
    if n == local:  # this rank's already (or one rank)
        return t
    if n % unit == 0 and n >= stop * unit and stop - start == layer.num_kv_heads:  # every kv head's
        return t[start * unit : stop * unit]
    what = (
        f"[kv_heads * head_dim] = [{layer.num_kv_heads} * {head_dim}]" if quant.channel_wise else "[kv_heads]"
    )
    raise ValueError(
        f"{name} has {n} values: kv_cache_quant_type={quant.name!r} expects {what} per rank "
        f"({local}), or every kv head's (this rank's kv heads are {start}..{stop - 1})"
    )


__all__ = [
    "K_SUFFIX",
    "OTHER_SUFFIXES",
    "V_SUFFIX",
    "StaticKVScales",
    "is_cache_scale_name",
    "local_scale",
    "quant_multiplier",
]
