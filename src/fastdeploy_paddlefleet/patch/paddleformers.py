"""Patch plain-paddle PaddleFormers models (gpt_oss, gemma3_text, deepseek_v3, llama) onto the paged path.

These models compute attention in a function chosen per call, not in a
sub-module: ``ALL_ATTENTION_FUNCTIONS[key]`` (``paddleformers/nn/attention``),
called as ``fn(module, query=, key=, value=, attention_mask=, ..., scaling=,
[sink=])`` with ``[b, heads, s, d]`` inputs (K/V not repeated for GQA) and
returning ``([b, s, heads * d], weights)``; deepseek_v3 calls its own
module-level ``scaled_dot_product_attention`` through the instance attribute
``self.attn_func``. How the key is looked up differs per model:

* gpt_oss, llama: ``self.config._attn_implementation`` (the model's config);
* gemma3_text: ``self.attn_implementation``, an instance attribute copied from
  the config at build time (and reset to ``"sdpa"`` when a call has no mask);
* deepseek_v3: ``self.attn_func`` (a function reference per instance).

Why a new registry key plus per-module routing (the least invasive choice):
the key ``"fdfleet_paged"`` is *added* to ``AttentionInterface``; the existing
keys (``eager``, ``sdpa``, ``flashmask``) are never replaced, so other models
in the process keep their attention. The paged function finds its layer
state on the calling module (``module._fdfleet_paged``: plan layer, backend,
holder), so each patched model dispatches to its own step holder. Only the
selector each model actually reads is switched: the instance attribute for
gemma3_text (its config stays ``eager``: a non-eager config key makes the
model drop its masks, and gemma3 then falls back to ``sdpa``), ``attn_func``
for deepseek_v3 (its placeholder ``module`` argument cannot route), and the
config key for gpt_oss / llama (which is also what makes them skip building
dense masks the paged path ignores). Wrapping each attention module's whole
``forward`` instead would duplicate projections and RoPE per architecture.
Build a native twin from its own config copy: gpt_oss / llama read the key
from the config object, so a shared config would switch both.

Windows, sinks and scales come from the *plan* (translated from the config
by ``plan``), never from the module: PaddleFormers carries the sliding window
only inside the additive mask, so the parity check against the model's own
eager forward is what decides that the translation is right. The module's
own sink parameter (gpt_oss ``sinks``, ``[heads]``) is the backend's
``sinks``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..adapter.context import StepContextHolder
from ..backends.base import AttentionBackend
from ..plan.layer import AttentionPlan, LayerAttention
from .report import PatchedLayer, PatchReport, SkippedLayer

logger = logging.getLogger(__name__)

#: the attention-implementation key this module adds to PaddleFormers' registry
PAGED_ATTN_KEY = "fdfleet_paged"
#: ``config.model_type`` values whose attention modules this pass knows how to route
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("gpt_oss", "gemma3_text", "deepseek_v3", "llama")

_STATE_ATTR = "_fdfleet_paged"
_PATCH_ATTR = "_fdfleet_paddleformers_patch"
_HOLDER_ATTR = "_fdfleet_step_holder"


@dataclass
class _ModelPatch:
    """What one ``patch_paddleformers`` call changed on one model (for unpatching and padding)."""

    holder: StepContextHolder
    # (module, attribute, original value) for instance attributes; (config, original key) for configs
    restore_attrs: list[tuple[Any, str, Any]] = field(default_factory=list)
    restore_configs: list[tuple[Any, str]] = field(default_factory=list)
    #: trailing tokens this step carries only for the host's shape needs (see ``padded_step``)
    pad_tokens: int = 0


@dataclass
class _LayerState:
    """Attached to each patched attention module as ``module._fdfleet_paged``.

    ``backend_layer`` is the layer as the backend sees it (V padded to the q/k
    head dim for backends that need equal dims, see ``adapter.backend_layer``);
    ``value_fuser`` pads/trims around the call when that is the case.
    """

    name: str
    layer: LayerAttention
    backend: AttentionBackend
    model_patch: _ModelPatch
    backend_layer: LayerAttention
    value_fuser: Any = None


def _register_key() -> None:
    from paddleformers.nn.attention.interface import AttentionInterface

    # class-level register adds the key for every interface instance; existing keys are untouched
    if getattr(AttentionInterface, "_global_mapping", {}).get(PAGED_ATTN_KEY) is not paged_attention_forward:
        AttentionInterface.register(PAGED_ATTN_KEY, paged_attention_forward)


def _state_of(module: Any) -> _LayerState:
    state = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"attention implementation {PAGED_ATTN_KEY!r} called from {type(module).__name__}, "
            "which patch_paddleformers did not patch (was the config shared with another model?)"
        )
    return state


def _run_paged(state: _LayerState, query: Any, key: Any, value: Any, sink: Any) -> Any:
    """``[b, H, s, d]`` q/k/v -> ``[b, s, Hq * Dv]`` through the backend on this step's cache."""
    import paddle

    ctx = state.model_patch.holder.get()
    layer = state.layer
    b, hq, s, dqk = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    n = b * s
    t = ctx.meta.num_tokens
    pad = state.model_patch.pad_tokens
    if n != t + pad:
        raise ValueError(
            f"layer {layer.index} ({state.name}): the model produced {n} tokens (batch {b} x seq {s}) "
            f"but the step's batch metadata has num_tokens={t} (+{pad} pad tokens)"
        )
    # [b, H, s, d] -> [b * s, H, d]: packed tokens in order, as the batch metadata lays them out
    q = query.transpose([0, 2, 1, 3]).reshape([n, hq, dqk])[:t]
    k = key.transpose([0, 2, 1, 3]).reshape([n, hkv, dqk])[:t]
    v = value.transpose([0, 2, 1, 3]).reshape([n, hkv, dv])[:t]
    if layer.index >= len(ctx.kv_caches):
        raise ValueError(f"layer {layer.index}: the step context has only {len(ctx.kv_caches)} kv caches")
    # inference only: a detached view (DLPack refuses tensors that require grad)
    sinks = sink.detach() if layer.sink == "learnable" and sink is not None else None
    if state.value_fuser is not None:
        q, k, v = state.value_fuser.before(q, k, v)
    out = state.backend.forward(
        q, k, v, state.backend_layer, ctx.meta, ctx.kv_caches[layer.index], sinks=sinks
    )
    if state.value_fuser is not None:
        out = state.value_fuser.after(out.reshape([t, hq, state.backend_layer.v_head_dim])).reshape(
            [t, hq * dv]
        )
    if pad:
        out = paddle.concat([out, paddle.zeros([pad, out.shape[-1]], dtype=out.dtype)], axis=0)
    return out.reshape([b, s, hq * dv])


