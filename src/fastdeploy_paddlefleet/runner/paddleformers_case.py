"""Verify cases on real PaddleFormers models: gpt_oss, gemma3_text, deepseek_v3, llama.

``build_case(arch)`` builds a small random-init model of that architecture
(no download, CPU, fp32) twice with identical weights: one left native (its
own eager attention over the full sequence, no cache) and one patched by
:func:`~fastdeploy_paddlefleet.patch.paddleformers.patch_paddleformers` onto
the paged path. ``runner.verify.run_verify`` drives both.

Upstream quirks neutralised here (PaddleFormers 1.2.0), each in both twins so
that what is compared is the attention and nothing else:

* gpt_oss MoE in eval mode mixes tokens: ``GptOssExperts.forward`` reshapes
  ``routing_weights [tokens, experts]`` to ``[experts, tokens]`` after a
  ``transpose([0, 1])`` that is a no-op, so expert ``e`` of token ``t`` is
  weighted by another token's routing weight and a token's output depends on
  the rest of the batch (3.7 logits between a prompt and its prefix here).
  :func:`fix_gpt_oss_moe` hands the experts their routing weights already in
  the layout that reshape expects (the result equals the training-mode loop).
* deepseek_v3's RoPE (``apply_rotary_pos_emb``) squeezes the sequence axis
  away when a forward has one token, and then fails to broadcast. A paged
  step with a single token is padded with a copy of it
  (:func:`~fastdeploy_paddlefleet.patch.paddleformers.padded_step`); the
  pad never reaches the cache and its logits are dropped.
* deepseek_v3 imports ``paddlefleet_ops`` (not installable here): a stand-in
  is installed only when the real package cannot be imported, with a warning.
* PaddleFormers' own KV cache is wrong for sliding layers and broken for
  deepseek_v3, so the native side is always a full-sequence forward.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..backends import get_backend
from ..backends.base import AttentionBackend
from ..plan.config import plan_from_config
from ..plan.fields import check_caps, check_numeric_fields, read_json_file
from ..plan.layer import AttentionPlan
from ..plan.weights import check_fits

logger = logging.getLogger(__name__)

#: architecture name (PaddleFormers ``model_type``) -> causal-LM class name in ``architectures``
ARCHITECTURES: dict[str, str] = {
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
}

# small shapes: fast on 2 CPU cores, windows short enough that test prompts exceed them
_COMMON = {"vocab_size": 128, "hidden_size": 64, "max_position_embeddings": 512}
_TINY: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        **_COMMON,
        "num_hidden_layers": 4,  # layer_types default: sliding, full, sliding, full
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    },
    "gemma3_text": {
        **_COMMON,
        "num_hidden_layers": 4,  # sliding_window_pattern 3: sliding, sliding, full, sliding
        "sliding_window_pattern": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,  # != head_dim, so the scale translation is tested
        "intermediate_size": 96,
        "sliding_window": 8,
    },
    "deepseek_v3": {
        **_COMMON,
        "num_hidden_layers": 2,  # layer 0 dense, layer 1 MoE
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,  # q/k head 24, v head 16
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {"rope_type": "default", "factor": 1.0},
    },
    "llama": {
        **_COMMON,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
    },
}


def _check_arch(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")


#: the PaddleFormers release an architecture needs here where it is newer than the ``paddleformers``
#: extra's floor (1.1.1, FastDeploy's; beside FastDeploy pip takes 1.1.1, which keeps transformers < 5):
#: 1.1.x's deepseek_v3 model imports ``paddle.distributed.communication.deep_ep``, which the CPU
#: paddlepaddle builds lack (a GPU build that has it builds the model on 1.1.x too)
MIN_PADDLEFORMERS: dict[str, str] = {"deepseek_v3": "1.2.0"}


def _release(version: str) -> tuple[int, ...]:
    """``(major, minor, micro)`` of a version string (``1.2.0.post1`` -> ``(1, 2, 0)``)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def arch_unavailable(arch: str) -> str | None:
    """``None`` when the installed PaddleFormers builds ``arch`` here, else why not, naming the release
    (:data:`MIN_PADDLEFORMERS`; a release below it whose model module imports anyway builds it)."""
    import importlib.metadata

    _check_arch(arch)
    need = MIN_PADDLEFORMERS.get(arch)
    try:
        have = importlib.metadata.version("paddleformers")
    except importlib.metadata.PackageNotFoundError:
        return "PaddleFormers is not installed (the `paddleformers` extra)"
    if need is None or _release(have) >= _release(need):
        return None
    if arch == "deepseek_v3":
        ensure_paddlefleet_ops()
    try:
        importlib.import_module(f"paddleformers.transformers.{arch}.modeling")
    except ImportError as e:
        return (
            f"PaddleFormers {have}'s {arch} model does not import here ({e}): {arch} needs PaddleFormers "
            f">= {need} (which needs transformers >= 5: not beside FastDeploy) or a paddle build with "
            "that module"
        )
    return None


