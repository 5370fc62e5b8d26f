"""The per-layer attention plan (stdlib only): data model and config reader."""

from .config import load_config, plan_from_config
from .layer import AttentionPlan, LayerAttention, MLADims

__all__ = ["AttentionPlan", "LayerAttention", "MLADims", "load_config", "plan_from_config"]
