"""One Hugging Face model for every linmem mixer: ``LinMemModel`` and ``LinMemForCausalLM``.

ids → ``embeddings`` → blocks (``attn_norm`` → mixer ``attn`` → residual add → ``mlp_norm`` → SwiGLU ``mlp`` →
residual add) → ``norm`` → ``lm_head``. The mixer of layer i is softmax ``Attention`` if i is in
``config.attention.layers``, else the linear memory named by ``config.mixer``. Module names follow FLA 0.6.0
(``model.embeddings``, ``model.layers.{i}.attn_norm|attn|mlp_norm|mlp``, ``model.norm``, ``lm_head``) so its
checkpoints map one to one.

Padding: ``attention_mask [B, past + T]`` (1 real, 0 padding, padding on the left) keeps padded tokens out of every
memory and every attention, and RoPE positions count real tokens only, so each row gives the logits it would
give alone. Without a cache (training, scoring) a mask with padding is unpadded instead: the real tokens are packed
into one row with ``cu_seqlens`` (padding anywhere in a row), run, and put back in place (zeros at padding).

Packed rows: ``cu_seqlens [N + 1]`` with ``input_ids [1, T]`` runs N sequences back to back, each as if alone
(``linmem.ops.packing``): memories restart from zeros, convolutions and attention stay inside each sequence,
RoPE positions restart at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from linmem.io.labels import IGNORE_INDEX
from linmem.layers.attention import Attention
from linmem.layers.conv import ShortConvolution
from linmem.layers.gated_memory import (
    GatedDeltaNet,
    GatedMemoryMixer,
    ResidualDeltaNet,
    ResidualLinearAttention,
    SimpleGatedLinearAttention,
    mamba2_decay_init,
)
from linmem.layers.gla import GatedLinearAttention
from linmem.layers.hooks import HookFn, Names, attached, caching, hook_points
from linmem.layers.mlp import SwiGLU
from linmem.layers.moe import Experts, SparseMoE
from linmem.layers.norm import GatedRMSNorm, RMSNorm
from linmem.layers.recurrent import RecurrentMixer
from linmem.models.cache import LinMemCache
from linmem.models.configuration import LinMemConfig
from linmem.ops.backend import check_backend
from linmem.ops.fused.cross_entropy import token_cross_entropy
from linmem.ops.packing import pad, sequence_positions, unpad

logger = logging.get_logger(__name__)

# transformers 5.2x renamed the outputs' `past_key_values` to `cache`; speak whichever the installed version uses
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"



@dataclass
class LinMemCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``token_losses [B, T-1]``: each target's cross entropy (0 where ignored),
    given whenever ``labels`` are (also when the loss is computed in chunks, ``loss_chunk_tokens``, where ``logits``
    are None)."""

    token_losses: torch.FloatTensor | None = None


