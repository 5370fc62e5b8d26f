"""The per-model step context: what one forward step's attention needs.

FastDeploy hands batch metadata and caches to the model per step; PaddleFleet's
core attention signature has no place for them. The model (or the runner)
enters a :class:`StepContext` on the model's :class:`StepContextHolder` for
the duration of one forward, and every adapter of that model reads it from
the holder it was given at patch time (no module globals, so two models in
one process never see each other's steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..backends.base import BatchMeta


@dataclass
class StepContext:
    """One step's attention inputs.

    * ``meta``: the batch metadata (FastDeploy ForwardMeta names)
    * ``kv_caches``: per layer index, ``(key_cache, value_cache)`` in
      FastDeploy's layout ``[num_blocks, Hkv_l, block_size, D_l]``: under FastDeploy,
      strided views of its one cache shape for every layer (``serving/cache_views.py``)
    * ``positions``: ``[T]`` int, each packed token's absolute position
      (``seq_lens_decoder[b] + offset in this step's chunk``)
    """

    meta: BatchMeta
    kv_caches: Sequence[tuple[Any, Any]]
    positions: Any = None


class StepContextHolder:
    """Holds the active :class:`StepContext` of one model."""

    def __init__(self) -> None:
        self._ctx: StepContext | None = None

    @property
    def active(self) -> bool:
        return self._ctx is not None

    def get(self) -> StepContext:
        """The active context; ``ValueError`` when no step is running."""
        if self._ctx is None:
            raise ValueError(
                "no step context: the patched attention was called outside a forward step "
                "(enter `holder.step(StepContext(meta, kv_caches))` before running the model)"
            )
        return self._ctx

    @contextlib.contextmanager
    def step(self, ctx: StepContext) -> Iterator[StepContext]:
        """Make ``ctx`` active for the ``with`` block (not re-entrant)."""
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        if self._ctx is not None:
            raise ValueError("a step context is already active on this model")
        self._ctx = ctx
        try:
            yield ctx
        finally:
            self._ctx = None
