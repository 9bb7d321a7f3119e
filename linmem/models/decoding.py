"""Decoding as one captured CUDA graph: ``captured_generate`` and the ``StaticDecoder`` behind it.

``model.generate()`` runs every new token as a Python forward: hundreds of small kernels launched one by one, so a
batch-1 decode of a 340M model is bound by launches, not by the GPU. Here the prompt runs once as a normal forward
with a ``LinMemCache`` (the prefill), and every later token runs the model's own one-token forward (the mixers'
``linear_memory_step`` path) on static buffers: the input token, each layer's states ``S`` (and ``R``) and conv
windows live at fixed addresses, the step writes the new ones back into them in place and chooses the next token
there too. On CUDA that step is captured once in a ``torch.cuda.CUDAGraph`` and replayed per token: one launch,
no host synchronisation (end-of-sequence is looked at every ``EOS_CHECK_EVERY`` tokens). Elsewhere (CPU tests) the
same step runs uncaptured, so both paths compute the same tokens.

Tokens are chosen like transformers' ``generate``: greedy is ``argmax``; sampling divides the logits by
``temperature``, keeps the ``top_k`` largest and the smallest set of most likely tokens whose probability reaches
``top_p``, and draws from what is left by the exponential race (``argmax(log p − log E)``, ``E ~ Exp(1)`` drawn
from ``generator``), which samples ``p`` exactly and never reads a value back to the host. Rows that produced an
end-of-sequence token continue with the pad token, and the output ends where every row has ended, as in
transformers (the pad id is the generation config's, else the first end-of-sequence id).

What the captured step cannot do, it refuses: softmax-attention layers (hybrids; their KV cache grows every token)
and mixture-of-experts MLPs (their routing reads expert ids back to the host) are a ``ValueError`` naming
``model.generate``; hooks (which would fire once, at capture, not per token) are refused when capturing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from linmem.layers.layer_cache import RecurrentLayerCache
from linmem.models.cache import LinMemCache
from linmem.models.modeling import LinMemForCausalLM

# tokens between two looks (host synchronisations) at whether every row has ended
EOS_CHECK_EVERY = 32
# eager steps run before capture (on a side stream, as torch.cuda.graphs asks): they load the kernels and size
# the allocator's pools, so that the capture records only the kernels themselves
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from ``logits [B, vocab]``: greedy (``do_sample=False``: argmax; the other
    fields are then unused) or a draw at ``temperature`` (> 0) from the ``top_k`` (0: all) most likely tokens
    and the nucleus of probability ``top_p`` (in (0, 1]; 1: all)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool; got {self.do_sample!r}")
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling; got {self.temperature} (greedy decoding is "
                             f"do_sample=False)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: every token); got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: every token); got {self.top_p}")

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, vocab]`` → float32 log-weights of the tokens a draw may pick: divided by the temperature,
        ``-inf`` outside the top-k and the top-p nucleus (the most likely token always stays)."""
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth_largest = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth_largest, float("-inf"))
        if self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # probability of the more likely tokens
            outside = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before >= self.top_p)
            scores = scores.masked_fill(outside, float("-inf"))
        return scores

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The next token of each row, ``[B]`` (int64), from ``logits [B, vocab]``; draws from ``generator``."""
        if not self.do_sample:
            return logits.argmax(-1)
        scores = self.scores(logits)
        # exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p; E is kept above 0 so that log E is finite
        noise = torch.empty_like(scores).exponential_(generator=generator).clamp_min_(torch.finfo(scores.dtype).tiny)
        return (scores - noise.log()).argmax(-1)


@dataclass
class _LayerBuffers:
    """The static state of one linear-memory layer (shapes as in ``RecurrentLayerCache``)."""

    base: torch.Tensor
    residual: torch.Tensor | None
    conv: dict[str, torch.Tensor]

    @classmethod
    def like(cls, layer: RecurrentLayerCache) -> _LayerBuffers:
        zeros = torch.zeros_like
        return cls(zeros(layer.base_state), None if layer.residual_state is None else zeros(layer.residual_state),
                   {name: zeros(state) for name, state in layer.conv_states.items()})

    def lend_to(self, layer: RecurrentLayerCache) -> None:
        """Make ``layer`` read these buffers (the step then replaces its references with new tensors)."""
        layer.base_state, layer.residual_state = self.base, self.residual
        layer.conv_states = dict(self.conv)

    def take_from(self, layer: RecurrentLayerCache) -> None:
        """Copy ``layer``'s states into these buffers, in place."""
        self.base.copy_(layer.base_state)
        if self.residual is not None:
            self.residual.copy_(layer.residual_state)
        for name, buffer in self.conv.items():
            buffer.copy_(layer.conv_states[name])


