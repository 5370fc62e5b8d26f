"""The per-layer attention plan: plain data, stdlib only.

A ``LayerAttention`` says everything a backend needs to run one layer's
attention on one tensor-parallel rank. The canonical semantics (window
convention, sinks, head-wise split) are in ``docs/semantics.md``.
"""

from __future__ import annotations

import dataclasses
import numbers
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

    def __post_init__(self) -> None:
        """Refuse impossible layers (``TypeError`` / ``ValueError`` naming the field and value)."""
        where = f"LayerAttention(index={self.index!r})"

        def integer(name: str, value: Any, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where}.{name}={value!r}: expected an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{where}.{name}={value!r}: expected an int >= {low}")
            return value

        def head_range(name: str, value: Any, heads: int | None) -> None:
            """``(start, stop)`` ints, ``0 <= start <= stop`` (``<= heads`` for local ranges)."""
            if not isinstance(value, tuple) or len(value) != 2:
                raise TypeError(f"{where}.{name}={value!r}: expected a (start, stop) tuple")
            start, stop = (integer(name, v, 0) for v in value)
            limit = "" if heads is None else f" <= {heads}"
            if start > stop or (heads is not None and stop > heads):
                raise ValueError(f"{where}.{name}={value!r}: expected 0 <= start <= stop{limit}")

        integer("index", self.index, 0)
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"{where}.kind={self.kind!r}: expected one of {', '.join(LAYER_KINDS)}")
        hq = integer("num_q_heads", self.num_q_heads, 1)
        hkv = integer("num_kv_heads", self.num_kv_heads, 1)
        if hq % hkv:
            raise ValueError(f"{where}: num_q_heads={hq} is not a multiple of num_kv_heads={hkv}")
        integer("qk_head_dim", self.qk_head_dim, 1)
        integer("v_head_dim", self.v_head_dim, 1)
        for name in ("softmax_scale", "logits_soft_cap"):
            value = getattr(self, name)
            if value is None and name == "logits_soft_cap":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{where}.{name}={value!r}: expected a number, got {type(value).__name__}")
            if not 0 < value < float("inf"):
                raise ValueError(f"{where}.{name}={value!r}: expected a finite number > 0")
        if self.window_left is not None:
            integer("window_left", self.window_left, 0)
        if self.sliding_kv_heads is not None:
            head_range("sliding_kv_heads", self.sliding_kv_heads, hkv)
        if self.kind == "full":
            if self.sliding_kv_heads is not None:
                raise ValueError(
                    f"{where}: a full layer has no sliding_kv_heads, got {self.sliding_kv_heads!r}"
                )
        else:
            if self.window_left is None:
                raise ValueError(f"{where}: a {self.kind} layer needs window_left (an int >= 0), got None")
            if self.sliding_kv_heads is None:
                raise ValueError(f"{where}: a {self.kind} layer needs sliding_kv_heads (start, stop)")
        if self.sink not in SINK_KINDS:
            raise ValueError(f"{where}.sink={self.sink!r}: expected one of {', '.join(SINK_KINDS)}")
        if self.mla is not None and not isinstance(self.mla, MLADims):
            raise TypeError(f"{where}.mla={self.mla!r}: expected MLADims or None")
        head_range("q_head_range", self.q_head_range, None)  # global indices: no local bound
        head_range("kv_head_range", self.kv_head_range, None)

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
