"""Build the host model FastDeploy asks for: minifleet presets here, PaddleFleet through PaddleFormers.

``build_from_fd_config`` reads ``fd_config.model_config.model`` (the model directory): a
``model_type == "minifleet"`` config builds the embedded model sharded over FastDeploy's groups;
any other config needs the ``paddlefleet`` package (an ``ImportError`` naming it otherwise).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import paddle

from ..backends import AttentionBackend, get_backend
from ..plan.fields import read_json_file
from ..plan.layer import AttentionPlan
from ._fields import field as _get

logger = logging.getLogger(__name__)


def resolve_backend(backend: str | AttentionBackend | None) -> AttentionBackend:
    if isinstance(backend, AttentionBackend):
        return backend
    if backend is None:
        from ..envs import backend_name

        backend = backend_name()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name or an AttentionBackend, got {type(backend).__name__}")
    return get_backend(backend)


def _read_model_config(model_dir: str) -> dict[str, Any]:
    path = model_dir if os.path.isfile(model_dir) else os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"fd_config.model_config.model={model_dir!r} has no config.json")
    return read_json_file(path)  # size-capped before a byte is read, named errors


def build_from_fd_config(fd_config: Any) -> tuple[paddle.nn.Layer, AttentionPlan, bool]:
    """Build the host model of ``fd_config``: ``(GPTModel, plan, weights_already_loaded)``."""
    from ..plan import plan_from_config

    mc = _get(fd_config, "model_config")
    pc = _get(fd_config, "parallel_config")
    model_dir = _get(mc, "model")
    if not model_dir:
        raise ValueError(f"fd_config.model_config.model must name the model directory, got {model_dir!r}")
    tp_size = int(_get(pc, "tensor_parallel_size") or 1)
    tp_rank = int(_get(pc, "tensor_parallel_rank") or 0)
    raw = _read_model_config(model_dir)
    if raw.get("model_type") == "minifleet":
        from ..minifleet import build_minifleet
        from .parallel import foreign_expert_prefixes, parallel_setup, shard_minifleet

        setup = parallel_setup(fd_config)  # FastDeploy's TP group: the caches hold kv_heads // tp
        if setup.expert_parallel:  # this rank's experts; the exchange runs over FastDeploy's ep_group
            raw = {**raw, "expert_model_parallel_size": setup.ep_size}
        dtype = _get(mc, "dtype") or "float32"
        model = build_minifleet(raw, seed=int(_get(mc, "seed") or 0), dtype=dtype)
        #: weight name -> how this rank's part is cut from a full checkpoint tensor (set_state_dict)
        model.fdfleet_tp_shards = shard_minifleet(model, setup)
        #: checkpoint names of the experts other EP ranks own (set_state_dict skips them)
        model.fdfleet_foreign_prefixes = foreign_expert_prefixes(model)
        return model, plan_from_config(model.config, setup.tp_size, setup.tp_rank), False
    if importlib.util.find_spec("paddlefleet") is None:
        raise ImportError(
            f"PaddleFleetForCausalLM needs the `paddlefleet` package to build {raw.get('architectures')} "
            f"from {model_dir!r} through PaddleFormers; install paddlefleet (Paddle's package index) "
            "or serve an embedded minifleet config",
            name="paddlefleet",
        )
    from .parallel import init_paddlefleet_parallel_state, parallel_setup

    setup = parallel_setup(fd_config)
    logger.info("%s", init_paddlefleet_parallel_state(setup))  # before PaddleFleet builds its layers
    model = _build_paddlefleet(model_dir, mc, pc, tp_size)
    # the plan reads the built model's own TransformerConfig: its window convention is the host's
    return model, plan_from_config(model.config, tp_size, tp_rank), True


def _build_paddlefleet(model_dir: str, mc: Any, pc: Any, tp_size: int) -> paddle.nn.Layer:  # pragma: no cover
    """PaddleFormers' fleet-backed ``from_pretrained`` (its class builds a PaddleFleet ``GPTModel``).

    Not exercised here: ``paddlefleet`` installs only from Paddle's own index with a GPU build.
    """
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tensor_model_parallel_size = tp_size
    config.expert_model_parallel_size = int(_get(pc, "expert_parallel_size") or 1)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=_get(mc, "dtype"), convert_from_hf=True
    )
    model.eval()
    return model