def check_decodable(model: nn.Module) -> None:
    """A ``ValueError`` unless ``model`` is a ``LinMemForCausalLM`` whose every layer is a linear memory with a
    plain MLP (what the static step covers)."""
    if not isinstance(model, LinMemForCausalLM):
        raise ValueError(f"captured decoding runs a LinMemForCausalLM; got {type(model).__name__}")
    config = model.config
    if config.attention.layers:
        raise ValueError(f"captured decoding covers linear-memory layers only; layers "
                         f"{list(config.attention.layers)} are softmax attention, whose KV cache grows every token: "
                         f"use model.generate(...)")
    moe = [i for i in range(config.num_hidden_layers) if config.moe.routes(i)]
    if moe:
        raise ValueError(f"captured decoding cannot route mixture-of-experts MLPs (layers {moe}: their routing reads "
                         f"the chosen experts back to the host every token): use model.generate(...)")


def hooks_attached(model: nn.Module) -> bool:
    """Whether any forward hook or pre-hook would fire in ``model`` (its own modules', or a global one)."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def check_prompt(input_ids, max_new_tokens, attention_mask=None, batch_size: int | None = None,
                 device: torch.device | None = None) -> None:
    """A ``ValueError`` unless ``input_ids`` is int64 ``[B, T ≥ 1]`` (B = ``batch_size`` and on ``device`` where
    given), ``max_new_tokens`` an int ≥ 1 and ``attention_mask`` None or a 0/1 ``[B, T]`` padded on the left."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (f"{input_ids.dtype} {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids must be an int64 tensor [B, T]; got {got}")
    batch, length = input_ids.shape
    if length < 1 or batch < 1 or batch_size not in (None, batch):
        wanted = "B >= 1" if batch_size is None else f"B = {batch_size} (the decoder's batch size)"
        raise ValueError(f"input_ids must be [B, T] with {wanted} and T >= 1; got {list(input_ids.shape)}")
    if device is not None and input_ids.device != device:
        raise ValueError(f"input_ids are on {input_ids.device}, the model on {device}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
        got = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be [B, T] = {[batch, length]}; got {got}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens) only")
    if not bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all()):
        raise ValueError("attention_mask must pad on the left (no real token before a padded one in a row)")


def _token_ids(ids, name: str) -> list[int]:
    """``ids`` (None, an int or a sequence of ints) as a list."""
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{name} must be a token id (int >= 0) or a list of them; got {ids!r}")
    return ids


