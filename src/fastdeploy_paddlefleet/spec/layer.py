"""The per-layer attention plan: plain data, stdlib only.

A ``LayerAttention`` says everything a backend needs to run one layer's
attention on one tensor-parallel rank. The canonical semantics (window
convention, sinks, head-wise split) are in ``docs/semantics.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "headwise"]
SinkKind = Literal["vanilla", "off-by-one", "learnable"]
WindowConvention = Literal["hf", "paddlefleet-tuple", "paddlefleet-int", "none"]

LAYER_KINDS: tuple[str, ...] = ("full", "sliding", "headwise")
SINK_KINDS: tuple[str, ...] = ("vanilla", "off-by-one", "learnable")


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention dimensions (DeepSeek style)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention on one TP rank.

    Head counts are per rank. ``sliding_kv_heads`` is the half-open range
    ``(start, stop)`` of this rank's *local* kv heads that use the sliding
    window (``(0, num_kv_heads)`` for a ``sliding`` layer, ``None`` for a
    ``full`` layer). Query head ``h`` reads kv head ``h // group_size``.
    ``kv_head_range`` / ``q_head_range`` are the global head indices this
    rank holds (kv heads may be replicated when kv heads < tp_size); sinks are
    sliced with ``q_head_range``. ``logits_soft_cap`` caps the scaled scores
    (never the sink) before the softmax.
    """

    index: int
    kind: LayerKind
    num_q_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    softmax_scale: float
    window_left: int | None = None
    sliding_kv_heads: tuple[int, int] | None = None
    sink: SinkKind = "vanilla"
    mla: MLADims | None = None
    q_head_range: tuple[int, int] = (0, 0)
    kv_head_range: tuple[int, int] = (0, 0)
    #: attention logit soft-capping: scores ``s`` become ``cap * tanh(s / cap)`` before the softmax
    #: (HF ``attn_logit_softcapping``, FlashInfer ``logits_soft_cap``); None: no capping
    logits_soft_cap: float | None = None

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA group)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def has_window(self) -> bool:
        return self.kind != "full"

    def head_window(self, kv_head: int) -> int | None:
        """``window_left`` of local kv head ``kv_head`` (``None``: full attention)."""
        if self.sliding_kv_heads is None:
            return None
        start, stop = self.sliding_kv_heads
        return self.window_left if start <= kv_head < stop else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sliding_kv_heads"] = list(self.sliding_kv_heads) if self.sliding_kv_heads else None
        d["q_head_range"] = list(self.q_head_range)
        d["kv_head_range"] = list(self.kv_head_range)
        return d


@dataclass(frozen=True)
class AttentionPlan:
    """Every layer's ``LayerAttention`` for one rank, plus where it came from."""

    layers: tuple[LayerAttention, ...]
    convention: WindowConvention = "none"
    tp_size: int = 1
    tp_rank: int = 0
    source: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerAttention:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)