def paged_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any = None,
    dropout: float = 0.0,
    sink: Any = None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """PaddleFormers attention-interface entry: ``[b, H, s, d]`` inputs -> (``[b, s, Hq * Dv]``, None).

    The mask and ``scaling`` of the call are ignored on purpose: the paged path
    applies the plan's window and softmax scale (the parity test checks them).
    """
    state = _state_of(module)
    if sink is None and state.layer.sink == "learnable":
        sink = getattr(module, "sinks", None)
    return _run_paged(state, query, key, value, sink), None


def _make_attn_func(state: _LayerState) -> Any:
    """A drop-in for deepseek_v3's ``scaled_dot_product_attention`` bound to one layer."""

    def attn_func(
        query_states: Any,
        config: Any,
        key_states: Any,
        value_states: Any,
        attention_mask: Any,
        output_attentions: bool,
        attn_mask_startend_row_indices: Any = None,
        softmax_scale: float = 1.0,
        training: bool = True,
        sequence_parallel: bool = False,
        **kwargs: Any,
    ) -> Any:
        out = _run_paged(state, query_states, key_states, value_states, None)
        if sequence_parallel:
            out = out.reshape([-1, out.shape[-1]])
        return (out, None) if output_attentions else out

    return attn_func


def _is_attention_module(module: Any) -> bool:
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")


