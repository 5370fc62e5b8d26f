"""``PagedCoreAttention``: the layer that replaces a PaddleFleet core attention.

It takes PaddleFleet's whole core-attention call (positional or keyword, plus
any ``**kwargs`` newer versions add), flattens ``[b, s, heads, dim]`` or
``[s, heads, dim]`` inputs to packed tokens, reads the step's batch metadata
and this layer's KV cache from the model's :class:`StepContextHolder`, and
hands the work to an :class:`AttentionBackend`.

The forward is a small base plus feature *fusers*, each owning one concern:

* :class:`SinkFuser`: which sink tensor (if any) the backend receives;
* :class:`ValuePadFuser`: MLA value padding for backends that need
  ``v_head_dim == qk_head_dim`` (pad V with zeros, trim the output back).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import paddle

from ..backends.base import AttentionBackend
from ..plan.layer import LayerAttention
from .context import StepContextHolder

logger = logging.getLogger(__name__)

#: PaddleFleet core-attention attributes the adapter keeps readable for the host model
MIRRORED_ATTRS = (
    "config",
    "layer_number",
    "is_swa",
    "is_mtp_layer",
    "k_channels",
    "v_channels",
    "num_attention_heads_per_partition",
    "num_query_groups_per_partition",
    "hidden_size_per_attention_head",
    "hidden_size_per_partition",
    "softmax_scale",
    "sliding_window",
    "head_wise_swa_ratio",
    "attn_mask_type",
)


def backend_layer(layer: LayerAttention, backend: AttentionBackend) -> LayerAttention:
    """``layer`` as ``backend`` sees it: V padded to the q/k head dim when it needs equal dims.

    The KV cache of such a layer must be allocated for this view (its value
    cache has ``qk_head_dim`` channels).
    """
    if layer.v_head_dim != layer.qk_head_dim and not backend.supports_unequal_v_dim:
        if layer.v_head_dim > layer.qk_head_dim:
            raise ValueError(
                f"layer {layer.index}: v_head_dim={layer.v_head_dim} > qk_head_dim={layer.qk_head_dim} "
                f"cannot be padded for backend {backend.name!r}"
            )
        return dataclasses.replace(layer, v_head_dim=layer.qk_head_dim)
    return layer


class SinkFuser:
    """Supplies the backend's ``sinks`` argument from the original ``softmax_offset``.

    ``learnable`` layers pass the parameter (``[Hq]``, this rank's slice);
    ``off-by-one`` layers need none (the backend knows the zero sink from the
    plan); ``vanilla`` layers have none.
    """

    def __init__(self, layer: LayerAttention, owner: paddle.nn.Layer) -> None:
        self.kind = layer.sink
        self._owner = owner

    def sinks(self) -> paddle.Tensor | None:
        if self.kind != "learnable":
            return None
        # inference only: kernels take it through DLPack, which refuses tensors that need gradients
        return self._owner.softmax_offset.detach()


class ValuePadFuser:
    """Pads V ``[T, H, Dv]`` with zeros to ``Dqk`` and trims the output ``[T, H, Dqk]`` back to ``Dv``."""

    def __init__(self, v_head_dim: int, qk_head_dim: int) -> None:
        self.v_head_dim = v_head_dim
        self.pad = qk_head_dim - v_head_dim

    def before(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> tuple[Any, Any, Any]:
        zeros = paddle.zeros([v.shape[0], v.shape[1], self.pad], dtype=v.dtype)
        return q, k, paddle.concat([v, zeros], axis=-1)

    def after(self, out: paddle.Tensor) -> paddle.Tensor:
        return out[..., : self.v_head_dim]


class PagedCoreAttention(paddle.nn.Layer):
    """Drop-in replacement for a PaddleFleet ``DotProductAttention`` running on the paged KV cache.

    ``layer`` is this module's plan entry (``layer.index`` selects
    ``ctx.kv_caches[layer.index]``). The original module's sink parameter is
    re-registered here under the same name ``softmax_offset`` (the very same
    object), so ``...core_attention.softmax_offset`` checkpoint names still load.
    The original module is kept (unregistered) for :meth:`original`.
    """

    def __init__(
        self,
        original: paddle.nn.Layer,
        layer: LayerAttention,
        backend: AttentionBackend,
        holder: StepContextHolder,
    ) -> None:
        super().__init__()
        if not isinstance(layer, LayerAttention):
            raise TypeError(f"layer must be a LayerAttention, got {type(layer).__name__}")
        if not isinstance(backend, AttentionBackend):
            raise TypeError(f"backend must be an AttentionBackend, got {type(backend).__name__}")
        if not isinstance(holder, StepContextHolder):
            raise TypeError(f"holder must be a StepContextHolder, got {type(holder).__name__}")
        # plain attributes (object.__setattr__): not sublayers, so state-dict names stay unchanged
        object.__setattr__(self, "_original", original)
        self.layer = layer
        self.backend = backend
        self.holder = holder
        for name in MIRRORED_ATTRS:
            if hasattr(original, name):
                object.__setattr__(self, name, getattr(original, name))
        offset = getattr(original, "softmax_offset", None)
        if getattr(original, "_parameters", {}).get("softmax_offset") is not None:
            self.add_parameter("softmax_offset", offset)  # the same Parameter object
        else:
            object.__setattr__(self, "softmax_offset", offset)
        self.backend_layer = backend_layer(layer, backend)
        self.sink_fuser = SinkFuser(layer, self)
        self.value_fuser = (
            ValuePadFuser(layer.v_head_dim, layer.qk_head_dim)
            if self.backend_layer.v_head_dim != layer.v_head_dim
            else None
        )

    def original(self) -> paddle.nn.Layer:
        """The core attention this adapter replaced."""
        return self._original

    def extra_repr(self) -> str:
        l = self.layer
        return f"index={l.index}, kind={l.kind}, sink={l.sink}, backend={self.backend.name}"

    def _packed(self, t: paddle.Tensor, what: str, heads: int, dim: int) -> paddle.Tensor:
        """``[b, s, H, D]`` or ``[s, H, D]`` -> ``[b*s, H, D]``, checking heads and dim."""
        if t.ndim not in (3, 4):
            raise ValueError(
                f"{what} must be [b, s, heads, dim] or [s, heads, dim], got shape {list(t.shape)} "
                f"(layer {self.layer.index})"
            )
        if t.shape[-2] != heads or t.shape[-1] != dim:
            raise ValueError(
                f"{what} of layer {self.layer.index} must have {heads} heads of dim {dim}, "
                f"got shape {list(t.shape)}"
            )
        return t.reshape([-1, heads, dim])

    def forward(
        self,
        query: paddle.Tensor,
        key: paddle.Tensor,
        value: paddle.Tensor,
        attention_mask: Any = None,
        attn_mask_startend_row_indices: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        use_rr_flash_attention: bool = False,
        past_key_values: Any = None,
        layer_idx: Any = None,
        use_cache: bool = False,
        x: Any = None,
        qr: Any = None,
        kv_compressed: Any = None,
        k_pos_emb: Any = None,
        q_absorbed: Any = None,
        v_b_proj_weight: Any = None,
        **kwargs: Any,
    ) -> paddle.Tensor:
        """``query [b, s, Hq, Dqk]`` (or ``[s, Hq, Dqk]``), ``key``/``value`` with ``Hkv`` heads.

        Returns ``[b, s, Hq * Dv]`` (or ``[s, Hq * Dv]``), the original layout.
        Masks and the other PaddleFleet arguments are ignored: visibility comes
        from the plan (PaddleFleet's window, head-wise split and causal mask, as
        its FlashMask path builds them) and the step's batch metadata. K/V carry
        the plan's kv heads (for MLA one per query head, whatever the module's
        ``num_query_groups_per_partition`` says). An ``attn_mask_type`` other
        than causal (PaddleFleet's ``AttnMaskType.causal``, or ``"causal"``) is
        refused: the paged path is causal only.
        """
        if attn_mask_type is not None and getattr(attn_mask_type, "name", attn_mask_type) != "causal":
            raise ValueError(
                f"layer {self.layer.index}: attn_mask_type={attn_mask_type!r}, but the paged attention "
                "is causal only"
            )
        ctx = self.holder.get()
        l = self.layer
        lead = list(query.shape[:-2])
        q = self._packed(query, "query", l.num_q_heads, l.qk_head_dim)
        k = self._packed(key, "key", l.num_kv_heads, l.qk_head_dim)
        v = self._packed(value, "value", l.num_kv_heads, l.v_head_dim)
        if q.shape[0] != ctx.meta.num_tokens:
            raise ValueError(
                f"layer {l.index}: the step's batch metadata has {ctx.meta.num_tokens} tokens, "
                f"but query holds {q.shape[0]} (shape {list(query.shape)})"
            )
        if l.index >= len(ctx.kv_caches):
            raise ValueError(f"layer {l.index}: the step context has only {len(ctx.kv_caches)} kv caches")
        if self.value_fuser is not None:
            q, k, v = self.value_fuser.before(q, k, v)
        out = self.backend.forward(
            q, k, v, self.backend_layer, ctx.meta, ctx.kv_caches[l.index], self.sink_fuser.sinks()
        )
        if self.value_fuser is not None:
            out = self.value_fuser.after(out.reshape([-1, l.num_q_heads, self.backend_layer.v_head_dim]))
        return out.reshape([*lead, l.num_q_heads * l.v_head_dim])
