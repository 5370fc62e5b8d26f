"""minifleet's pipeline layers: each takes a dict and returns a dict, as PaddleFleet's do.

The dict carries ``input_ids`` / ``hidden_states`` ``[b, s, h]``,
``position_ids [b, s]``, ``attention_mask``, ``attn_mask_startend_row_indices``;
the LM head adds ``logits [b, s, vocab]``.
"""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F

from .attention import MLASelfAttention, SelfAttention, default_position_ids
from .config import MiniFleetConfig, is_window_layer
from .norm import RMSNorm

Carry = dict[str, Any]

_INT_IDS = (paddle.int32, paddle.int64, paddle.int16, paddle.int8, paddle.uint8)


def check_input_ids(ids: Any, vocab_size: int, where: str = "input_ids") -> None:
    """Token ids are integers in ``[0, vocab_size)``, refused by name otherwise: a float tensor
    (``TypeError``; never truncated: 1.7 is no token), an id below 0 or at / past ``vocab_size``
    (``ValueError`` naming the position, the id and ``vocab_size``: paddle's CPU embedding reads
    memory before the table for -1). Values are read only where the host holds them (a CPU
    tensor): on a GPU that would be a sync in every step."""
    if not isinstance(ids, paddle.Tensor):
        raise TypeError(f"{where} must be a paddle Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in _INT_IDS:
        raise TypeError(f"{where} must hold integer token ids, got dtype {ids.dtype}")
    if not ids.place.is_cpu_place() or ids.size == 0:
        return
    a = ids.numpy()
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        first = tuple(int(c[0]) for c in bad.nonzero())
        raise ValueError(
            f"{where}[{', '.join(map(str, first))}] = {int(a[first])} is not a token id: expected an int "
            f"in [0, vocab_size={vocab_size})"
        )


class SwiGLUMLP(paddle.nn.Layer):
    """Dense ``down(silu(gate(x)) * up(x))`` with ``ffn_hidden_size`` inner width."""

    def __init__(self, config: MiniFleetConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.up_gate_proj = paddle.nn.Linear(h, 2 * f, bias_attr=False)
        self.down_proj = paddle.nn.Linear(f, h, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.chunk(self.up_gate_proj(x), 2, axis=-1)
        return self.down_proj(F.silu(gate) * up)


class GPTEmbedding(paddle.nn.Layer):
    """``input_ids [b, s]`` -> ``hidden_states [b, s, h]`` (fills default ``position_ids``)."""

    def __init__(self, config: MiniFleetConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.word_embeddings = paddle.nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, x: Carry) -> Carry:
        ids = x["input_ids"]
        check_input_ids(ids, self.vocab_size)
        out = dict(x)
        out["hidden_states"] = self.word_embeddings(ids)
        if out.get("position_ids") is None:
            out["position_ids"] = default_position_ids(ids.shape[0], ids.shape[1])
        return out


class TransformerLayer(paddle.nn.Layer):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``.

    ``layer_index`` is the plan's index (decoder layers ``0..N-1``, MTP layers
    ``N..``). ``layer_number`` follows PaddleFleet: a decoder layer's index plus
    ``num_empty_layers_add_in_head``, an MTP layer's own 0-based index; the
    sliding rule reads it back as PaddleFleet's ``Attention`` does.
    """

    def __init__(self, config: MiniFleetConfig, layer_index: int, is_mtp_layer: bool = False) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.is_mtp_layer = is_mtp_layer
        if is_mtp_layer:
            self.layer_number = layer_index - config.num_hidden_layers
            for_swa = self.layer_number + config.num_hidden_layers
        else:
            self.layer_number = layer_index + config.num_empty_layers_add_in_head
            for_swa = self.layer_number - config.num_empty_layers_add_in_head
        mla = bool(config.multi_latent_attention)
        is_swa = not mla and is_window_layer(config, for_swa)  # MLA core attention gets no is_swa
        attn_cls = MLASelfAttention if mla else SelfAttention
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attn = attn_cls(
            config, layer_index, is_swa, layer_number=self.layer_number, is_mtp_layer=is_mtp_layer
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        if int(config.num_experts or 0) > 0:
            from .moe import MoEMLP  # lazily: only MoE configs need it

            self.mlp = MoEMLP(config, layer_index)
        else:
            self.mlp = SwiGLUMLP(config)

    def forward(self, x: Carry) -> Carry:
        h = x["hidden_states"]
        h = h + self.self_attn(
            self.input_layernorm(h),
            x["position_ids"],
            x.get("attention_mask"),
            x.get("attn_mask_startend_row_indices"),
        )
        h = h + self.mlp(self.post_attention_layernorm(h))
        out = dict(x)
        out["hidden_states"] = h
        return out


class EmptyLayer(paddle.nn.Layer):
    """An empty pipeline layer (``num_empty_layers_add_in_head``): passes the dict through."""

    def forward(self, x: Carry) -> Carry:
        return x


class MultiTokenPredictionLayer(paddle.nn.Layer):
    """One MTP layer: ``eh_proj([norm(embed(ids)); norm(h)])`` through its own ``TransformerLayer``.

    Appends its output ``[b, s, h]`` to the dict's ``mtp_hidden_states``; the
    main ``hidden_states`` (and so the main logits) are untouched.
    """

    def __init__(self, config: MiniFleetConfig, mtp_index: int, embedding: GPTEmbedding) -> None:
        super().__init__()
        h = config.hidden_size
        self._embedding = [embedding]  # a list: the shared embedding is registered once, elsewhere
        self.mtp_index = mtp_index
        self.enorm = RMSNorm(h, config.layernorm_epsilon)
        self.hnorm = RMSNorm(h, config.layernorm_epsilon)
        self.eh_proj = paddle.nn.Linear(2 * h, h, bias_attr=False)
        self.transformer_layer = TransformerLayer(config, config.num_hidden_layers + mtp_index, True)

    def forward(self, x: Carry) -> Carry:
        embedding = self._embedding[0]
        check_input_ids(x["input_ids"], embedding.vocab_size, f"input_ids (MTP layer {self.mtp_index})")
        e = embedding.word_embeddings(x["input_ids"])
        mixed = self.eh_proj(paddle.concat([self.enorm(e), self.hnorm(x["hidden_states"])], axis=-1))
        inner = self.transformer_layer({**x, "hidden_states": mixed})
        out = dict(x)
        out["mtp_hidden_states"] = [*x.get("mtp_hidden_states", []), inner["hidden_states"]]
        return out


class FinalNorm(paddle.nn.Layer):
    def __init__(self, config: MiniFleetConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, x: Carry) -> Carry:
        out = dict(x)
        out["hidden_states"] = self.norm(x["hidden_states"])
        return out


class GPTLMHead(paddle.nn.Layer):
    """Adds ``logits [b, s, vocab]``; tied to the embedding when ``tie_word_embeddings``."""

    def __init__(self, config: MiniFleetConfig, embedding: GPTEmbedding) -> None:
        super().__init__()
        if config.tie_word_embeddings:
            self.weight = None
            self._tied = [embedding]  # a list, so the embedding is not registered twice
        else:
            self.weight = self.create_parameter([config.hidden_size, config.vocab_size], dtype="float32")
            self._tied = []

    def forward(self, x: Carry) -> Carry:
        h = x["hidden_states"]
        if self.weight is not None:
            logits = paddle.matmul(h, self.weight)
        else:
            logits = paddle.matmul(h, self._tied[0].word_embeddings.weight, transpose_y=True)
        out = dict(x)
        out["logits"] = logits
        return out
