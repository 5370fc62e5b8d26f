"""Verify cases for PaddleFleet-shaped hosts: minifleet (the embedded model) and PaddleFleet itself.

:func:`build_minifleet_case` (the embedded model) and :func:`build_paddlefleet_case` (a PaddleFleet
``GPTModel`` built by PaddleFormers' fleet-backed ``AutoModelForCausalLM.from_config``; needs the
``paddlefleet`` package) share :func:`fleet_case`, which patches one of two identical models and
walks both through their ``run_function``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..backends.base import AttentionBackend
from ..plan.layer import AttentionPlan
from .verify import VerifyCase


def causal_startend_row_indices(batch: int, seq: int) -> Any:
    """``[batch, 1, seq, 1]`` int32 filled with ``seq``: FlashMask start/end rows of one causal
    document per row, what PaddleFleet's data path feeds an unpacked causal batch (sliding layers
    need them: they take the FlashMask path and add their window to these rows)."""
    import paddle

    return paddle.full([batch, 1, seq, 1], seq, dtype="int32")


def pipeline_logits(model: Any, ids: Any, positions: Any, startend_rows: Any = None) -> Any:
    """Walk a PaddleFleet-shaped ``model.run_function`` (dicts between layers) over ``ids [1, L]``
    at ``positions [1, L]`` (int64) -> logits ``[1, L, vocab]`` (what ``GPTModel`` runs, without
    pipeline parallelism). ``startend_rows``: the ``attn_mask_startend_row_indices`` to feed
    (``None``: none, the host's eager path)."""
    carry: Any = {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": None,
        "attn_mask_startend_row_indices": startend_rows,
    }
    for layer in model.run_function:
        carry = layer(carry)
    return carry["logits"] if isinstance(carry, Mapping) else carry


def fleet_case(
    name: str,
    native: Any,
    paged: Any,
    plan: AttentionPlan,
    backend: AttentionBackend | str = "reference",
    extras: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    native_path: str = "flashmask",
) -> VerifyCase:
    """Patch ``paged`` (same weights as ``native``) with ``plan`` on ``backend``; wrap both as a case.

    Both are PaddleFleet-shaped ``GPTModel`` s (minifleet or PaddleFleet itself): ``native`` keeps
    its own core attention and runs each request's whole sequence; ``paged`` runs the packed step.
    ``native_path``: ``flashmask`` feeds the native model causal start/end rows
    (:func:`causal_startend_row_indices`, PaddleFleet's production path, the only one its sliding
    layers take); ``eager`` feeds none (its eager path; full-attention models only).
    ``vocab_size`` defaults to ``paged.config.vocab_size``.
    """
    if native_path not in ("flashmask", "eager"):
        raise ValueError(f"native_path must be 'flashmask' or 'eager', got {native_path!r}")
    import paddle

    from ..backends import get_backend
    from ..patch import cache_plan, patch_core_attention, step_holder

    backend = get_backend(backend) if isinstance(backend, str) else backend
    report = patch_core_attention(paged, plan, backend)
    vocab = vocab_size or getattr(getattr(paged, "config", None), "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"vocab_size must be a positive int (argument or model config), got {vocab!r}")

    def native_logits(ids: Any) -> Any:
        n = int(ids.shape[1])
        positions = paddle.arange(n, dtype="int64").unsqueeze(0)
        rows = causal_startend_row_indices(1, n) if native_path == "flashmask" else None
        return pipeline_logits(native, ids, positions, rows)

    def paged_logits(ids: Any, positions: Any) -> Any:
        return pipeline_logits(paged, ids.unsqueeze(0), positions.unsqueeze(0))[0]

    native_logits.model = native  # type: ignore[attr-defined]  # for tests and tools
    paged_logits.model = paged  # type: ignore[attr-defined]
    return VerifyCase(
        name=name,
        plan=plan,
        holder=step_holder(paged),
        patch_report=report,
        vocab_size=vocab,
        native_logits=native_logits,
        paged_logits=paged_logits,
        extras={**(extras or {}), "native_path": native_path},
        cache_plan=cache_plan(plan, backend),
    )


def build_minifleet_case(
    config: Any = "tiny", backend: AttentionBackend | str = "reference", seed: int = 0
) -> VerifyCase:
    """A :class:`VerifyCase` on minifleet: two models with identical weights, one patched.

    ``config``: a preset name, a JSON path, a dict or a ``MiniFleetConfig``.
    The plan comes from ``plan.plan_from_config`` over the same config object
    the model was built from (PaddleFleet's attribute config, so an int
    ``sliding_window`` has PaddleFleet's meaning).
    """
    from ..minifleet import build_minifleet, make_config
    from ..plan import plan_from_config
    from ..plan.weights import check_fits

    cfg = make_config(config)
    name = config if isinstance(config, str) else "minifleet"
    # two float32 instances: refused by name before the allocator runs out (issue 30 item 5)
    check_fits(cfg, copies=2, dtype="float32", what=f"minifleet config {str(name)!r}")
    native = build_minifleet(cfg, seed=seed)
    paged = build_minifleet(cfg, seed=seed)
    extras = {"host": "minifleet", "config": str(name)}
    return fleet_case(f"minifleet:{name}", native, paged, plan_from_config(cfg), backend, extras)


def paddlefleet_config(raw: dict[str, Any]) -> Any:
    """A PaddleFormers config object of ``raw['model_type']`` from a ``config.json`` dict."""
    from paddleformers.transformers.auto.configuration import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config model_type={model_type!r} is not a PaddleFormers architecture")
    if not raw.get("architectures"):
        raise ValueError(
            f"config architectures={raw.get('architectures')!r}: PaddleFormers' from_config needs the "
            "model class name (e.g. ['Qwen3ForCausalLM'])"
        )
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    return CONFIG_MAPPING[model_type].from_dict(fields)


def build_paddlefleet_model(config: Any, seed: int) -> Any:  # pragma: no cover - needs paddlefleet
    """A random-init PaddleFleet ``GPTModel`` in eval mode: PaddleFormers' fleet-backed
    ``AutoModelForCausalLM.from_config`` (its ``__new__`` returns the ``GPTModel``)."""
    import copy

    import paddle
    from paddleformers.transformers import AutoModelForCausalLM

    paddle.seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model.eval()
    return model


def build_paddlefleet_case(
    raw: dict[str, Any], backend: AttentionBackend | str = "reference", seed: int = 0, name: str = "config"
) -> VerifyCase:
    """A :class:`VerifyCase` on a real PaddleFleet model of config dict ``raw`` (needs ``paddlefleet``).

    Two instances from :func:`build_paddlefleet_model` (same seed; the second gets the first's
    state dict, so they agree even where initialisation is not seeded); the plan is read from the
    built model's own ``TransformerConfig`` (``model.config``: the host's window convention).
    """
    from ..plan import plan_from_config
    from ..plan.weights import check_fits

    check_fits(raw, copies=2, what=f"{raw.get('model_type')!r} config {name!r}")  # before any allocation
    config = paddlefleet_config(raw)
    native = build_paddlefleet_model(config, seed)
    paged = build_paddlefleet_model(config, seed)
    missing, unexpected = paged.set_state_dict(native.state_dict())
    if missing or unexpected:
        raise ValueError(
            f"the two {raw.get('model_type')!r} instances differ: missing {list(missing)[:5]}, "
            f"unexpected {list(unexpected)[:5]}"
        )
    plan = plan_from_config(paged.config)
    extras = {"host": "paddlefleet", "config": str(name), "model_type": raw.get("model_type")}
    name = f"paddlefleet:{raw.get('model_type')}"
    return fleet_case(name, native, paged, plan, backend, extras, vocab_size=int(config.vocab_size))
