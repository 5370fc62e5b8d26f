"""``fdfleet verify --kv-cache-quant``: the quantization error of the whole paged path.

The verify driver (``runner.verify``) runs its schedule twice on the same block tables and tokens:
first on the unquantized (float32) cache, the run compared with the host model's own attention, then
on a quantized cache (:func:`~fastdeploy_paddlefleet.runner.batch.allocate_quantized_kv_caches`),
fed the first run's tokens (its greedy picks: teacher-forced, so every position compares logits of
the same inputs). :class:`QuantComparison` accumulates, over every position both runs produced logits
for, the top-1 agreement (argmax equal), the max and mean absolute logit error, and the same
agreement over the positions a next token is picked from.

Static formats (``float8_e4m3fn``, ``int8``) need checkpoint scales; verify has none, so
:class:`KVCalibration` derives them from the unquantized run itself: ``max |K|`` (``|V|``) per kv head
(per channel for ``int8`` and per-channel fp8) over every value written, divided by the format's
bound. That calibration is in-sample (the same prompts), an optimistic figure for those formats.

Pass / fail (:meth:`QuantComparison.passed`): the quantized path is *broken*, not merely lossy, when a
quantized logit is non-finite, when top-1 agreement falls below ``min_top1_agreement`` (default
:data:`MIN_TOP1_AGREEMENT`), or when the mean absolute logit error exceeds ``max_mean_rel_error``
(default :data:`MAX_MEAN_REL_ERROR`) of the unquantized logits' mean magnitude. The formats give 92-100 %
agreement and a mean error of 0.3-8 % of the mean |logit| on the embedded presets and the
PaddleFormers models (``docs/kv_quant.md``, "Accuracy"); a dequant scale off by 25 % already gives
under 70 % agreement and 22-40 % mean error, a factor of 2 agreement near chance. The max logit
error is reported but not bounded: on deepseek_v3 one position's error reaches a third of the
largest logit (quantization alone: a run on a cache quantized by an independent numpy transcription
gives the same logits) while 92 % of the positions agree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..kvcache.quant import KVCacheQuant
from ..plan.layer import AttentionPlan, LayerAttention

logger = logging.getLogger(__name__)

#: default floor of the top-1 agreement (random-weight logits are near-ties at some positions)
MIN_TOP1_AGREEMENT = 0.8
#: default ceiling of mean |quantized - unquantized logit| / mean |unquantized logit|
MAX_MEAN_REL_ERROR = 0.15


class KVCalibration:
    """Static scales from an unquantized run: per layer, ``max |x|`` over every K / V value written.

    :meth:`observe` after each step (values written are still in the cache then, whatever reuses
    their block later); :meth:`scales` turns each ``amax`` into the checkpoint scale a calibration
    tool would store (``s = amax``, ``[Hkv]`` per kv head, ``[Hkv * D]`` per channel; a head or channel
    never above 0 gets ``s = 1``: its values quantize to 0 whatever the scale) and loads it as a
    served checkpoint's is (:class:`~fastdeploy_paddlefleet.serving.kv_scales.StaticKVScales`), so the
    quantized run writes with FastDeploy's quant multiplier ``T(max_bound / s)``, not ``1 / dequant``.
    """

    def __init__(self, plan: AttentionPlan | Iterable[LayerAttention]):
        self.layers = tuple(plan.layers if isinstance(plan, AttentionPlan) else plan)
        #: layer index -> (key amax [Hkv, Dqk], value amax [Hkv, Dv]) numpy float64
        self.amax: dict[int, list[Any]] = {}

    def observe(self, caches: Any) -> None:
        """Fold in the values of ``caches`` (per layer ``(key [NB, Hkv, BS, D], value [...])``, the
        unquantized caches; NaN slots, released or never written, are ignored)."""
        import numpy as np

        for layer in self.layers:
            pair = caches[layer.index]
            now = []
            for t in pair[:2]:
                x = np.abs(t.astype("float32").numpy().astype("float64"))
                x = np.where(np.isfinite(x), x, 0.0)  # NaN poison / never-written slots
                now.append(x.max(axis=(0, 2)))  # [Hkv, D]
            old = self.amax.get(layer.index)
            self.amax[layer.index] = (
                now if old is None else [np.maximum(a, b) for a, b in zip(old, now, strict=True)]
            )

    def scales(self, fmt: KVCacheQuant) -> Any:
        """A :class:`~fastdeploy_paddlefleet.serving.kv_scales.StaticKVScales` for ``fmt``: ``{layer index:
        (key, value)}`` float32 dequant multipliers ``s / max_bound``, with the quant multipliers
        ``max_bound / s`` in its ``quant_multipliers(index)``."""
        import numpy as np

        from ..serving.kv_scales import K_SUFFIX, V_SUFFIX, StaticKVScales

        if fmt.dynamic:
            raise ValueError(f"kv_cache_quant_type={fmt.name!r} is dynamic: it needs no static scales")
        prefixes = {layer.index: f"calibration.layers.{layer.index}" for layer in self.layers}
        out = StaticKVScales(prefixes, fmt)
        for layer in self.layers:
            if layer.index not in self.amax:
                raise ValueError(
                    f"layer {layer.index}: no values observed to calibrate {fmt.name} scales from"
                )
            for suffix, amax in zip((K_SUFFIX, V_SUFFIX), self.amax[layer.index], strict=True):
                a = amax.reshape(-1) if fmt.channel_wise else amax.max(axis=-1)
                s = np.where(a > 0, a, 1.0).astype("float32")
                out.take({f"{prefixes[layer.index]}.{suffix}": s})
        out.finish(self.layers, "float32")
        return out


@dataclass
class QuantComparison:
    """Quantized against unquantized logits over every compared position; ``to_dict()`` is the
    ``kv_cache_quant`` object of ``fdfleet verify --json``."""

    kv_cache_quant: str
    #: the unquantized cache's dtype (what the quantized run is compared with)
    reference_dtype: str = "float32"
    #: how a static format's scales were found (None for a dynamic format)
    calibration: str | None = None
    min_top1_agreement: float = MIN_TOP1_AGREEMENT
    max_mean_rel_error: float = MAX_MEAN_REL_ERROR
    positions: int = 0
    top1_matches: int = 0
    greedy_positions: int = 0
    greedy_matches: int = 0
    nonfinite_positions: int = 0
    max_abs_logit_error: float = 0.0
    sum_abs_logit_error: float = 0.0
    elements: int = 0
    max_abs_logit: float = 0.0
    sum_abs_logit: float = 0.0
    #: positions whose argmax differs: (step, row, unquantized top-1, quantized top-1, top-1 margin)
    mismatches: list[tuple[int, int, int, int, float]] = field(default_factory=list)

    def add(self, step: int, ref: Any, got: Any, greedy: Any) -> tuple[float, int]:
        """Fold in one step: ``ref`` / ``got`` logits ``[N, vocab]`` (numpy float32; unquantized,
        quantized), ``greedy`` bool ``[N]`` (rows a next token is picked from). Returns the step's
        max abs error (``inf`` when a quantized logit is non-finite) and top-1 matches."""
        import numpy as np

        ref = np.asarray(ref, dtype="float64")
        got = np.asarray(got, dtype="float64")
        if ref.shape != got.shape or ref.ndim != 2:
            raise ValueError(f"logits must be two equal [N, vocab] arrays, got {ref.shape} and {got.shape}")
        finite = np.isfinite(got).all(axis=1)
        diff = np.abs(got - ref)
        a_ref, a_got = ref.argmax(axis=1), np.where(finite, got.argmax(axis=1), -1)
        match = (a_ref == a_got) & finite
        greedy = np.asarray(greedy, dtype=bool)
        self.positions += int(ref.shape[0])
        self.top1_matches += int(match.sum())
        self.greedy_positions += int(greedy.sum())
        self.greedy_matches += int((match & greedy).sum())
        self.nonfinite_positions += int((~finite).sum())
        self.max_abs_logit = max(self.max_abs_logit, float(np.abs(ref).max(initial=0.0)))
        self.sum_abs_logit += float(np.abs(ref[finite]).sum())
        step_max = float(diff[finite].max(initial=0.0)) if finite.all() else float("inf")
        self.max_abs_logit_error = max(self.max_abs_logit_error, step_max)
        self.sum_abs_logit_error += float(diff[finite].sum())
        self.elements += int(diff[finite].size)
        top2 = np.sort(ref, axis=1)[:, -2:] if ref.shape[1] > 1 else np.zeros((ref.shape[0], 2))
        for row in np.flatnonzero(~match)[: max(0, 20 - len(self.mismatches))]:
            margin = float(top2[row, 1] - top2[row, 0])
            self.mismatches.append((step, int(row), int(a_ref[row]), int(a_got[row]), margin))
        return step_max, int(match.sum())

    @property
    def top1_agreement(self) -> float:
        return 1.0 if self.positions == 0 else self.top1_matches / self.positions

    @property
    def greedy_top1_agreement(self) -> float:
        return 1.0 if self.greedy_positions == 0 else self.greedy_matches / self.greedy_positions

    @property
    def mean_abs_logit_error(self) -> float:
        return 0.0 if self.elements == 0 else self.sum_abs_logit_error / self.elements

    @property
    def mean_abs_logit(self) -> float:
        return 0.0 if self.elements == 0 else self.sum_abs_logit / self.elements

    @property
    def rel_logit_error(self) -> float:
        """Max abs logit error over the unquantized logits' largest magnitude (reported, not bounded)."""
        return (
            self.max_abs_logit_error / self.max_abs_logit
            if self.max_abs_logit > 0
            else self.max_abs_logit_error
        )

    @property
    def mean_rel_error(self) -> float:
        """Mean abs logit error over the unquantized logits' mean magnitude (finite positions)."""
        m = self.mean_abs_logit
        return self.mean_abs_logit_error / m if m > 0 else self.mean_abs_logit_error

    @property
    def failures(self) -> list[str]:
        """Why the quantized path counts as broken (empty: it passed)."""
        out = []
        if self.positions == 0:
            out.append("no positions compared")
        if self.nonfinite_positions:
            out.append(f"{self.nonfinite_positions} positions with non-finite quantized logits")
        if self.top1_agreement < self.min_top1_agreement:
            out.append(f"top-1 agreement {self.top1_agreement:.3f} < {self.min_top1_agreement:g}")
        if not self.mean_rel_error <= self.max_mean_rel_error:
            out.append(
                f"mean logit error {self.mean_abs_logit_error:.3g} is {self.mean_rel_error:.3g} of the mean "
                f"|logit| {self.mean_abs_logit:.3g} (> {self.max_mean_rel_error:g})"
            )
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kv_cache_quant,
            "compared_with": f"the same paged run on a {self.reference_dtype} cache (same tokens)",
            "passed": self.passed,
            "positions": self.positions,
            "top1_agreement": self.top1_agreement,
            "greedy_positions": self.greedy_positions,
            "greedy_top1_agreement": self.greedy_top1_agreement,
            "max_abs_logit_error": self.max_abs_logit_error,
            "mean_abs_logit_error": self.mean_abs_logit_error,
            "max_abs_logit": self.max_abs_logit,
            "mean_abs_logit": self.mean_abs_logit,
            "rel_logit_error": self.rel_logit_error,
            "mean_rel_error": self.mean_rel_error,
            "nonfinite_positions": self.nonfinite_positions,
            "min_top1_agreement": self.min_top1_agreement,
            "max_mean_rel_error": self.max_mean_rel_error,
            "calibration": self.calibration,
            "failures": self.failures,
            "mismatches": [
                {"step": s, "row": r, "top1": a, "quantized_top1": b, "top1_margin": m}
                for s, r, a, b, m in self.mismatches
            ],
        }
