"""minifleet: a small paddle re-implementation of PaddleFleet's GPT layer structure.

The embedded default model of ``fdfleet verify`` and the test host while
``paddlefleet`` cannot be installed. Its core attention is plain dense eager
attention on PaddleFleet's two paths (FlashMask start/end rows, or the eager
causal mask); masks, sinks and head counts come from the raw config fields
(never from ``plan``), so comparing it with the patched paged path checks the
plan too. Where it still differs from PaddleFleet's real classes: docs/semantics.md.
"""

from __future__ import annotations

from .attention import (
    AttnMaskType,
    DotProductAttention,
    MLASelfAttention,
    SelfAttention,
    causal_startend_row_indices,
)
from .config import MiniFleetConfig, make_config
from .layers import GPTEmbedding, GPTLMHead, MultiTokenPredictionLayer, SwiGLUMLP, TransformerLayer
from .model import GPTModel, build_minifleet, init_weights

__all__ = [
    "AttnMaskType",
    "DotProductAttention",
    "GPTEmbedding",
    "GPTLMHead",
    "GPTModel",
    "MLASelfAttention",
    "MiniFleetConfig",
    "MultiTokenPredictionLayer",
    "SelfAttention",
    "SwiGLUMLP",
    "TransformerLayer",
    "build_minifleet",
    "causal_startend_row_indices",
    "init_weights",
    "make_config",
]
