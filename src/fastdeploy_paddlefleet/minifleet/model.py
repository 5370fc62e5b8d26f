"""minifleet's ``GPTModel`` and ``build_minifleet``."""

from __future__ import annotations

import os
import zlib

import paddle

from .attention import causal_startend_row_indices
from .config import MiniFleetConfig, make_config
from .layers import (
    EmptyLayer,
    FinalNorm,
    GPTEmbedding,
    GPTLMHead,
    MultiTokenPredictionLayer,
    TransformerLayer,
)


class _Decoder(paddle.nn.Layer):
    def __init__(self, config: MiniFleetConfig) -> None:
        super().__init__()
        self.layers = paddle.nn.LayerList(
            [TransformerLayer(config, i) for i in range(config.num_hidden_layers)]
        )


class GPTModel(paddle.nn.Layer):
    """Embedding, empty head layers, N x ``TransformerLayer``, final norm, MTP layers, LM head,
    run as PaddleFleet's pipeline does.

    ``run_function`` is the plain list of those layers (registered once, under
    ``embedding``, ``decoder.layers.<i>``, ``final_norm``, ``mtp.<k>``, ``lm_head``;
    the empty layers hold nothing); the forward passes one dict through it.
    """

    def __init__(self, config: MiniFleetConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = GPTEmbedding(config)
        self.decoder = _Decoder(config)
        self.final_norm = FinalNorm(config)
        self.mtp = paddle.nn.LayerList(
            [MultiTokenPredictionLayer(config, k, self.embedding) for k in range(config.mtp_num_layers)]
        )
        self.lm_head = GPTLMHead(config, self.embedding)
        head = [EmptyLayer() for _ in range(config.num_empty_layers_add_in_head)]
        self.run_function = [
            self.embedding,
            *head,
            *self.decoder.layers,
            self.final_norm,
            *self.mtp,
            self.lm_head,
        ]

    def forward(
        self,
        input_ids: paddle.Tensor,
        position_ids: paddle.Tensor | None = None,
        attention_mask: paddle.Tensor | None = None,
        attn_mask_startend_row_indices: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``input_ids [b, s]`` (``position_ids [b, s]``, default ``0..s-1``) -> logits ``[b, s, vocab]``.

        Without ``attention_mask`` and ``attn_mask_startend_row_indices``, it feeds
        causal start/end rows (one document per row), as PaddleFleet's data path
        does, so the FlashMask path (the one sliding layers need) runs.
        """
        if attention_mask is None and attn_mask_startend_row_indices is None:
            attn_mask_startend_row_indices = causal_startend_row_indices(*input_ids.shape)
        x = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "attn_mask_startend_row_indices": attn_mask_startend_row_indices,
        }
        for layer in self.run_function:
            x = layer(x)
        return x["logits"]


def init_weights(model: paddle.nn.Layer, seed: int = 0) -> None:
    """Deterministic random weights: each parameter's values depend only on ``seed`` and its name.

    (So a rank that owns a subset of a model's parameters, e.g. some experts,
    gets the same values as the single-process model.) Norm weights are near 1,
    sinks ~N(0, 1), matrices ~N(0, 1/fan_in), embeddings ~N(0, 1).
    """
    import numpy as np

    for name, p in model.named_parameters():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        shape = list(p.shape)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("softmax_offset") or "embedding" in name or len(shape) < 2:
            values = rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(shape[0])
        p.set_value(paddle.to_tensor(values.astype("float32")).astype(p.dtype))


#: the parameter dtypes a minifleet model is built in (an int8 model would embed and multiply in int8)
MODEL_DTYPES = ("float32", "float16", "bfloat16")


def build_minifleet(
    config: dict | str | os.PathLike | MiniFleetConfig, seed: int = 0, dtype: str = "float32"
) -> GPTModel:
    """A minifleet ``GPTModel`` in eval mode from a config dict, preset name or JSON path.

    Two builds with the same config and seed have identical weights.
    """
    name = str(dtype).rsplit(".", 1)[-1] if isinstance(dtype, str | paddle.dtype) else None
    if name not in MODEL_DTYPES:
        raise ValueError(
            f"dtype={dtype!r}: minifleet builds float models only, expected one of {', '.join(MODEL_DTYPES)}"
        )
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise TypeError(f"seed={seed!r}: expected an int")
    dtype = name
    model = GPTModel(make_config(config))
    init_weights(model, seed)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    return model
