"""The names every serving module agrees on, and the routing rule: one home below all of them.

``registration`` registers these names with FastDeploy; ``model``, ``pretrained``, the scheduler hook
(``kv_recycling/scheduler.py``) and the model-runner hook (``model_runner/runner.py``) answer to them.
This module imports nothing from ``serving`` (``tests/test_serving_imports.py`` checks that the
serving modules import one another without a cycle), so each of them can import it at the top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..envs import MODEL_IMPL_VAR, model_impl_is_paddlefleet

#: the architecture this plugin registers with FastDeploy (``--model-impl paddlefleet`` serves it)
ARCHITECTURE = "PaddleFleetForCausalLM"
#: what FastDeploy's loaders look up when ``load_config.dynamic_load_weight`` (RL) is on
RL_ARCHITECTURE = ARCHITECTURE + "RL"
#: the value of FastDeploy's ``--model-impl`` that routes a model to this plugin
MODEL_IMPL = "paddlefleet"
#: where FastDeploy's registry finds the model classes: ``MODULE_PATH.MODULE_NAME``
MODULE_PATH = "fastdeploy_paddlefleet.serving"
MODULE_NAME = "model"
#: the environment variable that carries the choice to FastDeploy's worker processes
MODEL_IMPL_ENV = MODEL_IMPL_VAR


def wants_paddlefleet(model_config: Any) -> bool:
    """The routing rule: whether ``model_config`` (FastDeploy's ``ModelConfig`` or a mapping) asks for
    ``--model-impl paddlefleet``, directly or through ``FDFLEET_MODEL_IMPL`` (the engine's choice as its
    worker processes inherit it)."""
    impl = model_config.get("model_impl") if isinstance(model_config, Mapping) else None
    if impl is None and model_config is not None:
        impl = getattr(model_config, "model_impl", None)
    if str(getattr(impl, "value", impl) or "").strip().lower() == MODEL_IMPL:
        return True
    return model_impl_is_paddlefleet()


__all__ = [
    "ARCHITECTURE",
    "MODEL_IMPL",
    "MODEL_IMPL_ENV",
    "MODULE_NAME",
    "MODULE_PATH",
    "RL_ARCHITECTURE",
    "wants_paddlefleet",
]