class StaticDecoder:
    """Static buffers and the captured one-token step of one model at one batch size and one way of choosing tokens;
    ``generate`` may be called any number of times with prompts of that batch size.

    Args:
        model: a ``LinMemForCausalLM`` without attention or MoE layers (``check_decodable``), in the dtype and on
            the device it decodes in; its parameters must stay the same tensors while the decoder is used (a graph
            reads them by address: build a new decoder after ``model.to(...)`` or a load that replaces them).
        batch_size: B, the rows of every prompt.
        sampling: how tokens are chosen (``Sampling``; None: greedy). generator: the random source of sampling
            (None: the default generator of the model's device); it must be on the model's device.
        eos_token_id: an id or a list of ids that end a row (None: the model's ``generation_config``'s; ``[]``:
            none). pad_token_id: what ended rows continue with (None: the generation config's, else the first
            end-of-sequence id).
        capture: True: capture the step in a CUDA graph (CUDA only); False: run it uncaptured; None: capture on
            CUDA. The graph is captured here, under the autocast state in force (with autocast's weight cache off).
    """

    def __init__(self, model: nn.Module, batch_size: int, sampling: Sampling | None = None, *,
                 generator: torch.Generator | None = None, eos_token_id=None, pad_token_id: int | None = None,
                 capture: bool | None = None):
        check_decodable(model)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling; got {type(sampling).__name__}")
        device = model.lm_head.weight.device
        if capture is None:
            capture = device.type == "cuda"
        if capture and device.type != "cuda":
            raise ValueError(f"capture=True needs a model on CUDA (CUDA graphs); this one is on {device.type}: "
                             f"pass capture=False or None")
        if capture and hooks_attached(model):
            raise ValueError("the model has forward hooks: a captured step would run them once, at capture, not per "
                             "token; remove them, or decode uncaptured (capture=False, or model.generate)")
        if generator is not None and torch.device(generator.device).type != device.type:
            raise ValueError(f"generator is on {generator.device}, the model on {device}: sampling draws on the "
                             f"model's device")
        config = model.generation_config
        self.eos_token_ids = _token_ids(config.eos_token_id if eos_token_id is None else eos_token_id,
                                        "eos_token_id")
        pad = config.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None and self.eos_token_ids:
            pad = self.eos_token_ids[0]
        self.pad_token_id = None if pad is None else _token_ids(pad, "pad_token_id")[0]
        self.model, self.batch_size, self.sampling, self.generator = model, batch_size, sampling, generator
        self.device, self.captured = device, bool(capture)
        self.steps_run = 0  # replays of the step in the last generate() (for tests and benchmarks)

        self._token = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        self._cache = LinMemCache.from_config(model.config)
        with torch.no_grad():
            model(self._token[:, None], cache=self._cache, use_cache=True)  # one step from zeros: the state shapes
        self._buffers = [_LayerBuffers.like(layer) for layer in self._cache.layers]
        self._graph = self._capture() if capture else None

    def generate(self, input_ids: torch.LongTensor, max_new_tokens: int,
                 attention_mask: torch.Tensor | None = None) -> torch.LongTensor:
        """``input_ids [B, T]`` → ``[B, T + n]``: the prompt and ``n ≤ max_new_tokens`` new tokens (fewer when
        every row has ended). ``attention_mask [B, T]``: 1 real, 0 padding, padding on the left."""
        check_prompt(input_ids, max_new_tokens, attention_mask, self.batch_size, self.device)
        if self.captured and hooks_attached(self.model):
            raise ValueError("the model has forward hooks, which a captured step does not run: remove them")
        with torch.no_grad(), self._on_device():
            prefill = LinMemCache.from_config(self.model.config)
            logits = self.model(input_ids, attention_mask=attention_mask, cache=prefill, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
            for buffers, layer in zip(self._buffers, prefill.layers):
                buffers.take_from(layer)
            self._finished.zero_()
            self._token.copy_(self._choose(logits, self.generator))
            tokens = torch.empty(self.batch_size, max_new_tokens, dtype=torch.long, device=self.device)
            tokens[:, 0] = self._token
            made = 1
            while made < max_new_tokens:
                if self._graph is not None:
                    self._graph.replay()
                else:
                    self._step(self.generator)
                tokens[:, made] = self._token
                made += 1
                if self._eos.numel() and made % EOS_CHECK_EVERY == 0 and bool(self._finished.all()):
                    break
            self.steps_run = made - 1
            tokens = tokens[:, :self._length_until_all_ended(tokens[:, :made])]
        return torch.cat([input_ids, tokens], dim=1)

    def _on_device(self):
        """Make the model's GPU the current one (graphs capture and replay on the current device's stream)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _length_until_all_ended(self, tokens: torch.Tensor) -> int:
        """How many of the new ``tokens [B, n]`` to keep: up to the step where the last row ended, else all."""
        if not self._eos.numel():
            return tokens.shape[1]
        ended = torch.isin(tokens, self._eos)
        if not bool(ended.any(1).all()):
            return tokens.shape[1]
        return int(ended.long().argmax(1).max()) + 1  # argmax of 0/1: each row's first end

    def _choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The next tokens ``[B]``: chosen by ``sampling``, the pad id where a row has ended; marks rows ending."""
        token = self.sampling.choose(logits, generator)
        if self._eos.numel():
            token = torch.where(self._finished, self.pad_token_id, token)
            self._finished |= torch.isin(token, self._eos)
        return token

    def _step(self, generator: torch.Generator | None) -> None:
        """One token, in place: reads ``_token`` and the layer buffers, writes the next token and states there.
        Everything here is recorded by the capture; nothing reads a value back to the host."""
        for buffers, layer in zip(self._buffers, self._cache.layers):
            buffers.lend_to(layer)
        logits = self.model(self._token[:, None], cache=self._cache, use_cache=True).logits[:, -1]
        for buffers, layer in zip(self._buffers, self._cache.layers):
            buffers.take_from(layer)
        self._token.copy_(self._choose(logits, generator))

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream, then capture it. The warm-up draws from a generator of its own and
        runs on the zero buffers (``generate`` overwrites them), so the caller's random stream is untouched."""
        autocast = torch.is_autocast_enabled(self.device.type)
        # autocast's cache of cast weights would be freed after capture while the graph still reads it
        casting = torch.autocast(self.device.type, dtype=torch.get_autocast_dtype(self.device.type),
                                 cache_enabled=False) if autocast else contextlib.nullcontext()
        warmup_generator = torch.Generator(self.device).manual_seed(0) if self.sampling.do_sample else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), casting, self._on_device():
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._step(warmup_generator)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.sampling.do_sample and self.generator is not None:
                graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph):
                self._step(self.generator)
        return graph