def chunked_token_losses(hidden_states: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """Cross entropy of ``head(hidden_states)`` against ``targets`` without the whole ``[N, vocab]`` logits ever
    existing: ``hidden_states [N, D]`` and ``targets [N]`` are cut into pieces of ``chunk_tokens`` tokens, and each
    piece's head and loss run under activation checkpointing, so that only one piece's logits live at a time (in
    the forward pass and again when its backward recomputes them). Returns ``[N]`` losses in at least float32 (0
    where the target is ``IGNORE_INDEX``); the values and gradients are those of the unchunked computation."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    if hidden_states.dim() != 2 or targets.shape != hidden_states.shape[:1]:
        raise ValueError(f"hidden_states must be [N, D] and targets [N]; got {list(hidden_states.shape)} and "
                         f"{list(targets.shape)}")

    def piece_losses(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(head(hidden), target)

    remember = torch.is_grad_enabled()
    pieces = []
    for start in range(0, hidden_states.shape[0], chunk_tokens):
        hidden, target = hidden_states[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        pieces.append(checkpoint(piece_losses, hidden, target, use_reentrant=False) if remember
                      else piece_losses(hidden, target))
    return torch.cat(pieces) if pieces else hidden_states.new_zeros(0, dtype=torch.float32)


GATED_MEMORY_MIXERS = {
    "sgla": SimpleGatedLinearAttention,
    "gdn": GatedDeltaNet,
    "rla": ResidualLinearAttention,
    "rdn": ResidualDeltaNet,
}


def build_mixer(config: LinMemConfig, layer_idx: int) -> nn.Module:
    """The mixer of layer ``layer_idx``: ``Attention`` for hybrid layers, else the config's linear memory."""
    if layer_idx in config.attention.layers:
        return Attention(config.hidden_size, **config.attention.layer_arguments(), norm_eps=config.norm_eps,
                         layer_idx=layer_idx, zero_centered_norms=config.norm_zero_centered)
    key_width = config.num_heads * config.head_dim
    conv = dict(use_short_conv=config.use_short_conv, conv_size=config.conv_size, conv_bias=config.conv_bias)
    norm_eps = config.norm_eps if config.mixer_norm_eps is None else config.mixer_norm_eps
    common = dict(**conv, norm_eps=norm_eps, backend=config.backend, layer_idx=layer_idx)
    if config.mixer == "gla":
        return GatedLinearAttention(
            config.hidden_size, config.num_heads, expand_k=key_width / config.hidden_size,
            expand_v=key_width * config.expand_v / config.hidden_size, num_kv_heads=config.num_kv_heads,
            gate_logit_normalizer=config.gate_logit_normalizer, gate_low_rank_dim=config.gate_low_rank_dim,
            clamp_min=config.clamp_min, **common,
        )
    return GATED_MEMORY_MIXERS[config.mixer](
        config.hidden_size, config.num_heads, config.head_dim, expand_v=config.expand_v, gamma=config.gamma,
        residual_target=config.residual_target, clip=config.clip, fit_history=config.fit_history,
        output_gates=config.output_gates, num_key_heads=config.num_key_heads,
        allow_neg_eigval=config.allow_neg_eigval, **common,
    )


def build_mlp(config: LinMemConfig, layer_idx: int) -> nn.Module:
    """The feed-forward block of layer ``layer_idx``: ``SparseMoE`` where the config routes experts, else SwiGLU."""
    if config.moe.routes(layer_idx):
        return SparseMoE(config.hidden_size, **config.moe.layer_arguments())
    return SwiGLU(config.hidden_size, config.hidden_ratio, config.intermediate_size)


class LinMemBlock(GradientCheckpointingLayer):
    """Pre-norm block: ``h + attn(attn_norm(h))``, then ``h + mlp(mlp_norm(h))``; ``[B, T, D] → [B, T, D]``. With
    the config's ``"post"`` norm placement: ``h + attn_norm(attn(h))``, then ``h + mlp_norm(mlp(h))``. The MLP is
    ``SparseMoE`` in the config's expert layers.

    A ``GradientCheckpointingLayer``: after ``model.gradient_checkpointing_enable()`` a training forward with
    gradients keeps only the block's inputs and recomputes the block in the backward pass (its ``cache``, passed by
    keyword, is dropped there: a recomputation must not write the state twice).

    ``output_attentions=True`` returns ``(hidden_states, weights)``: the softmax weights ``[B, H, T, past + T]`` of
    an attention layer, None for a linear-memory layer (it has no attention matrix)."""

    def __init__(self, config: LinMemConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        centered = config.norm_zero_centered
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, zero_centered=centered)
        self.attn = build_mixer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, zero_centered=centered)
        self.mlp = build_mlp(config, layer_idx)
        placement = config.attention.norm_placement if layer_idx in config.attention.layers else \
            config.norm_placement
        self.post_norm = placement == "post"  # h + norm(f(h)) (OLMo's attention blocks) instead of h + f(norm(h))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None,
                cu_seqlens: torch.Tensor | None = None,
                output_attentions: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        mixer_inputs = dict(attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        if cu_seqlens is not None:
            mixer_inputs["cu_seqlens"] = cu_seqlens
        weights_wanted = output_attentions and isinstance(self.attn, Attention)
        if weights_wanted:
            mixer_inputs["output_attentions"] = True
        # under autocast the norms hand the projections their inputs already in the autocast dtype
        activations = torch.get_autocast_dtype(hidden_states.device.type) \
            if torch.is_autocast_enabled(hidden_states.device.type) else None
        normed = hidden_states if self.post_norm else self.attn_norm(hidden_states, out_dtype=activations)
        mixed = self.attn(normed, **mixer_inputs)
        mixed, weights = mixed if weights_wanted else (mixed, None)
        if self.post_norm:
            hidden_states = hidden_states + self.attn_norm(mixed)
            hidden_states = hidden_states + self.mlp_norm(self.mlp(hidden_states))
        else:  # the residual add fused into the MLP's norm: h = h + mixed, normed = mlp_norm(h)
            normed, hidden_states = self.mlp_norm(mixed, residual=hidden_states, out_dtype=activations)
            hidden_states = hidden_states + self.mlp(normed)
        return (hidden_states, weights) if output_attentions else hidden_states


class LinMemPreTrainedModel(PreTrainedModel):
    """Weights init and the Hugging Face plumbing shared by ``LinMemModel`` and ``LinMemForCausalLM``."""

    config_class = LinMemConfig
    base_model_prefix = "model"
    _no_split_modules = ["LinMemBlock"]
    _input_embed_layer = "embeddings"
    _is_stateful = True  # a recurrent state cannot be rolled back: no assisted decoding
    supports_gradient_checkpointing = True  # per block (LinMemBlock is a GradientCheckpointingLayer)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, ``initializer_range``) for linear, conv and embedding weights, zero biases, unit norm weights,
        Mamba2 / FLA decay parameters (``A_log``, ``dt_bias``). Loaded weights are left alone."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, ShortConvolution)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm) and module.zero_centered:
            init.zeros_(module.weight)  # the scale is 1 + weight
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, GatedMemoryMixer):
            A_log, dt_bias = mamba2_decay_init(module.A_log.shape[0], module.A_log.device)
            init.copy_(module.A_log, A_log)
            init.copy_(module.dt_bias, dt_bias)

    def set_backend(self, backend: str) -> LinMemPreTrainedModel:
        """Run every linear-memory mixer on ``backend`` (one of ``linmem.ops.BACKENDS``, checked here) from the next
        forward on, and record it in ``config.backend``; a run-time choice that nothing saved keeps. Returns the
        model."""
        check_backend(backend)
        for module in self.modules():
            if isinstance(module, RecurrentMixer):
                module.backend = backend
        self.config.backend = backend
        return self

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own LinMemCache

    def hook_names(self) -> list[str]:
        """Every hook point's name, its module path (``model.layers.3.attn.hook_state`` in a
        ``LinMemForCausalLM``), layer by layer (``linmem.layers.hooks``)."""
        return list(hook_points(self))

    def run_with_cache(self, *args, names: Names = None, **kwargs) -> tuple[object, dict[str, torch.Tensor]]:
        """``(outputs, {name: tensor})``: the model's forward on ``args`` / ``kwargs`` and the tensor each hook point
        that ``names`` selects carried in it (None: every point; a name, a glob like ``"*.hook_state"``, a dotted
        prefix like ``"model.layers.3"``, a list of those, or a predicate on the name). The tensors keep their
        autograd graph. An unknown name is a ``ValueError`` listing close matches."""
        with caching(self, names) as cache:
            outputs = self(*args, **kwargs)
        return outputs, cache

    def run_with_hooks(self, *args, hooks: Sequence[tuple[Names, HookFn]] = (), **kwargs) -> object:
        """The model's forward on ``args`` / ``kwargs`` with ``hooks``, ``(names, fn)`` pairs, on the hook points:
        ``fn(tensor, name)`` returns the tensor that replaces the point's for the rest of the run, or None to keep
        it (edited in place or not). ``names`` selects points as in ``run_with_cache``. The hooks are removed when
        the call returns or raises."""
        with attached(self, hooks):
            return self(*args, **kwargs)


