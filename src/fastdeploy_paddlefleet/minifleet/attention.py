"""minifleet attention: ``SelfAttention``, ``MLASelfAttention`` and their ``DotProductAttention``.

``DotProductAttention`` mirrors PaddleFleet's core attention
(``transformer/dot_product_attention.py``): same constructor attributes, same
call signature, inputs ``[b, s, heads, dim]`` with K/V not repeated for GQA,
output ``[b, s, heads * v_dim]``. Its forward takes the host's two paths, as
dense eager attention:

* with ``attn_mask_startend_row_indices`` (PaddleFleet's FlashMask path, the
  one sliding layers must take): the layer's window and head-wise split are
  folded into the start/end rows the way ``startend_row_indices_add_sliding_window``
  does (key ``j``'s first masked row becomes ``j + W``), and the dense mask is
  read back from the rows with FlashMask's documented rules;
* without them (the eager path): a causal mask (or the given ``attention_mask``)
  filled with ``-10000`` before the softmax; a sliding layer refuses this path.

A sink is a score column appended before the softmax and dropped after it.
Masks, sinks and head counts come from the raw config fields, never from the
plan, so a convention slip in the plan shows up in minifleet's parity check.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import paddle
import paddle.nn.functional as F

from .config import MiniFleetConfig, layer_head_wise_ratio, window_left_size
from .norm import RMSNorm

#: the masked-score fill of PaddleFleet's eager softmax (``transformer/utils.py`` ``attention_mask_func``)
EAGER_MASK_FILL = -10000.0


class AttnMaskType(enum.Enum):
    """PaddleFleet's ``transformer/enums.py`` ``AttnMaskType`` (same members and values).

    The FlashMask path is causal only for ``AttnMaskType.causal``: a string
    ``"causal"`` is not equal to it, as in PaddleFleet.
    """

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


def rotate_half_rope(x: paddle.Tensor, position_ids: paddle.Tensor, theta: float) -> paddle.Tensor:
    """Rotary embedding (rotate-half form) of ``x [b, s, heads, d]`` at ``position_ids [b, s]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (paddle.arange(0, d, 2, dtype="float32") / d))  # [d/2]
    angles = position_ids.astype("float32").unsqueeze(-1) * inv_freq  # [b, s, d/2]
    angles = paddle.concat([angles, angles], axis=-1).unsqueeze(2)  # [b, s, 1, d]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = paddle.concat([-x2, x1], axis=-1)
    return (x * paddle.cos(angles) + rotated * paddle.sin(angles)).astype(x.dtype)


def default_position_ids(batch: int, seq: int) -> paddle.Tensor:
    return paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])


def causal_startend_row_indices(batch: int, seq: int) -> paddle.Tensor:
    """``[batch, 1, seq, 1]`` int32, every entry ``seq``: one causal document per row (what
    PaddleFleet's data path feeds the FlashMask path for unpacked causal sequences)."""
    return paddle.full([batch, 1, seq, 1], seq, dtype="int32")


def add_sliding_window(startend: paddle.Tensor, left: int, ratio: float, num_kv_heads: int) -> paddle.Tensor:
    """Fold a left window ``left`` (W keys including the query) into start/end rows.

    ``startend [b, 1 or Hkv, s, 1 or 2]``: column 0 holds each key's first
    masked row below the diagonal. Sliding kv heads get ``min(row, j + left)``;
    with ``n = int(ratio * Hkv)`` and ``0 < n < Hkv`` only the LAST ``n`` kv
    heads slide, otherwise all of them (ratio 0 included). ``left <= 0``
    changes nothing. Returns ``[b, Hkv, s, same columns]``.
    """
    if left <= 0:
        return startend
    b, heads, s, cols = startend.shape
    if cols not in (1, 2):
        raise ValueError(f"attn_mask_startend_row_indices must have 1 or 2 columns here, got {cols}")
    if heads not in (1, num_kv_heads):
        raise ValueError(
            f"attn_mask_startend_row_indices has {heads} heads; expected 1 or {num_kv_heads} (kv heads)"
        )
    rows = startend.astype("int32").expand([b, num_kv_heads, s, cols])
    first = rows[..., 0]
    window = (paddle.arange(s, dtype="int32") + left).reshape([1, 1, s]).expand([b, num_kv_heads, s])
    slid = paddle.minimum(first, window)
    n_slide = int(ratio * num_kv_heads)
    if 0 < n_slide < num_kv_heads:
        keep = paddle.arange(num_kv_heads).reshape([1, num_kv_heads, 1]) < num_kv_heads - n_slide
        slid = paddle.where(keep.expand([b, num_kv_heads, s]), first, slid)
    return paddle.concat([slid.unsqueeze(-1), rows[..., 1:]], axis=-1) if cols == 2 else slid.unsqueeze(-1)