def _module_dims(module: Any) -> dict[str, int | None]:
    """Head counts and dims the module itself uses (per tensor-parallel rank)."""
    q_heads = getattr(module, "num_local_heads", None) or getattr(module, "num_heads", None)
    if getattr(module, "q_head_dim", None) is not None:  # deepseek_v3 MLA: one kv head per query head
        return {
            "num_q_heads": q_heads,
            "num_kv_heads": q_heads,
            "qk_head_dim": module.q_head_dim,
            "v_head_dim": module.v_head_dim,
        }
    head_dim = getattr(module, "head_dim", None)
    return {
        "num_q_heads": q_heads,
        "num_kv_heads": getattr(module, "num_key_value_heads", None),
        "qk_head_dim": head_dim,
        "v_head_dim": head_dim,
    }


def _check_layer(name: str, module: Any, layer: LayerAttention) -> None:
    for field_name, got in _module_dims(module).items():
        want = getattr(layer, field_name)
        if got is not None and int(got) != want:
            raise ValueError(
                f"{name}: the plan's layer {layer.index} has {field_name}={want} "
                f"but the module uses {field_name}={int(got)}"
            )
    if (
        layer.logits_soft_cap is not None
    ):  # no PaddleFormers 1.2.0 attention soft-caps (gemma3_text ignores it)
        raise ValueError(
            f"{name}: the plan's layer {layer.index} has logits_soft_cap={layer.logits_soft_cap} "
            "(attn_logit_softcapping) but this PaddleFormers attention never soft-caps its scores: "
            "the patched model would not match the native one"
        )
    sinks = getattr(module, "sinks", None)
    if layer.sink == "learnable":
        if sinks is None:
            raise ValueError(
                f"{name}: the plan's layer {layer.index} has sink='learnable' but the module has no sinks"
            )
        if list(sinks.shape) != [layer.num_q_heads]:
            raise ValueError(
                f"{name}: sinks shape {list(sinks.shape)} does not match num_q_heads={layer.num_q_heads}"
            )
    elif sinks is not None:
        raise ValueError(
            f"{name}: the module has learnable sinks but the plan's layer {layer.index} "
            f"has sink={layer.sink!r}"
        )


def _model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "") or "")