def pad_attention_weights(packed: torch.Tensor, indices: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Attention weights ``[1, H, N, N]`` of the real tokens of an unpadded batch (``indices`` from ``unpad``) back
    to ``[B, H, T, T]``: each row's weights at its tokens' places, 0 at padded queries and keys."""
    rows, columns = indices // length, indices % length
    query, key = (rows[:, None] == rows[None, :]).nonzero(as_tuple=True)  # pairs of real tokens of one row
    out = packed.new_zeros(batch, length, length, packed.shape[1])
    out[rows[query], columns[query], columns[key]] = packed[0, :, query, key].transpose(0, 1)
    return out.permute(0, 3, 1, 2)


@dataclass
class BatchLayout:
    """The batch as the blocks see it: ``hidden_states [B, T, D]``, its ``attention_mask``, ``position_ids`` and
    ``cu_seqlens``; after ``unpad``, the real tokens of a padded batch in one packed row ``[1, N, D]`` and
    ``padded = (indices, B, T)``, which ``restore`` uses to put the outputs back in place."""

    hidden_states: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    padded: tuple[torch.Tensor, int, int] | None = None

    def unpad(self) -> None:
        """Pack the real tokens (``attention_mask`` 1; padding anywhere in a row) into one row with
        ``cu_seqlens``, given positions along with them; the mask is then dropped."""
        batch, length = self.hidden_states.shape[:2]
        indices, self.cu_seqlens = unpad(self.attention_mask)
        self.hidden_states = self.hidden_states.flatten(0, 1)[indices][None]
        if self.position_ids is not None:
            self.position_ids = self.position_ids.flatten()[indices][None]
        self.attention_mask, self.padded = None, (indices, batch, length)

    def restore(self, hidden_states: torch.Tensor, all_hidden: list | None,
                all_weights: list | None) -> tuple[torch.Tensor, list | None, list | None]:
        """The outputs of an unpadded batch back at their tokens' places: hidden states ``[B, T, D]`` (zeros at
        padding) and attention weights ``[B, H, T, T]`` (0 at padded queries and keys)."""
        hidden_states = pad(hidden_states, *self.padded)
        all_hidden = None if all_hidden is None else [pad(h, *self.padded) for h in all_hidden]
        all_weights = None if all_weights is None else [
            None if w is None else pad_attention_weights(w, *self.padded) for w in all_weights]
        return hidden_states, all_hidden, all_weights


class LinMemModel(LinMemPreTrainedModel):
    """The backbone: ``input_ids [B, T]`` → final hidden states ``[B, T, D]`` (after ``norm``).

    ``output_attentions=True`` (or ``config.output_attentions``) returns ``attentions``, one entry per layer: the
    softmax weights ``[B, H, T, past + T]`` of each attention layer of a hybrid, and None for each linear-memory
    layer, which has no attention matrix (its state is read through the hook points, ``linmem.layers.recurrent``).
    A model without attention layers gives a tuple of None. Weights are computed explicitly (O(T²) memory), so ask
    for them only where they are read."""

    def __init__(self, config: LinMemConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList([LinMemBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps, zero_centered=config.norm_zero_centered)
        self.gradient_checkpointing = False  # set with the blocks' flags by gradient_checkpointing_enable()
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LinMemCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LinMemCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Run the blocks.

        Args:
            input_ids: ``[B, T]`` (or ``inputs_embeds [B, T, D]``).
            attention_mask: ``[B, past + T]``, 1 real, 0 padding (left padding); None: all real. Without a cache
                and ``use_cache`` a mask with padding is unpadded into ``cu_seqlens`` (padding anywhere).
            position_ids: RoPE positions ``[B, T]``; None: real tokens counted from the mask (or from the cache;
                with ``cu_seqlens``: from each sequence's start).
            cu_seqlens: ``[N + 1]`` boundaries of N sequences packed in one row (B == 1; no cache, no mask).
            cache: a ``LinMemCache`` to continue from (``past_key_values`` is accepted as an alias); with
                ``use_cache`` and no cache a new one is made. It is updated in place and returned as the output's
                ``cache`` (``past_key_values`` under transformers < 5.2x, see ``CACHE_FIELD``).
            output_attentions: return ``attentions`` (see the class docstring); None: ``config.output_attentions``.
                Padded queries and keys of an unpadded batch get weight 0.
        """
        cache = cache if cache is not None else past_key_values
        output_attentions = self._attentions_wanted(output_attentions)
        use_cache = self._cache_wanted(cache, use_cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, D]")
        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        layout = self._lay_out(hidden_states, attention_mask, position_ids, cu_seqlens, cache, use_cache)
        if use_cache and cache is None:
            cache = LinMemCache.from_config(self.config)
        past = 0 if cache is None else cache.get_seq_length()
        layout.position_ids = self._positions(layout.attention_mask, layout.position_ids, past, layout.hidden_states)
        hidden_states, all_hidden, all_weights = self._run_blocks(layout, cache, output_hidden_states,
                                                                  output_attentions)
        if layout.padded is not None:
            hidden_states, all_hidden, all_weights = layout.restore(hidden_states, all_hidden, all_weights)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache if use_cache else None},
                                       hidden_states=None if all_hidden is None else tuple(all_hidden),
                                       attentions=None if all_weights is None else tuple(all_weights))

    def _attentions_wanted(self, output_attentions: bool | None) -> bool:
        """``output_attentions``, or the config's when None; a model without attention layers warns that every entry
        will be None."""
        if output_attentions is None:
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        if output_attentions and not self.config.attention.layers:
            logger.warning_once("output_attentions: this model has no softmax attention layers; every entry of "
                                "`attentions` is None (read the linear memories through their hook points)")
        return bool(output_attentions)

    def _cache_wanted(self, cache: LinMemCache | None, use_cache: bool | None) -> bool:
        """Whether this forward returns a cache (None: the config's ``use_cache`` outside training). A training
        forward under gradient checkpointing recomputes the blocks in the backward pass, where a cache would be
        written a second time: it refuses a cache and runs without filling one."""
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if cache is not None:
                raise ValueError("cache: a training forward under gradient checkpointing cannot continue or fill a "
                                 "cache; pass cache=None (or call model.eval() / torch.no_grad())")
            if use_cache:
                logger.warning_once("use_cache=True is incompatible with gradient checkpointing in training; "
                                    "running with use_cache=False")
                use_cache = False
        return bool(use_cache)

    def _lay_out(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None, cache: LinMemCache | None,
                 use_cache: bool) -> BatchLayout:
        """How the batch runs through the blocks. Without a cache a mask with padding is unpadded: the real tokens
        of ``[B, T, D]`` go into one packed row ``[1, N, D]`` with ``cu_seqlens`` (a mask without padding is
        dropped, so the layers take their unmasked paths). Packed sequences (given or unpadded) take no cache and
        no mask, and count their positions from each sequence's start unless given."""
        layout = BatchLayout(hidden_states, attention_mask, position_ids, cu_seqlens)
        if cu_seqlens is None and attention_mask is not None and cache is None and not use_cache:
            self._positions(attention_mask, None, 0, hidden_states)  # checks the mask's shape
            if bool(attention_mask.all()):
                layout.attention_mask = None
            else:
                layout.unpad()
        if layout.cu_seqlens is not None:
            if cache is not None or use_cache or layout.attention_mask is not None:
                raise ValueError("cu_seqlens: packed sequences take no cache, use_cache=False and no attention_mask")
            if layout.position_ids is None:
                layout.position_ids = sequence_positions(layout.cu_seqlens, layout.hidden_states.shape[1])[None]
        return layout

    def _run_blocks(self, layout: BatchLayout, cache: LinMemCache | None, output_hidden_states: bool | None,
                    output_attentions: bool) -> tuple[torch.Tensor, list | None, list | None]:
        """``(hidden states after the final norm, each block's input and the final states when
        output_hidden_states, each layer's attention weights when output_attentions)``."""
        hidden_states = layout.hidden_states
        all_hidden = [] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for i, block in enumerate(self.layers):
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            hidden_states = block(hidden_states, layout.attention_mask, layout.position_ids,
                                  cache=None if cache is None else cache.layers[i], cu_seqlens=layout.cu_seqlens,
                                  output_attentions=output_attentions)
            if all_weights is not None:
                hidden_states, weights = hidden_states
                all_weights.append(weights)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        return hidden_states, all_hidden, all_weights

    @staticmethod
    def _positions(attention_mask, position_ids, past: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """RoPE positions ``[B, T]``: given, or real tokens counted along the mask (padding at 0), or
        ``past, past + 1, ...``. Also checks the mask covers ``past + T`` tokens."""
        batch, length = hidden_states.shape[:2]
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, past + length):
            raise ValueError(f"attention_mask must be [B, past + T] = [{batch}, {past + length}] (the cached and "
                             f"the new tokens); got {list(attention_mask.shape)}")
        if position_ids is not None:
            return position_ids
        if attention_mask is not None:
            return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
        return torch.arange(past, past + length, device=hidden_states.device).expand(batch, length)


