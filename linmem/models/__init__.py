"""Hugging Face models: one config and one causal LM for every mixer, the decoding cache, and the import of
flash-linear-attention checkpoints (``load_fla_checkpoint`` / ``from_fla``, ``convert_fla_checkpoint``) and of the
transformers GDN hybrids Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-Hybrid (``load_hf_hybrid``)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from linmem.layers.layer_cache import AttentionLayerCache, RecurrentLayerCache
from linmem.models.cache import LinMemCache
from linmem.models.configuration import MIXERS, LinMemConfig
from linmem.models.decoding import StaticDecoder, captured_generate
from linmem.models.fla_import import convert_fla_checkpoint, fla_config_to_linmem, from_fla, load_fla_checkpoint
from linmem.models.hf_import import hf_config_to_linmem, load_hf_hybrid
from linmem.models.modeling import LinMemForCausalLM, LinMemModel, LinMemPreTrainedModel


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` know ``model_type = "linmem"`` (run when
    this package is imported, which ``import linmem`` does on first use of a name; safe to call again)."""
    AutoConfig.register(LinMemConfig.model_type, LinMemConfig, exist_ok=True)
    AutoModel.register(LinMemConfig, LinMemModel, exist_ok=True)
    AutoModelForCausalLM.register(LinMemConfig, LinMemForCausalLM, exist_ok=True)


register_auto_classes()  # importing the models makes the Auto classes know them


__all__ = [
    "MIXERS",
    "AttentionLayerCache",
    "LinMemCache",
    "LinMemConfig",
    "LinMemForCausalLM",
    "LinMemModel",
    "LinMemPreTrainedModel",
    "RecurrentLayerCache",
    "StaticDecoder",
    "captured_generate",
    "convert_fla_checkpoint",
    "fla_config_to_linmem",
    "from_fla",
    "hf_config_to_linmem",
    "load_fla_checkpoint",
    "load_hf_hybrid",
    "register_auto_classes",
]
