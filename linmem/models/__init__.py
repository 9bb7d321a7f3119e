"""Hugging Face models: one config and one causal LM for every mixer, and the decoding cache."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from linmem.models.cache import AttentionLayerCache, LinMemCache, RecurrentLayerCache
from linmem.models.configuration import MIXERS, LinMemConfig
from linmem.models.modeling import LinMemForCausalLM, LinMemModel, LinMemPreTrainedModel


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` know ``model_type = "linmem"`` (run on
    ``import linmem``; safe to call again)."""
    AutoConfig.register(LinMemConfig.model_type, LinMemConfig, exist_ok=True)
    AutoModel.register(LinMemConfig, LinMemModel, exist_ok=True)
    AutoModelForCausalLM.register(LinMemConfig, LinMemForCausalLM, exist_ok=True)


__all__ = [
    "MIXERS",
    "AttentionLayerCache",
    "LinMemCache",
    "LinMemConfig",
    "LinMemForCausalLM",
    "LinMemModel",
    "LinMemPreTrainedModel",
    "RecurrentLayerCache",
    "register_auto_classes",
]
