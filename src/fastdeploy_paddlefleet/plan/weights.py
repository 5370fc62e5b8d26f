"""How many bytes a model's weights take, from its config alone, before anything is allocated (stdlib only).

:func:`estimate_weights` counts the parameters of a decoder-only model from the fields the plan reads
(per layer, from :func:`plan.plan_from_config`'s ``LayerAttention``: query / kv heads, qk / v head
dims, MLA ranks, sliding-layer variants) and the config's own sizes:

* embeddings ``vocab_size x hidden_size``; the LM head the same unless ``tie_word_embeddings``;
* attention per layer: q, k, v and output projections (MLA: ``q_a``/``q_b`` or ``q``, ``kv_a``,
  ``kv_b``, output), a gate of ``gated_attention``, learnable sinks; head-wise layers hold the same
  projections as full ones (the split only changes the mask);
* MLP per layer: SwiGLU (``3 x hidden x ffn``) or, on MoE layers, every routed expert, the shared
  experts and the router (``first_k_dense_replace`` / ``moe_layer_start_index`` layers stay dense);
* norms: two per layer, the final one, MLA's ``q_a`` / ``kv_a`` norms; multi-token-prediction layers
  add their ``eh_proj`` and two norms.

Absent sizes count as zero (the estimate errs low: it refuses only what cannot fit). Issue 30 item 5:
``fdfleet verify`` refuses a config whose weights cannot fit in memory (:func:`check_fits`) instead
of dying in the allocator; the same estimate is the one to reuse wherever weights are sized.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: bytes per element of the dtypes a model is built in
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "int8": 1,
}
#: headroom kept for activations, the KV cache and the allocator when checking a fit: the weights may
#: take at most this fraction of the available memory
FIT_FRACTION = 0.8
#: where :func:`available_memory` reads ``MemAvailable``
MEMINFO = "/proc/meminfo"


class ModelTooLargeError(ValueError):
    """A model's weights cannot fit in the memory available (the message names both, in bytes)."""


@dataclass(frozen=True)
class WeightEstimate:
    """Parameter counts of one model by part (``embedding``, ``attention``, ``mlp``, ``norms``,
    ``lm_head``, ``mtp``) and their total."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(self.parts.values())

    def bytes(self, dtype: str | int = "float32") -> int:
        """The weights' bytes in ``dtype`` (a name of :data:`DTYPE_BYTES` or bytes per element)."""
        return self.params * dtype_bytes(dtype)


def dtype_bytes(dtype: str | int | None) -> int:
    """Bytes per element of ``dtype`` (a name such as ``bfloat16``, ``paddle.float32``'s text, or an
    int); ``None`` is float32. ``ValueError`` naming an unknown dtype."""
    if dtype is None:
        return 4
    if isinstance(dtype, bool):
        raise TypeError(f"dtype must be a name or a byte count, got {dtype!r}")
    if isinstance(dtype, int):
        if dtype not in (1, 2, 4, 8):
            raise ValueError(f"dtype bytes must be 1, 2, 4 or 8, got {dtype!r}")
        return dtype
    name = str(dtype).strip().lower().rpartition(".")[2]  # paddle.bfloat16, torch.float16
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _reader(config: Any) -> Callable[..., Any]:
    read = config.get if isinstance(config, Mapping) else (lambda name: getattr(config, name, None))

    def first(*names: str, default: Any = None) -> Any:
        for name in names:
            value = read(name)
            if value is not None:
                return value
        return default

    return first


