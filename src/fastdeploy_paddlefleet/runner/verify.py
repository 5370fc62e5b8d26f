"""The verify driver: one model, two attention paths, same requests, compare logits.

Generic over hosts: a host (minifleet, a PaddleFormers model, ...) builds a
:class:`VerifyCase` with two callables — the model's own eager attention over a
full sequence, and the patched paged path over a packed batch — and
:func:`run_verify` drives both the way FastDeploy's worker would (chunked
prefill, mixed prefill/decode batches, greedy decoding from the paged path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..adapter.context import StepContextHolder
from ..patch.report import PatchReport
from ..spec.layer import AttentionPlan

logger = logging.getLogger(__name__)


@dataclass
class VerifyCase:
    """One host model ready to verify.

    * ``native_logits(ids)``: ids ``[1, L]`` int64 -> logits ``[1, L, vocab]``;
      the host model's own eager attention, no cache, full sequence.
    * ``paged_logits(ids, positions)``: ids ``[T]``, positions ``[T]`` int64 ->
      logits ``[T, vocab]``; the patched model, called by the driver inside
      ``holder.step(ctx)``.
    """

    name: str
    plan: AttentionPlan
    holder: StepContextHolder
    patch_report: PatchReport
    vocab_size: int
    native_logits: Callable[[Any], Any]
    paged_logits: Callable[[Any, Any], Any]
    #: free-form facts shown in the report (e.g. the config path, notes on host bugs neutralised)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepRecord:
    """What one paged step did and how it compared with the native path."""

    step: int
    num_tokens: int
    num_prefill: int
    num_decode: int
    max_abs_logit_diff: float
    greedy_matches: int
    greedy_total: int
    blocks_used: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class VerifyReport:
    """The outcome of :func:`run_verify`; ``to_dict()`` is ``fdfleet verify --json``."""

    name: str
    backend: str
    tolerance: float
    layers_patched: int
    layers_skipped: int
    steps: list[StepRecord] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def max_abs_logit_diff(self) -> float:
        return max((s.max_abs_logit_diff for s in self.steps), default=0.0)

    @property
    def greedy_agreement(self) -> float:
        total = sum(s.greedy_total for s in self.steps)
        return 1.0 if total == 0 else sum(s.greedy_matches for s in self.steps) / total

    @property
    def passed(self) -> bool:
        return bool(self.steps) and self.max_abs_logit_diff <= self.tolerance and self.greedy_agreement == 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "name": self.name,
            "backend": self.backend,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "greedy_agreement": self.greedy_agreement,
            "tolerance": self.tolerance,
            "steps": len(self.steps),
            "layers_patched": self.layers_patched,
            "layers_skipped": self.layers_skipped,
            "max_blocks_used": max((s.blocks_used for s in self.steps), default=0),
            "seconds": self.seconds,
            "requests": self.requests,
            "per_step": [s.to_dict() for s in self.steps],
            **({"extras": self.extras} if self.extras else {}),
        }


def run_verify(
    case: VerifyCase,
    *,
    prompt_lens: tuple[int, ...] = (19, 11, 26),
    decode_steps: int = 8,
    chunk_size: int = 8,
    block_size: int = 4,
    seed: int = 0,
    tolerance: float = 1e-4,
    progress: bool = True,
) -> VerifyReport:
    """Run ``case`` through both paths and compare; see the module doc."""
    raise NotImplementedError  # filled in below (driver lands in the next commit)