def patch_paddleformers(
    model: Any, plan: AttentionPlan, backend: AttentionBackend, holder: StepContextHolder | None = None
) -> PatchReport:
    """Route every attention module of a PaddleFormers ``model`` through ``backend`` on the paged cache.

    Each attention module (``module.layer_idx`` -> ``plan[layer_idx]``) gets its
    plan layer; the step's batch metadata and caches come from ``holder``
    (a new one when ``None``; reachable as ``step_holder(model)``). Raises
    ``ValueError`` for an unsupported model type, an already patched model, a
    plan that disagrees with the module's heads/dims/sink parameter, or a layer
    the backend cannot run. Modules whose index lies beyond the plan (e.g.
    deepseek_v3 MTP layers) are skipped and reported.
    """
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model.config.model_type={model_type!r} is not supported by patch_paddleformers; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"backend must be an AttentionBackend, got {type(backend).__name__}")
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise ValueError(
            f"model {type(model).__name__} is already patched (call unpatch_paddleformers first)"
        )
    if holder is None:
        holder = StepContextHolder()
    from ..adapter.core_attention import ValuePadFuser, backend_layer

    _register_key()

    report = PatchReport(backend=getattr(backend, "name", type(backend).__name__))
    # validate everything first, so a bad plan leaves the model untouched
    targets: list[tuple[str, Any, LayerAttention]] = []
    found = False
    for name, module in model.named_sublayers():
        if not _is_attention_module(module):
            continue
        found = True
        idx = module.layer_idx
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise ValueError(f"{name}: layer_idx={idx!r} is not a non-negative int")
        if idx >= len(plan):
            report.skipped.append(
                SkippedLayer(name, f"layer_idx {idx} beyond the plan's {len(plan)} layers (MTP)")
            )
            continue
        layer = plan[idx]
        if layer.index != idx:
            raise ValueError(f"{name}: plan entry {idx} has index={layer.index}")
        _check_layer(name, module, layer)
        backend.check_layer(backend_layer(layer, backend))  # raises for combos the backend cannot run
        targets.append((name, module, layer))
    if not found:
        raise ValueError(f"no attention module found in {type(model).__name__} (model_type={model_type!r})")

    mp = _ModelPatch(holder=holder)
    patched_configs: set[int] = set()
    for name, module, layer in targets:
        seen = backend_layer(layer, backend)
        fuser = (
            ValuePadFuser(layer.v_head_dim, layer.qk_head_dim)
            if seen.v_head_dim != layer.v_head_dim
            else None
        )
        state = _LayerState(name, layer, backend, mp, backend_layer=seen, value_fuser=fuser)
        object.__setattr__(module, _STATE_ATTR, state)
        mp.restore_attrs.append((module, _STATE_ATTR, None))
        if "attn_func" in vars(module):  # deepseek_v3
            mp.restore_attrs.append((module, "attn_func", module.attn_func))
            object.__setattr__(module, "attn_func", _make_attn_func(state))
        elif "attn_implementation" in vars(module):  # gemma3_text
            mp.restore_attrs.append((module, "attn_implementation", module.attn_implementation))
            object.__setattr__(module, "attn_implementation", PAGED_ATTN_KEY)
        else:  # gpt_oss, llama: the key lives on the (shared) model config
            config = module.config
            if id(config) not in patched_configs:
                patched_configs.add(id(config))
                mp.restore_configs.append((config, config._attn_implementation))
                config._attn_implementation = PAGED_ATTN_KEY
        report.patched.append(
            PatchedLayer(name=name, layer_index=layer.index, kind=layer.kind, sink=layer.sink)
        )
    object.__setattr__(model, _PATCH_ATTR, mp)
    object.__setattr__(model, _HOLDER_ATTR, holder)
    logger.info(
        "patched %d attention modules of %s onto backend %s", report.num_patched, model_type, report.backend
    )
    return report


def unpatch_paddleformers(model: Any) -> None:
    """Undo :func:`patch_paddleformers` (``ValueError`` if ``model`` is not patched)."""
    mp = getattr(model, _PATCH_ATTR, None)
    if mp is None:
        raise ValueError(f"model {type(model).__name__} is not patched by patch_paddleformers")
    for module, attr, original in reversed(mp.restore_attrs):
        if original is None:
            object.__delattr__(module, attr)
        else:
            object.__setattr__(module, attr, original)
    for config, key in mp.restore_configs:
        config._attn_implementation = key
    object.__delattr__(model, _PATCH_ATTR)
    object.__delattr__(model, _HOLDER_ATTR)


def step_holder(model: Any) -> StepContextHolder:
    """The step holder a patched ``model`` reads its batch metadata and caches from."""
    holder = getattr(model, _HOLDER_ATTR, None)
    if holder is None:
        raise ValueError(f"model {type(model).__name__} is not patched (no step holder)")
    return holder


@contextlib.contextmanager
def padded_step(model: Any, pad_tokens: int) -> Iterator[None]:
    """Let the model run ``pad_tokens`` extra trailing tokens that the batch metadata does not have.

    For hosts that cannot run a one-token sequence (deepseek_v3's RoPE squeezes
    the sequence axis away when ``s == 1``): the caller appends copies of the
    last token; attention runs on the real tokens only, never touches the cache
    for the pad, and gives the pad zeros. The caller drops the pad's logits.
    """
    mp = getattr(model, _PATCH_ATTR, None)
    if mp is None:
        raise ValueError(f"model {type(model).__name__} is not patched by patch_paddleformers")
    if not isinstance(pad_tokens, int) or pad_tokens < 0:
        raise ValueError(f"pad_tokens must be a non-negative int, got {pad_tokens!r}")
    mp.pad_tokens = pad_tokens
    try:
        yield
    finally:
        mp.pad_tokens = 0
