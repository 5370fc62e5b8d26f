"""minifleet: a small paddle re-implementation of PaddleFleet's GPT layer structure.

The embedded default model of ``fdfleet verify`` and the test host while
``paddlefleet`` cannot be installed. Its core attention is plain dense eager
attention whose masks, sinks and head counts come from the raw config fields
(never from ``spec``), so comparing it with the patched paged path checks the
plan too.
"""

from __future__ import annotations

from .attention import DotProductAttention, MLASelfAttention, SelfAttention
from .config import MiniFleetConfig, make_config
from .layers import GPTEmbedding, GPTLMHead, SwiGLUMLP, TransformerLayer
from .model import GPTModel, build_minifleet, init_weights

__all__ = [
    "DotProductAttention",
    "GPTEmbedding",
    "GPTLMHead",
    "GPTModel",
    "MLASelfAttention",
    "MiniFleetConfig",
    "SelfAttention",
    "SwiGLUMLP",
    "TransformerLayer",
    "build_minifleet",
    "init_weights",
    "make_config",
]