def _size(value: Any) -> int:
    """A size field as a non-negative int (a list, e.g. ERNIE's per-modality experts, sums); anything
    else counts as 0 (the config checks name bad fields elsewhere)."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, list | tuple):
        return sum(_size(v) for v in value)
    return 0


def estimate_weights(config: Any, plan: Any = None) -> WeightEstimate:
    """The parameter count of the model of ``config`` (a mapping or a config object, as
    :func:`plan.plan_from_config` reads it) by part (module docstring). ``plan``: the config's
    :class:`AttentionPlan` on one rank (tp 1), computed when not given; ``ValueError`` for a config
    the plan refuses."""
    from .config import plan_from_config
    from .model_types import text_model

    if plan is None:
        plan = plan_from_config(config)
    config, _ = text_model(config)  # a multimodal wrapper: its text model's sizes
    get = _reader(config)
    hidden = _size(get("hidden_size"))
    vocab = _size(get("vocab_size"))
    n_layers = _size(get("num_hidden_layers", "num_layers"))
    ffn = _size(get("intermediate_size", "ffn_hidden_size"))
    experts = _size(get("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"))
    moe_ffn = _size(get("moe_intermediate_size", "moe_ffn_hidden_size", default=ffn))
    shared = _size(get("n_shared_experts", "moe_num_shared_experts", "num_shared_experts"))
    shared_ffn = _size(get("shared_expert_intermediate_size", default=shared * moe_ffn))
    dense_first = _size(get("first_k_dense_replace", "moe_layer_start_index"))
    gated = bool(get("gated_attention", default=False))
    tied = bool(get("tie_word_embeddings", default=False))
    tp = int(getattr(plan, "tp_size", 1) or 1)

    attention = norms = mlp = mtp = 0
    for layer in plan.layers:
        hq, hkv = layer.num_q_heads * tp, layer.num_kv_heads * tp  # whole model: every rank's heads
        qk, vd = layer.qk_head_dim, layer.v_head_dim
        mla = layer.mla
        if mla is not None:
            q = hidden * mla.q_lora_rank + mla.q_lora_rank * hq * qk if mla.q_lora_rank else hidden * hq * qk
            kv = hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * hq * (
                mla.qk_nope_head_dim + vd
            )
            norms += mla.kv_lora_rank + (mla.q_lora_rank or 0)
            attention += q + kv
        else:
            attention += hidden * (hq * qk + hkv * qk + hkv * vd)
        attention += hq * vd * hidden  # output projection
        if gated and mla is None:
            attention += hidden * hq * vd
        if layer.sink == "learnable":
            attention += hq
        norms += 2 * hidden
        moe = experts > 0 and layer.index >= dense_first
        if moe:
            mlp += experts * 3 * hidden * moe_ffn + 3 * hidden * shared_ffn + hidden * experts
        else:
            mlp += 3 * hidden * ffn
        if layer.index >= n_layers > 0:  # a multi-token-prediction layer: its input projection and norms
            mtp += 2 * hidden * hidden + 2 * hidden
    parts = {
        "embedding": vocab * hidden,
        "attention": attention,
        "mlp": mlp,
        "norms": norms + hidden,  # the final norm
        "lm_head": 0 if tied else vocab * hidden,
        "mtp": mtp,
    }
    return WeightEstimate(parts)


def config_dtype(config: Any, default: str = "float32") -> str:
    """The dtype a config asks its weights in (``dtype``, ``torch_dtype``, ``paddle_dtype``), else
    ``default``; an unknown name gives ``default`` too (the estimate errs towards float32)."""
    value = _reader(config)("dtype", "torch_dtype", "paddle_dtype")
    if value is None:
        return default
    name = str(value).strip().lower().rpartition(".")[2]
    return name if name in DTYPE_BYTES else default


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still take (``memory.max - memory.current``), or None
    when unlimited or unknown."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            line = next((x for x in f if x.startswith("0::")), None)
        if line is None:
            return None
        base = os.path.join("/sys/fs/cgroup", line.strip()[3:].lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="utf-8") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="utf-8") as f:
            current = int(f.read().strip())
        return max(int(limit) - current, 0)
    except (OSError, ValueError):
        return None


def available_memory(meminfo: str = MEMINFO) -> int | None:
    """Bytes of memory a new allocation may take now: ``MemAvailable`` of ``meminfo`` (Linux),
    bounded by the cgroup's room; without ``/proc/meminfo`` the free physical pages
    (``os.sysconf``); ``None`` when nothing tells."""
    found: int | None = None
    try:
        with open(meminfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    found = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
                    break
    except (OSError, ValueError, IndexError):
        found = None
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            found = None
    room = _cgroup_room()
    if room is not None:
        found = room if found is None else min(found, room)
    return found


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_fits(
    config: Any,
    *,
    copies: int = 1,
    dtype: str | int | None = None,
    what: str = "the model",
    available: int | None = None,
    plan: Any = None,
) -> int:
    """Refuse to build ``copies`` instances of the model of ``config`` when their weights (in
    ``dtype``; default: the config's, else float32) exceed :data:`FIT_FRACTION` of the ``available``
    memory (default :func:`available_memory`): :class:`ModelTooLargeError` naming the estimate and the
    memory, in bytes. Returns the estimated bytes of one instance; no check when the memory is
    unknown."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    estimate = estimate_weights(config, plan)
    size = estimate.bytes(config_dtype(config) if dtype is None else dtype)
    room = available_memory() if available is None else available
    if room is None:
        logger.debug("available memory unknown: %s (%d bytes of weights) not checked", what, size)
        return size
    need = size * copies
    if need > FIT_FRACTION * room:
        times = f"{copies} x " if copies > 1 else ""
        raise ModelTooLargeError(
            f"{what} needs about {need} bytes ({_gib(need)}: {times}{estimate.params:,} parameters x "
            f"{dtype_bytes(config_dtype(config) if dtype is None else dtype)} bytes) of weights, but only "
            f"{room} bytes ({_gib(room)}, MemAvailable) are available and {int(FIT_FRACTION * 100)}% "
            "of them may go to weights (the rest: activations); refusing to allocate it. Use a smaller "
            "config (hidden_size, vocab_size, layers, experts)"
        )
    return size


__all__ = [
    "DTYPE_BYTES",
    "FIT_FRACTION",
    "ModelTooLargeError",
    "WeightEstimate",
    "available_memory",
    "check_fits",
    "config_dtype",
    "dtype_bytes",
    "estimate_weights",
]
