"""The verify driver: one model, two attention paths, same requests, compare logits.

Generic over hosts: a host (minifleet, a PaddleFleet model built through
PaddleFormers, a plain PaddleFormers model, ...) builds a :class:`VerifyCase`
with two callables — the model's own eager attention over a full sequence, and
the patched paged path over a packed batch — and :func:`run_verify` drives both
the way FastDeploy's worker would (chunked prefill, mixed prefill/decode
batches, greedy decoding from the paged path).

KV allocation: one block table per request (``runner.batch.PagedKVState``), or
with ``headwise_kv=True`` (``fdfleet verify --headwise-kv``,
``FDFLEET_HEADWISE_KV=1``) head-wise pages from the
:class:`~fastdeploy_paddlefleet.kvcache.headwise.HeadwiseKVManager` with
sliding-window recycling (``runner.headwise_state.HeadwiseKVState``): pages of
sliding heads are released as requests decode past their windows and filled
with NaN at once, and the caches start as NaN, so a read of a released or
never-written slot shows up as a NaN logit (an infinite difference).

Quantized KV cache (``kv_cache_quant``, ``fdfleet verify --kv-cache-quant``): after the run above,
the same schedule runs again on a quantized cache with the same block tables and tokens, and its
logits are compared with the unquantized run's (``runner.kv_quant_compare``: top-1 agreement, max
and mean logit error); the report's ``quant`` carries the figures and its verdict joins ``passed``.

Cases for PaddleFleet-shaped hosts (minifleet, PaddleFleet itself) are built
in ``runner.fleet_case``; PaddleFormers models in ``runner.paddleformers_case``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..adapter.context import StepContextHolder
from ..patch.report import PatchReport
from ..plan.layer import AttentionPlan

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
    #: the plan the KV caches are allocated from when it differs from ``plan`` (e.g. MLA values
    #: padded for a backend that needs equal dims: ``patch.cache_plan(plan, backend)``)
    cache_plan: AttentionPlan | None = None


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
    #: head-wise KV only: pages in use during the step, pages released right after it
    pages_used: int | None = None
    pages_released: int | None = None
    #: quantized KV cache only: max |quantized - unquantized logit| and top-1 matches of the step
    quant_max_abs_logit_error: float | None = None
    quant_top1_matches: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


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
    #: whether KV pages came from the head-wise manager with recycling
    headwise_kv: bool = False
    #: head-wise KV only: pages in the pools (all layer groups)
    pages_total: int | None = None
    #: quantized KV cache only: the comparison with the unquantized run (``runner.kv_quant_compare``)
    quant: Any = None
    #: per step, the unquantized paged logits ``[T, vocab]`` (numpy float32) and, with ``quant``, the
    #: quantized run's; kept for tests and tools, not in ``to_dict()``
    step_logits: list[Any] = field(default_factory=list, repr=False)
    quant_step_logits: list[Any] = field(default_factory=list, repr=False)

    @property
    def pages_released(self) -> int:
        return sum(s.pages_released or 0 for s in self.steps)

    @property
    def max_abs_logit_diff(self) -> float:
        return max((s.max_abs_logit_diff for s in self.steps), default=0.0)

    @property
    def greedy_agreement(self) -> float:
        total = sum(s.greedy_total for s in self.steps)
        return 1.0 if total == 0 else sum(s.greedy_matches for s in self.steps) / total

    @property
    def paged_passed(self) -> bool:
        """The unquantized paged run against the native attention: within tolerance, greedy agrees."""
        return bool(self.steps) and self.max_abs_logit_diff <= self.tolerance and self.greedy_agreement == 1.0

    @property
    def passed(self) -> bool:
        return self.paged_passed and (self.quant is None or self.quant.passed)

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
            "headwise_kv": self.headwise_kv,
            **(
                {
                    "pages_released": self.pages_released,
                    "max_pages_used": max((s.pages_used or 0 for s in self.steps), default=0),
                    "pages_total": self.pages_total,
                }
                if self.headwise_kv
                else {}
            ),
            "kv_cache_quant": None if self.quant is None else self.quant.to_dict(),
            "seconds": self.seconds,
            "requests": self.requests,
            "per_step": [s.to_dict() for s in self.steps],
            **({"extras": self.extras} if self.extras else {}),
        }


def default_prompt_lens(plan: AttentionPlan) -> tuple[int, ...]:
    """Three prompt lengths, all longer than every sliding window of ``plan``."""
    w = max((layer.window_left + 1 for layer in plan if layer.window_left is not None), default=8)
    return (w + 13, w + 5, w + 20)


@dataclass
class _Request:
    rid: int
    prompt_len: int
    arrival: int
    tokens: list[int]
    fed: int = 0  # tokens already run through the paged path

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_len


def schedule_steps(
    prompt_lens: tuple[int, ...], decode_steps: int, chunk_size: int, stagger: int = 1
) -> list[list[tuple[int, int]]]:
    """The batches, as ``[(request, new tokens), ...]`` per step.

    Request ``r`` arrives at step ``r * stagger``; it prefills in chunks of at
    most ``chunk_size`` tokens, then decodes one token per step for
    ``decode_steps`` steps. So early requests decode while later ones still
    prefill (mixed batches).
    """
    fed = [0] * len(prompt_lens)
    total = [n + decode_steps for n in prompt_lens]
    steps: list[list[tuple[int, int]]] = []
    step = 0
    while any(f < t for f, t in zip(fed, total, strict=True)):
        batch = []
        for r, n in enumerate(prompt_lens):
            if r * stagger > step or fed[r] >= total[r]:
                continue
            new = min(chunk_size, n - fed[r]) if fed[r] < n else 1
            batch.append((r, new))
            fed[r] += new
        steps.append(batch)
        step += 1
    return steps


def _check_args(prompt_lens, decode_steps, chunk_size, block_size, tolerance) -> None:
    if not prompt_lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in prompt_lens):
        raise ValueError(f"prompt_lens must be positive ints, got {prompt_lens!r}")
    for name, value, low in (("decode_steps", decode_steps, 0), ("chunk_size", chunk_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")


def run_verify(
    case: VerifyCase,
    *,
    prompt_lens: tuple[int, ...] | None = None,
    decode_steps: int = 8,
    chunk_size: int = 8,
    block_size: int = 4,
    seed: int = 0,
    tolerance: float = 1e-4,
    progress: bool = True,
    headwise_kv: bool = False,
    kv_cache_quant: Any = None,
    min_top1_agreement: float | None = None,
    max_mean_rel_error: float | None = None,
) -> VerifyReport:
    """Run ``case`` through both paths and compare; see the module doc.

    Prompts are random ids (from ``seed``) of ``prompt_lens`` tokens (default:
    :func:`default_prompt_lens`). Each step's packed batch runs through
    ``case.paged_logits`` on a shuffled paged KV cache; greedy decoding follows
    the paged path. Every position the paged path produced logits for is
    compared with ``case.native_logits`` over the request's whole sequence so
    far (a non-finite paged logit counts as an infinite difference); greedy
    agreement counts the positions a next token is picked from.

    ``headwise_kv``: allocate KV through the head-wise manager with recycling
    (see the module doc); the step records then carry ``pages_used`` /
    ``pages_released``.

    ``kv_cache_quant`` (a ``kv_cache_quant_type`` name or ``KVCacheQuant``; ``None``: off): run the
    schedule again on a quantized cache (see the module doc); a static format's scales are calibrated
    on the unquantized run (``runner.kv_quant_compare.KVCalibration``). ``min_top1_agreement`` /
    ``max_mean_rel_error``: that comparison's bounds (defaults in ``runner.kv_quant_compare``).
    """
    import numpy as np
    import paddle

    from ..adapter.context import StepContext
    from ..kvcache.quant import KVCacheQuant
    from ..kvcache.quant import kv_cache_quant as parse_quant
    from .batch import PagedKVState, allocate_kv_caches
    from .headwise_state import HeadwiseKVState
    from .kv_quant_compare import KVCalibration, QuantComparison

    fmt = kv_cache_quant if isinstance(kv_cache_quant, KVCacheQuant) else parse_quant(kv_cache_quant)
    prompt_lens = tuple(prompt_lens) if prompt_lens is not None else default_prompt_lens(case.plan)
    _check_args(prompt_lens, decode_steps, chunk_size, block_size, tolerance)
    windows = [layer.window_left for layer in case.plan if layer.window_left is not None]
    if windows and min(prompt_lens) <= max(windows) + 1:
        logger.warning(
            "prompt_lens %s do not all exceed the widest window (%d)", prompt_lens, max(windows) + 1
        )

    rng = np.random.default_rng(seed)
    requests = [
        _Request(r, n, r, [int(t) for t in rng.integers(0, case.vocab_size, size=n)])
        for r, n in enumerate(prompt_lens)
    ]
    steps = schedule_steps(prompt_lens, decode_steps, chunk_size)
    max_blocks = -(-(max(prompt_lens) + decode_steps) // block_size)
    num_blocks = sum(-(-(n + decode_steps) // block_size) for n in prompt_lens) + 4
    if headwise_kv:
        # NaN everywhere until written: a read of a never-written or released slot poisons the logits
        caches = allocate_kv_caches(case.cache_plan or case.plan, num_blocks, block_size, fill=float("nan"))
        state: Any = HeadwiseKVState(case.plan, num_blocks, block_size, max_blocks, caches=caches)
    else:
        state = PagedKVState(num_blocks, block_size, max_blocks, shuffle_seed=seed)
        caches = allocate_kv_caches(case.cache_plan or case.plan, num_blocks, block_size)

    report = VerifyReport(
        name=case.name,
        backend=case.patch_report.backend,
        tolerance=float(tolerance),
        layers_patched=case.patch_report.num_patched,
        layers_skipped=len(case.patch_report.skipped),
        extras=dict(case.extras),
        headwise_kv=bool(headwise_kv),
        pages_total=state.pages_total if headwise_kv else None,
    )
    cache_plan = case.cache_plan or case.plan
    calibration = None
    if fmt is not None:
        bounds = {}
        if min_top1_agreement is not None:
            bounds["min_top1_agreement"] = float(min_top1_agreement)
        if max_mean_rel_error is not None:
            bounds["max_mean_rel_error"] = float(max_mean_rel_error)
        report.quant = QuantComparison(fmt.name, **bounds)
        if not fmt.dynamic:
            calibration = KVCalibration(cache_plan)
            what = "channel" if fmt.channel_wise else "kv head"
            report.quant.calibration = (
                f"max |K|, |V| per {what} over the unquantized run of these prompts / {fmt.max_bound:g} "
                "(in-sample: optimistic)"
            )
    replay: list[tuple[Any, Any, Any, Any]] = []  # (meta, positions, ids, greedy rows) per step
    bar = progress_bar(len(steps) * (2 if fmt is not None else 1), case.name, enabled=progress)
    t_all = time.perf_counter()
    with paddle.no_grad():
        for i, batch in enumerate(steps):
            meta = state.schedule(batch)
            positions = state.positions(meta)
            ids = [t for r, n in batch for t in requests[r].tokens[requests[r].fed : requests[r].fed + n]]
            t0 = time.perf_counter()
            with case.holder.step(StepContext(meta, caches, positions)):
                logits = case.paged_logits(paddle.to_tensor(ids, dtype="int64"), positions)
            seconds = time.perf_counter() - t0
            logits = logits.astype("float32").numpy()
            report.step_logits.append(logits)
            if calibration is not None:
                calibration.observe(caches)  # before recycling poisons released pages
            greedy_rows = np.zeros(len(ids), dtype=bool)
            blocks_used = state.blocks_used  # before this step's pages are released
            pages_used = state.pages_used if headwise_kv else None
            released = state.recycle([r for r, _ in batch]) if headwise_kv else None
            record = StepRecord(
                step=i,
                num_tokens=len(ids),
                num_prefill=sum(1 for r, _ in batch if requests[r].prefilling),
                num_decode=sum(1 for r, _ in batch if not requests[r].prefilling),
                max_abs_logit_diff=0.0,
                greedy_matches=0,
                greedy_total=0,
                blocks_used=blocks_used,
                seconds=seconds,
                pages_used=pages_used,
                pages_released=released,
            )
            row = 0
            for r, n in batch:
                req = requests[r]
                end = req.fed + n
                native = case.native_logits(paddle.to_tensor([req.tokens[:end]], dtype="int64"))
                native = native.astype("float32").numpy()[0, req.fed : end]
                paged = logits[row : row + n]
                diff = np.abs(paged - native)
                # NaN (a released or unwritten page was read) must fail, and max() drops NaN
                diff = float(diff.max()) if np.isfinite(diff).all() else float("inf")
                record.max_abs_logit_diff = max(record.max_abs_logit_diff, diff)
                if end >= req.prompt_len:  # the last token picks the next one
                    greedy_rows[row + n - 1] = True
                    nxt = int(paged[-1].argmax())
                    record.greedy_total += 1
                    record.greedy_matches += int(nxt == int(native[-1].argmax()))
                    if end == len(req.tokens):
                        req.tokens.append(nxt)
                req.fed = end
                row += n
                if req.fed == req.prompt_len + decode_steps:
                    state.release(r)
            report.steps.append(record)
            if fmt is not None:
                replay.append((meta, positions, ids, greedy_rows))
            bar.update(1)
            bar.set_postfix(diff=f"{report.max_abs_logit_diff:.1e}", greedy=f"{report.greedy_agreement:.0%}")
        if fmt is not None:
            _run_quantized(case, report, replay, fmt, cache_plan, num_blocks, block_size, calibration, bar)
    bar.close()
    report.seconds = time.perf_counter() - t_all
    report.requests = [
        {"id": q.rid, "prompt_len": q.prompt_len, "generated": q.tokens[q.prompt_len :]} for q in requests
    ]
    if report.quant is not None:
        q = report.quant
        logger.info(
            "verify %s [%s] %s cache: top-1 agreement %.1f%% over %d positions, max |dlogit| %.3g, mean %.3g",
            case.name,
            report.backend,
            q.kv_cache_quant,
            100 * q.top1_agreement,
            q.positions,
            q.max_abs_logit_error,
            q.mean_abs_logit_error,
        )
    logger.info(
        "verify %s [%s]: max |dlogit| %.3g, greedy %.1f%%, %d steps",
        case.name,
        report.backend,
        report.max_abs_logit_diff,
        100 * report.greedy_agreement,
        len(report.steps),
    )
    return report


def _run_quantized(
    case: VerifyCase,
    report: VerifyReport,
    replay: list[tuple[Any, Any, Any, Any]],
    fmt: Any,
    cache_plan: AttentionPlan,
    num_blocks: int,
    block_size: int,
    calibration: Any,
    bar: Any,
) -> None:
    """The second run: every recorded step (its ``BatchMeta``, positions ``[T]``, ids ``[T]``, greedy
    rows ``[T]``) on a NaN-filled quantized cache, compared with the first run's logits."""
    import paddle

    from ..adapter.context import StepContext
    from .batch import allocate_quantized_kv_caches

    scales = calibration.scales(fmt) if calibration is not None else None
    caches = allocate_quantized_kv_caches(cache_plan, num_blocks, block_size, fmt, "float32", scales)
    for i, (meta, positions, ids, greedy_rows) in enumerate(replay):
        with case.holder.step(StepContext(meta, caches, positions)):
            logits = case.paged_logits(paddle.to_tensor(ids, dtype="int64"), positions)
        logits = logits.astype("float32").numpy()
        report.quant_step_logits.append(logits)
        err, matches = report.quant.add(i, report.step_logits[i], logits, greedy_rows)
        report.steps[i].quant_max_abs_logit_error = err
        report.steps[i].quant_top1_matches = matches
        bar.update(1)
        bar.set_postfix(quant_top1=f"{report.quant.top1_agreement:.0%}")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "step") -> Any:
    """A tqdm bar on stderr over ``total`` ``unit``s (``update``, ``set_postfix``, ``close``), or one
    that does nothing when not ``enabled`` or tqdm is not installed (the verify extra)."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the verify extra; without it, no bar
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
