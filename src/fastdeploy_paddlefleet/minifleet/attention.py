"""minifleet attention: ``SelfAttention``, ``MLASelfAttention`` and their ``DotProductAttention``.

``DotProductAttention`` mirrors PaddleFleet's core attention: same constructor
attributes, same call signature, inputs ``[b, s, heads, dim]`` with K/V not
repeated for GQA, output ``[b, s, heads * v_dim]``. Its forward is plain dense
eager attention with an explicit boolean mask; a sink is a score column
appended before the softmax and dropped after it, as PaddleFleet's eager path
does. Masks, sinks and head counts come from the raw config fields.
"""

from __future__ import annotations

import math
from typing import Any

import paddle
import paddle.nn.functional as F

from .config import MiniFleetConfig, layer_head_wise_ratio, window_left_of
from .norm import RMSNorm


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


class DotProductAttention(paddle.nn.Layer):
    """PaddleFleet's core attention, dense and eager.

    ``layer_number`` is 1-based here, as in older PaddleFleet: code that maps
    modules to layers must keep its own count.
    """

    def __init__(
        self,
        config: MiniFleetConfig,
        layer_number: int,
        attn_mask_type: str = "causal",
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
        self.is_mtp_layer = is_mtp_layer
        self.is_swa = is_swa
        self.k_channels = k_channels or config.head_dim
        self.v_channels = v_channels or config.head_dim
        heads = num_attention_heads or config.num_attention_heads
        kv_heads = num_key_value_heads or config.num_key_value_heads
        tp = 1  # minifleet has no tensor parallelism
        self.num_attention_heads_per_partition = heads // tp
        self.num_query_groups_per_partition = kv_heads // tp
        self.hidden_size_per_attention_head = self.k_channels
        self.hidden_size_per_partition = self.k_channels * heads // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.sliding_window = config.sliding_window if is_swa else None
        index = layer_number - 1 if layer_index is None else layer_index
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

    def kv_head_windows(self, num_kv_heads: int) -> list[int | None]:
        """Each kv head's left window (``None``: full), from the raw config fields."""
        left = window_left_of(self.sliding_window)
        if left is None:
            return [None] * num_kv_heads
        r = self.head_wise_swa_ratio
        n_slide = num_kv_heads if r == 0 else int(r * num_kv_heads)
        n_full = num_kv_heads - n_slide
        return [None] * n_full + [left] * n_slide

    def visible_mask(self, seq: int, num_kv_heads: int, group: int) -> paddle.Tensor:
        """``[heads, seq, seq]`` bool: query ``i`` of a head sees key ``j``."""
        i = paddle.arange(seq, dtype="int64").unsqueeze(1)
        j = paddle.arange(seq, dtype="int64").unsqueeze(0)
        masks = []
        for left in self.kv_head_windows(num_kv_heads):
            m = j <= i
            if left is not None:
                m = paddle.logical_and(m, i - j <= left)
            masks.extend([m] * group)
        return paddle.stack(masks, axis=0)

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

        ``attention_mask`` (optional, bool, broadcastable to ``[b, Hq, s, s]``)
        is True where a key is masked out, PaddleFleet's convention; it is
        combined with the causal / sliding-window mask.
        """
        b, s, hq, _ = query.shape
        hkv = key.shape[2]
        group = hq // hkv
        k = paddle.repeat_interleave(key, group, axis=2) if group > 1 else key
        v = paddle.repeat_interleave(value, group, axis=2) if group > 1 else value
        q32 = query.astype("float32").transpose([0, 2, 1, 3])  # [b, Hq, s, D]
        k32 = k.astype("float32").transpose([0, 2, 3, 1])  # [b, Hq, D, s]
        scores = paddle.matmul(q32, k32) * self.softmax_scale  # [b, Hq, s, s]
        visible = self.visible_mask(s, hkv, group).unsqueeze(0)
        if attention_mask is not None:
            visible = paddle.logical_and(visible, paddle.logical_not(attention_mask.astype("bool")))
        scores = paddle.where(visible, scores, paddle.full_like(scores, float("-inf")))
        if self.softmax_offset is not None:
            sink = self.softmax_offset.astype("float32").reshape([1, hq, 1, 1]).expand([b, hq, s, 1])
            probs = F.softmax(paddle.concat([scores, sink], axis=-1), axis=-1)[..., :-1]
        else:
            probs = F.softmax(scores, axis=-1)
        out = paddle.matmul(probs, v.astype("float32").transpose([0, 2, 1, 3]))  # [b, Hq, s, Dv]
        return out.transpose([0, 2, 1, 3]).reshape([b, s, -1]).astype(query.dtype)


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
    """GQA self attention: fused QKV projection, RoPE, core attention, optional output gate."""

    def __init__(self, config: MiniFleetConfig, layer_index: int, is_swa: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_index + 1
        self.is_swa = is_swa
        hq, hkv, d, dv, theta = _layer_shape(config, is_swa)
        self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim = hq, hkv, d, dv
        self.rope_theta = theta
        h = config.hidden_size
        self.qkv_proj = paddle.nn.Linear(h, hq * d + hkv * d + hkv * dv, bias_attr=False)
        self.gate_proj = paddle.nn.Linear(h, hq * dv, bias_attr=False) if config.gated_attention else None
        self.core_attention = DotProductAttention(
            config,
            self.layer_number,
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
            attn_mask_type="causal",
            packed_seq_params=None,
        )
        if self.gate_proj is not None:
            out = out * F.sigmoid(self.gate_proj(hidden_states))
        return self.o_proj(out)


class MLASelfAttention(paddle.nn.Layer):
    """DeepSeek-style multi-head latent attention (no weight absorption).

    q/k head dim = ``qk_nope_head_dim + qk_rope_head_dim``, v head dim =
    ``v_head_dim``; K/V carry every query head, so the core attention is built
    with kv heads = q heads.
    """

    def __init__(self, config: MiniFleetConfig, layer_index: int, is_swa: bool) -> None:
        super().__init__()
        c = config
        self.config = config
        self.layer_number = layer_index + 1
        self.is_swa = is_swa
        self.num_heads = c.num_attention_heads
        self.nope, self.rope, self.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rope_theta = c.swa_rope_theta if is_swa else c.rope_theta
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
            is_swa=is_swa,
            softmax_scale=c.softmax_scale,
            k_channels=qk,
            v_channels=self.v_head_dim,
            num_attention_heads=hq,
            num_key_value_heads=hq,
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
            q, k, v, attention_mask, attn_mask_startend_row_indices, attn_mask_type="causal"
        )
        return self.o_proj(out)
