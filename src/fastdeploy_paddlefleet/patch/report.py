"""What a patch pass did: the record every ``patch_*`` function returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PatchedLayer:
    """One attention module that now runs through an adapter."""

    name: str  # sublayer path, e.g. "decoder.layers.3.self_attn.core_attention"
    layer_index: int
    kind: str  # LayerAttention.kind
    sink: str  # LayerAttention.sink


@dataclass
class SkippedLayer:
    """A sublayer that was looked at and left alone, with the reason."""

    name: str
    reason: str


@dataclass
class PatchReport:
    """Result of patching one model with one backend."""

    backend: str
    patched: list[PatchedLayer] = field(default_factory=list)
    skipped: list[SkippedLayer] = field(default_factory=list)

    @property
    def num_patched(self) -> int:
        return len(self.patched)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "patched": [vars(p) for p in self.patched],
            "skipped": [vars(s) for s in self.skipped],
        }