def startend_masked(startend: paddle.Tensor, q_len: int, causal: bool) -> paddle.Tensor:
    """Dense ``[b, heads, q_len, s]`` bool (True: masked) from FlashMask start/end rows.

    FlashMask's documented rules for key (column) ``j``, query (row) ``i``:
    causal with one column ``[LTS]``: masked iff ``j > i`` or ``i >= LTS``;
    causal with two ``[LTS, LTE]``: ``j > i`` or ``LTS <= i < LTE``; non-causal
    with two ``[LTS, UTE]``: ``i >= LTS`` or ``i < UTE``; non-causal with four
    ``[LTS, LTE, UTS, UTE]``: ``LTS <= i < LTE`` or ``UTS <= i < UTE``.
    Queries and keys are the same rows here (``q_len == s``).
    """
    b, heads, s, cols = startend.shape
    if q_len != s:
        raise ValueError(f"minifleet's FlashMask path needs q_len == k_len, got {q_len} and {s}")
    st = startend.astype("int64").transpose([0, 1, 3, 2]).unsqueeze(-2)  # [b, h, cols, 1, s]
    i = paddle.arange(q_len, dtype="int64").reshape([1, 1, q_len, 1])
    j = paddle.arange(s, dtype="int64").reshape([1, 1, 1, s])
    col = [st[:, :, c] for c in range(cols)]  # each [b, h, 1, s]
    if causal:
        if cols == 1:
            masked = i >= col[0]
        elif cols == 2:
            masked = paddle.logical_and(i >= col[0], i < col[1])
        else:
            raise ValueError(f"causal start/end rows must have 1 or 2 columns, got {cols}")
        return paddle.logical_or(masked, (j > i).expand(masked.shape))
    if cols == 2:
        return paddle.logical_or(i >= col[0], i < col[1])
    if cols == 4:
        lower = paddle.logical_and(i >= col[0], i < col[1])
        return paddle.logical_or(lower, paddle.logical_and(i >= col[2], i < col[3]))
    raise ValueError(f"non-causal start/end rows must have 2 or 4 columns, got {cols}")