class LinMemForCausalLM(LinMemPreTrainedModel, GenerationMixin):
    """``LinMemModel`` plus ``lm_head`` (tied to ``model.embeddings`` when ``tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: LinMemConfig):
        super().__init__(config)
        self.model = LinMemModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LinMemCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: LinMemCache | None = None,
        loss_chunk_tokens: int = 0,
        cu_seqlens: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> LinMemCausalLMOutput:
        """Logits ``[B, T, vocab]`` (the last ``logits_to_keep`` positions if > 0) and, with ``labels [B, T]``,
        the mean next-token cross entropy (labels shifted inside; -100 is ignored). Other arguments as in
        ``LinMemModel.forward`` (``output_attentions``: the attention layers' weights, None for linear-memory
        layers; see ``LinMemModel``).

        ``loss_chunk_tokens > 0`` (with ``labels``): the head and the loss run over that many tokens at a time under
        activation checkpointing (``chunked_token_losses``), so a large vocabulary's float32 logits never exist
        whole; ``logits`` is then None, and ``token_losses [B, T-1]`` holds each target's loss (0 where ignored)
        for callers that weight them. Loss and gradients equal the unchunked ones.

        ``cu_seqlens [N + 1]`` (``input_ids [1, T]``): N packed sequences; the labels are shifted over the whole
        row, so set the label of each sequence's first token to -100 to not predict it from the one before."""
        if loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0 (0: logits in one piece); got {loss_chunk_tokens}")
        outputs = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                             output_hidden_states, past_key_values=past_key_values, cu_seqlens=cu_seqlens,
                             output_attentions=output_attentions)
        hidden_states = outputs.last_hidden_state
        extra = {CACHE_FIELD: getattr(outputs, CACHE_FIELD), "hidden_states": outputs.hidden_states,
                 "attentions": outputs.attentions}
        if labels is not None and loss_chunk_tokens:
            targets = labels[:, 1:]
            losses = chunked_token_losses(hidden_states[:, :-1].flatten(0, 1), self.lm_head, targets.flatten(),
                                          loss_chunk_tokens).view(targets.shape)
            loss = losses.sum() / (targets != IGNORE_INDEX).sum()
            return LinMemCausalLMOutput(loss=loss, logits=None, token_losses=losses, **extra)
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)
        loss = losses = None
        if labels is not None:
            # every position's logits against the next label (the last predicts nothing): no copy of the logits
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            losses = token_cross_entropy(logits.flatten(0, 1), targets.flatten()).view(targets.shape)
            loss = losses.sum() / (targets != IGNORE_INDEX).sum()
            losses = losses[:, :-1]
        return LinMemCausalLMOutput(loss=loss, logits=logits, token_losses=losses, **extra)