def ensure_paddlefleet_ops() -> bool:
    """Make ``import paddlefleet_ops`` work for deepseek_v3; True when a stand-in was installed.

    PaddleFormers' deepseek_v3 imports ``paddlefleet_ops.is_deep_ep_available``
    at module import. When the real package is not importable, a stand-in
    module whose ``is_deep_ep_available()`` returns False is put in
    ``sys.modules`` (DeepEP dispatch is then off, which is what a
    single-process CPU run wants anyway).
    """
    if "paddlefleet_ops" in sys.modules or importlib.util.find_spec("paddlefleet_ops") is not None:
        return False
    stub = types.ModuleType("paddlefleet_ops")
    stub.__doc__ = (
        "fastdeploy-paddlefleet stand-in: paddlefleet_ops is not installed; DeepEP reported unavailable"
    )
    stub.is_deep_ep_available = lambda: False
    sys.modules["paddlefleet_ops"] = stub
    logger.warning(
        "paddlefleet_ops is not installed: using a stand-in module (is_deep_ep_available() -> False) "
        "so that PaddleFormers' deepseek_v3 can be imported; DeepEP expert dispatch is unavailable"
    )
    return True


_CONFIG_CLASSES = {
    "gpt_oss": ("paddleformers.transformers.gpt_oss.configuration", "GptOssConfig"),
    "gemma3_text": ("paddleformers.transformers.gemma3_text.configuration", "Gemma3TextConfig"),
    "deepseek_v3": ("paddleformers.transformers.deepseek_v3.configuration", "DeepseekV3Config"),
    "llama": ("paddleformers.transformers.llama.configuration", "LlamaConfig"),
}


def _config_class(arch: str) -> Any:
    if arch == "deepseek_v3":
        ensure_paddlefleet_ops()
    module_name, cls_name = _CONFIG_CLASSES[arch]
    return getattr(importlib.import_module(module_name), cls_name)


def _cpu_ready(config: Any, arch: str) -> Any:
    """Fields every build here needs: the architecture, and no fused RMSNorm (not registered on CPU)."""
    config.architectures = [ARCHITECTURES[arch]]
    config.fuse_rms_norm = False
    return config


def tiny_config(arch: str, **overrides: Any) -> Any:
    """A small random-init PaddleFormers config of ``arch`` (fields in ``_TINY``; ``overrides`` win)."""
    _check_arch(arch)
    fields = {**copy.deepcopy(_TINY[arch]), **overrides}
    return _cpu_ready(_config_class(arch)(**fields), arch)