def captured_generate(model: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int, *,
                      attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
                      eos_token_id=None, pad_token_id: int | None = None,
                      capture: bool | None = None) -> torch.LongTensor:
    """``[B, T]`` prompt → ``[B, T + n]`` tokens, ``n ≤ max_new_tokens``: what ``model.generate`` gives with the same
    arguments (greedy: the same tokens), with every token after the prompt one replay of a captured CUDA graph.

    The prompt runs once as a normal forward with a cache (prefill); every later token runs one recurrent step whose
    kernels are captured once in a CUDA graph (``torch.cuda.CUDAGraph``) and replayed: static buffers for the input
    token, the states and the conv windows, updated in place. ``capture=None``: capture on CUDA, run the same static
    step uncaptured elsewhere (CPU: tests); True / False force it. ``attention_mask [B, T]``: left padding.
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``: as in ``generate`` (``Sampling``); ``generator``: the
    random source of sampling, on the model's device. ``eos_token_id`` (an id or a list; None: the generation
    config's) ends a row, which then continues with ``pad_token_id``; the output stops where every row has ended.

    Each call captures a new graph (a few forwards' time); to decode many prompts of one batch size, build a
    ``StaticDecoder`` once and call its ``generate``."""
    sampling = Sampling(do_sample, temperature, top_k, top_p)
    check_prompt(input_ids, max_new_tokens, attention_mask)  # before the capture's cost
    decoder = StaticDecoder(model, input_ids.shape[0], sampling, generator=generator, eos_token_id=eos_token_id,
                            pad_token_id=pad_token_id, capture=capture)
    return decoder.generate(input_ids, max_new_tokens, attention_mask)