class DotProductAttention(paddle.nn.Layer):
    """PaddleFleet's core attention, dense and eager, on both of the host's paths (module doc).

    ``layer_number`` is 0-based, as in PaddleFleet's layer specs (decoder layers
    count the empty head layers, MTP layers restart at 0): code that maps
    modules to layers keeps its own count.
    """

    def __init__(
        self,
        config: MiniFleetConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        is_mtp_layer: bool = False,
        is_swa: bool = False,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        layer_index: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.is_mtp_layer = is_mtp_layer
        self.is_swa = is_swa
        self.k_channels = k_channels if k_channels is not None else config.head_dim
        self.v_channels = v_channels if v_channels is not None else config.head_dim
        heads = num_attention_heads if num_attention_heads is not None else config.num_attention_heads
        kv_heads = num_key_value_heads if num_key_value_heads is not None else config.num_key_value_heads
        tp = 1  # minifleet has no tensor parallelism
        self.num_attention_heads_per_partition = heads // tp
        self.num_query_groups_per_partition = kv_heads // tp
        self.hidden_size_per_attention_head = self.k_channels
        self.hidden_size_per_partition = self.k_channels * heads // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.sliding_window = config.sliding_window if is_swa else None
        index = layer_number if layer_index is None else layer_index
        self.head_wise_swa_ratio = layer_head_wise_ratio(config, index) if is_swa else 0.0

        kind = config.softmax_type
        if (config.add_full_attention_sink_bias and not is_swa) or (
            config.add_swa_attention_sink_bias and is_swa
        ):
            kind = "learnable"
        if kind == "vanilla":
            self.softmax_offset = None
        elif kind == "off-by-one":
            self.softmax_offset = paddle.zeros([self.num_attention_heads_per_partition], dtype="float32")
        else:
            self.softmax_offset = self.create_parameter(
                [self.num_attention_heads_per_partition],
                dtype="float32",
                default_initializer=paddle.nn.initializer.Normal(0.0, 1.0),
            )

    def masked(
        self,
        b: int,
        q_len: int,
        k_len: int,
        num_kv_heads: int,
        attention_mask: paddle.Tensor | None,
        startend: paddle.Tensor | None,
        attn_mask_type: Any,
    ) -> tuple[paddle.Tensor | None, float]:
        """``(mask [b, 1 or Hkv, q, k] bool True = masked, or None; fill value)`` of one call."""
        if startend is not None:  # the FlashMask path
            if self.sliding_window is not None:
                left = window_left_size(self.sliding_window)
                startend = add_sliding_window(startend, left, self.head_wise_swa_ratio, num_kv_heads)
            return startend_masked(startend, q_len, attn_mask_type == AttnMaskType.causal), float("-inf")
        if self.is_swa:
            raise ValueError(
                f"layer {self.layer_number}: a sliding-window layer needs attn_mask_startend_row_indices "
                "(PaddleFleet's FlashMask path; its eager path refuses sliding layers)"
            )
        if attention_mask is not None:  # the eager path takes the given mask as it is
            mask = attention_mask
            if mask.dtype != paddle.bool:  # PaddleFormers' float masks: 1.0 attend, 0.0 masked
                mask = mask < 0.5
            return mask, EAGER_MASK_FILL
        if self.attn_mask_type == AttnMaskType.causal and q_len > 1:
            if q_len != k_len:
                raise ValueError(f"the causal mask is for self attention, got q_len={q_len}, k_len={k_len}")
            i = paddle.arange(q_len).unsqueeze(1)
            return (paddle.arange(k_len).unsqueeze(0) > i).reshape([1, 1, q_len, k_len]), EAGER_MASK_FILL
        return None, EAGER_MASK_FILL

    def forward(
        self,
        query: paddle.Tensor,
        key: paddle.Tensor,
        value: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        attn_mask_startend_row_indices: paddle.Tensor | None = None,
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
        """``query [b, s, Hq, Dqk]``, ``key [b, s, Hkv, Dqk]``, ``value [b, s, Hkv, Dv]`` -> ``[b, s, Hq*Dv]``

        ``Hkv`` is read from ``value.shape[2]`` (MLA hands every query head its
        own K/V while the module reports the config's kv heads).
        ``attn_mask_startend_row_indices [b, 1 or Hkv, s, cols]`` selects the
        FlashMask path, causal iff ``attn_mask_type == AttnMaskType.causal``;
        without it, ``attention_mask`` (bool, True = masked; or a float 1/0
        mask) replaces the default causal mask.
        """
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by DotProductAttention")
        b, q_len, hq, _ = query.shape
        k_len, hkv = key.shape[1], value.shape[2]
        group = hq // hkv
        mask, fill = self.masked(
            b, q_len, k_len, hkv, attention_mask, attn_mask_startend_row_indices, attn_mask_type
        )
        k = paddle.repeat_interleave(key, group, axis=2) if group > 1 else key
        v = paddle.repeat_interleave(value, group, axis=2) if group > 1 else value
        q32 = query.astype("float32").transpose([0, 2, 1, 3])  # [b, Hq, s, D]
        k32 = k.astype("float32").transpose([0, 2, 3, 1])  # [b, Hq, D, s]
        scores = paddle.matmul(q32, k32) * self.softmax_scale  # [b, Hq, s, s]
        visible_any = None
        if mask is not None:
            if mask.ndim == 4 and mask.shape[1] not in (1, hq):  # per kv head -> per query head
                mask = paddle.repeat_interleave(mask.astype("int32"), group, axis=1)
            mask = mask.astype("bool").expand(scores.shape)
            scores = paddle.where(mask, paddle.full_like(scores, fill), scores)
            visible_any = paddle.logical_not(mask).any(axis=-1, keepdim=True)  # [b, Hq, s, 1]
        if self.softmax_offset is not None:
            sink = self.softmax_offset.astype("float32").reshape([1, hq, 1, 1]).expand([b, hq, q_len, 1])
            probs = F.softmax(paddle.concat([scores, sink], axis=-1), axis=-1)[..., :-1]
        else:
            probs = F.softmax(scores, axis=-1)
        if visible_any is not None and fill == float("-inf"):  # FlashMask: a row with no key gives zeros
            probs = paddle.where(visible_any.expand(probs.shape), probs, paddle.zeros_like(probs))
        out = paddle.matmul(probs, v.astype("float32").transpose([0, 2, 1, 3]))  # [b, Hq, s, Dv]
        return out.transpose([0, 2, 1, 3]).reshape([b, q_len, -1]).astype(query.dtype)


def _layer_shape(config: MiniFleetConfig, is_swa: bool) -> tuple[int, int, int, int, float]:
    """(q heads, kv heads, qk head dim, v head dim, rope theta) of a layer kind."""
    c = config
    if is_swa:
        return (
            c.swa_num_attention_heads,
            c.swa_num_key_value_heads,
            c.swa_head_dim,
            c.swa_v_head_dim,
            c.swa_rope_theta,
        )
    return c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.v_head_dim, c.rope_theta


class SelfAttention(paddle.nn.Layer):
    """GQA self attention: fused QKV projection, RoPE, core attention, optional output gate.

    ``layer_number`` is PaddleFleet's 0-based number (empty head layers
    counted; an MTP layer's own index); ``layer_index`` is the plan's layer
    index (decoder layers 0.., MTP layers after them); ``is_swa`` comes from
    :func:`~.config.is_window_layer`. Sliding layers use the ``swa_*`` heads,
    dims and rope theta.
    """

    def __init__(
        self,
        config: MiniFleetConfig,
        layer_index: int,
        is_swa: bool,
        layer_number: int | None = None,
        is_mtp_layer: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_index if layer_number is None else layer_number
        self.attn_mask_type = AttnMaskType.causal
        self.is_swa = is_swa
        self.is_mtp_layer = is_mtp_layer
        hq, hkv, d, dv, theta = _layer_shape(config, is_swa)
        self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim = hq, hkv, d, dv
        self.rope_theta = theta
        h = config.hidden_size
        self.qkv_proj = paddle.nn.Linear(h, hq * d + hkv * d + hkv * dv, bias_attr=False)
        self.gate_proj = paddle.nn.Linear(h, hq * dv, bias_attr=False) if config.gated_attention else None
        self.core_attention = DotProductAttention(
            config,
            self.layer_number,
            self.attn_mask_type,
            "self",
            is_mtp_layer=is_mtp_layer,
            is_swa=is_swa,
            softmax_scale=config.softmax_scale,
            k_channels=d,
            v_channels=dv,
            num_attention_heads=hq,
            num_key_value_heads=hkv,
            layer_index=layer_index,
        )
        self.o_proj = paddle.nn.Linear(hq * dv, h, bias_attr=False)

    def forward(
        self,
        hidden_states: paddle.Tensor,
        position_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        attn_mask_startend_row_indices: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``hidden_states [b, s, h]``, ``position_ids [b, s]`` -> ``[b, s, h]``."""
        b, s, _ = hidden_states.shape
        hq, hkv, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        q, k, v = paddle.split(self.qkv_proj(hidden_states), [hq * d, hkv * d, hkv * dv], axis=-1)
        q = rotate_half_rope(q.reshape([b, s, hq, d]), position_ids, self.rope_theta)
        k = rotate_half_rope(k.reshape([b, s, hkv, d]), position_ids, self.rope_theta)
        v = v.reshape([b, s, hkv, dv])
        # PaddleFleet passes the first five positionally and the rest by keyword
        out = self.core_attention(
            q,
            k,
            v,
            attention_mask,
            attn_mask_startend_row_indices,
            attn_mask_type=self.attn_mask_type,
            attention_bias=None,
            packed_seq_params=None,
        )
        if self.gate_proj is not None:
            out = out * F.sigmoid(self.gate_proj(hidden_states))
        return self.o_proj(out)


def mla_softmax_scale(config: MiniFleetConfig) -> float:
    """PaddleFleet's MLA scale: ``mscale ** 2 / sqrt(qk_nope + qk_rope)`` with
    ``mscale = 0.1 * mscale_all_dim * ln(rotary_scaling_factor) + 1`` (1 when the factor is <= 1);
    ``softmax_scale`` is not read (``transformer/multi_latent_attention.py``)."""
    factor = float(getattr(config, "rotary_scaling_factor", None) or 1.0)
    mscale_all_dim = float(getattr(config, "mscale_all_dim", None) or 0.0)
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1.0 else 1.0
    return mscale * mscale / math.sqrt(config.qk_nope_head_dim + config.qk_rope_head_dim)


class MLASelfAttention(paddle.nn.Layer):
    """DeepSeek-style multi-head latent attention (no weight absorption).

    q/k head dim = ``qk_nope_head_dim + qk_rope_head_dim``, v head dim =
    ``v_head_dim``; K/V carry every query head. As in PaddleFleet, the core
    attention is built without ``is_swa`` (MLA layers never slide) and without
    ``num_key_value_heads``, so it reports the config's kv head count while
    K/V have one head per query head; its scale is :func:`mla_softmax_scale`.
    """

    def __init__(
        self,
        config: MiniFleetConfig,
        layer_index: int,
        is_swa: bool = False,
        layer_number: int | None = None,
        is_mtp_layer: bool = False,
    ) -> None:
        super().__init__()
        c = config
        self.config = config
        self.layer_number = layer_index if layer_number is None else layer_number
        self.attn_mask_type = AttnMaskType.causal
        self.is_swa = False  # PaddleFleet's MLA core attention gets no is_swa
        self.is_mtp_layer = is_mtp_layer
        self.num_heads = c.num_attention_heads
        self.nope, self.rope, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rope_theta = c.rope_theta
        h, hq, qk = c.hidden_size, self.num_heads, self.nope + self.rope
        if c.q_lora_rank:
            self.q_a_proj = paddle.nn.Linear(h, c.q_lora_rank, bias_attr=False)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.layernorm_epsilon)
            self.q_b_proj = paddle.nn.Linear(c.q_lora_rank, hq * qk, bias_attr=False)
        else:
            self.q_proj = paddle.nn.Linear(h, hq * qk, bias_attr=False)
        self.kv_a_proj = paddle.nn.Linear(h, c.kv_lora_rank + self.rope, bias_attr=False)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.layernorm_epsilon)
        self.kv_b_proj = paddle.nn.Linear(c.kv_lora_rank, hq * (self.nope + self.v_head_dim), bias_attr=False)
        self.core_attention = DotProductAttention(
            config,
            self.layer_number,
            self.attn_mask_type,
            "self",
            softmax_scale=mla_softmax_scale(c),
            k_channels=qk,
            v_channels=self.v_head_dim,
            layer_index=layer_index,
        )
        self.o_proj = paddle.nn.Linear(hq * self.v_head_dim, h, bias_attr=False)

    def forward(
        self,
        hidden_states: paddle.Tensor,
        position_ids: paddle.Tensor,
        attention_mask: paddle.Tensor | None = None,
        attn_mask_startend_row_indices: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``hidden_states [b, s, h]``, ``position_ids [b, s]`` -> ``[b, s, h]``."""
        b, s, _ = hidden_states.shape
        hq, nope, rope, dv = self.num_heads, self.nope, self.rope, self.v_head_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(hidden_states)))
        q = q.reshape([b, s, hq, nope + rope])
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        latent, k_pe = paddle.split(self.kv_a_proj(hidden_states), [self.config.kv_lora_rank, rope], axis=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).reshape([b, s, hq, nope + dv])
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_pe = rotate_half_rope(q_pe, position_ids, self.rope_theta)
        k_pe = rotate_half_rope(k_pe.reshape([b, s, 1, rope]), position_ids, self.rope_theta)
        q = paddle.concat([q_nope, q_pe], axis=-1)
        k = paddle.concat([k_nope, k_pe.expand([b, s, hq, rope])], axis=-1)
        out = self.core_attention(
            q, k, v, attention_mask, attn_mask_startend_row_indices, attn_mask_type=self.attn_mask_type
        )
        return self.o_proj(out)
