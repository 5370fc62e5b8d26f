"""What FastDeploy's v0 loader looks up: ``ModelRegistry.get_pretrain_cls("PaddleFleetForCausalLM")``.

The v0 loader (``--load-choices default``, ``DefaultModelLoader``; FastDeploy's worker also
falls back to it from ``default_v1`` on platforms other than GPU/XPU/..., for pre-sliced
``rank*`` checkpoints, ``FD_MOE_BACKEND=marlin`` and some quantizations) reads the checkpoint
through PaddleFormers' ``load_tp_checkpoint(folder, cls, config)`` and hands the dict to
``model.set_state_dict``. For a TP size above one it asks ``cls`` how to split each tensor;
this class answers "not at all": every tensor arrives full size and
``PaddleFleetForCausalLM.set_state_dict`` keeps this rank's part itself (the same cut as on
the v1 path), while pre-sliced ``rank*`` checkpoints arrive already cut and pass unchanged.
"""

from __future__ import annotations

from typing import Any

from paddleformers.transformers import PretrainedConfig, PretrainedModel

from .names import ARCHITECTURE


class PaddleFleetPretrainedModel(PretrainedModel):
    """Checkpoint metadata only (never instantiated): no tensor-parallel split actions."""

    config_class = PretrainedConfig
    base_model_prefix = "model"

    @classmethod
    def arch_name(cls) -> str:
        return ARCHITECTURE

    @classmethod
    def get_tensor_parallel_convert_actions(
        cls,
        config: Any,
        loaded_state_dict_keys: Any = None,
        is_split: bool = True,
        ignore_error: bool = False,
    ) -> dict[str, Any]:
        """No split: the model class cuts full-size tensors itself (``parallel.shard_minifleet``)."""
        return {}

    @classmethod
    def _get_tensor_parallel_mappings(cls, config: Any, is_split: bool = True) -> dict[str, Any]:
        return {}