def load_arch_config(arch: str, config_path: str | Path) -> Any:
    """Read ``config_path`` (a ``config.json`` or a directory holding one) as an ``arch`` config."""
    _check_arch(arch)
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config_path {str(config_path)!r}: no such file")
    data = read_json_file(path)  # size-capped; errors name the file
    try:  # the fields as written, before the config class resolves them
        check_caps(data)
        check_numeric_fields(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    model_type = data.get("model_type", arch)
    if model_type != arch:
        raise ValueError(f"config_path {str(path)!r}: model_type={model_type!r} does not match arch={arch!r}")
    return _cpu_ready(_config_class(arch)(**data), arch)


def fix_gpt_oss_moe(model: Any) -> int:
    """Neutralise gpt_oss's eval-mode MoE routing bug in ``model`` (see module doc); returns experts fixed.

    Upstream computes ``routing_weights.transpose([0, 1]).reshape([experts,
    batch, -1])``; the transpose is a no-op, so the reshape reads the
    ``[tokens, experts]`` matrix in the wrong order. Passing the weights as
    ``routing_weights.T`` laid out in a ``[tokens, experts]`` shaped tensor
    makes that reshape produce the true ``[experts, tokens]`` matrix. Training
    mode (a per-expert loop, correct upstream) is left alone.
    """
    fixed = 0
    for _, sub in model.named_sublayers():
        if type(sub).__name__ != "GptOssExperts" or "forward" in vars(sub):
            continue
        original = sub.forward

        def forward(hidden_states, router_indices=None, routing_weights=None, _orig=original, _mod=sub):
            if not _mod.training and routing_weights is not None:
                routing_weights = routing_weights.transpose([1, 0]).reshape(routing_weights.shape)
            return _orig(hidden_states, router_indices=router_indices, routing_weights=routing_weights)

        object.__setattr__(sub, "forward", forward)
        fixed += 1
    return fixed


def build_twins(config: Any, seed: int = 0) -> tuple[Any, Any]:
    """Two eval-mode models of ``config`` with identical weights, each on its own config copy.

    The copies matter: gpt_oss / llama read the attention implementation from
    the config object, and only the twin is switched to the paged path.
    """
    import paddle

    arch = str(getattr(config, "model_type", ""))
    _check_arch(arch)
    why = arch_unavailable(arch)
    if why is not None:
        raise ValueError(why)
    if arch == "deepseek_v3":
        ensure_paddlefleet_ops()
    from paddleformers.transformers import AutoModelForCausalLM

    paddle.seed(seed)
    native = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    twin.set_state_dict(native.state_dict())
    for model in (native, twin):
        model.eval()
        if arch == "gpt_oss":
            fix_gpt_oss_moe(model)
    return native, twin


def make_case(
    name: str,
    native: Any,
    twin: Any,
    plan: AttentionPlan,
    backend: str | AttentionBackend = "reference",
    extras: dict[str, Any] | None = None,
) -> Any:
    """Patch ``twin`` with ``plan`` on ``backend`` and wrap both models as a ``VerifyCase``.

    ``plan`` is taken as given (a test may pass a deliberately wrong one).
    """
    import paddle

    from ..patch.core_attention import cache_plan
    from ..patch.paddleformers import padded_step, patch_paddleformers, step_holder
    from .verify import VerifyCase

    backend_obj = get_backend(backend) if isinstance(backend, str) else backend
    report = patch_paddleformers(twin, plan, backend_obj)
    pad_single = str(getattr(twin.config, "model_type", "")) == "deepseek_v3"

    def native_logits(ids: Any) -> Any:
        """``ids [1, L]`` int64 -> ``[1, L, vocab]``: the model's own eager forward, no cache."""
        with paddle.no_grad():
            return native(input_ids=ids, use_cache=False, return_dict=True).logits

    def paged_logits(ids: Any, positions: Any) -> Any:
        """``ids [T]``, ``positions [T]`` -> ``[T, vocab]``: the patched twin, inside ``holder.step``."""
        t = int(ids.shape[0])
        pad = 1 if pad_single and t == 1 else 0
        if pad:  # deepseek_v3 RoPE cannot run a one-token sequence (module doc)
            ids = paddle.concat([ids, ids[-1:]])
            positions = paddle.concat([positions, positions[-1:]])
        with paddle.no_grad(), padded_step(twin, pad):
            out = twin(
                input_ids=ids.reshape([1, -1]),
                position_ids=positions.reshape([1, -1]).astype("int64"),
                use_cache=False,
                return_dict=True,
            ).logits
        return out[0, :t]

    return VerifyCase(
        name=name,
        plan=plan,
        holder=step_holder(twin),
        patch_report=report,
        vocab_size=int(twin.config.vocab_size),
        native_logits=native_logits,
        paged_logits=paged_logits,
        extras=dict(extras or {}),
        cache_plan=cache_plan(plan, backend_obj),
    )


#: host quirks worked around per architecture, reported in ``VerifyCase.extras``
WORKAROUNDS: dict[str, list[str]] = {
    "gpt_oss": ["eval-mode MoE routing-weight layout fixed in both twins (upstream transpose([0, 1]) no-op)"],
    "deepseek_v3": [
        "one-token paged steps padded with a copy (upstream RoPE squeezes the sequence axis when s == 1)",
        "paddlefleet_ops stand-in when the package is missing",
    ],
}


def build_case(
    arch: str,
    config_path: str | Path | None = None,
    backend: str | AttentionBackend = "reference",
    seed: int = 0,
    *,
    plan_transform: Callable[[AttentionPlan], AttentionPlan] | None = None,
) -> Any:
    """A ``VerifyCase`` for PaddleFormers ``arch`` (one of ``ARCHITECTURES``).

    ``config_path``: a ``config.json`` of that architecture (default: the tiny
    random-init config of :func:`tiny_config`). The plan is translated from
    the config by ``plan.plan_from_config``; ``plan_transform`` (tests) may
    alter it before patching, e.g. to show that a wrong window breaks parity.
    """
    _check_arch(arch)
    config = tiny_config(arch) if config_path is None else load_arch_config(arch, config_path)
    plan = plan_from_config(config)
    where = f"{arch} config {str(config_path)!r}" if config_path is not None else f"{arch} tiny config"
    check_fits(config, copies=2, what=where, plan=plan)  # two instances, refused before allocating
    if plan_transform is not None:
        plan = plan_transform(plan)
    native, twin = build_twins(config, seed=seed)
    extras = {
        "host": "paddleformers",
        "arch": arch,
        "config": str(config_path) if config_path is not None else "tiny",
        "workarounds": WORKAROUNDS.get(arch, []),
    }
    return make_case(f"paddleformers:{arch}", native, twin, plan, backend, extras)
