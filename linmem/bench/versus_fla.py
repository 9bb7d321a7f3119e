"""FLA's own model against linmem's import of the same checkpoint, side by side in one run (issue 46).

    python -m linmem.bench.versus_fla --out runs/versus-fla                     # GDN-340M and GDN-1.3B, on CUDA
    python -m linmem.bench.versus_fla --shapes GDN-340M --batches 4 --parts train --compile --residual
    python -m linmem.bench.versus_fla --device cpu --scaled 64,2,256 --batches 2 --seq-len 16 --steps 2 \\
        --warmup 1 --prefill-len 32 --decode-tokens 4 --decode-batches 1,2      # linmem's cells on a CPU

On a CPU FLA's own cells fail, recorded as failed (its Triton kernels need a GPU; the tests run them on PyTorch
stand-ins), so that run measures linmem's cells alone.

For each shape of ``fla_parity.PAPER`` asked for, FLA 0.6.0 builds its model with its own config and model classes and
its own initialisation, and saves it (``write_fla_checkpoint``, bfloat16 weights, into a temporary folder); linmem
imports that folder with ``load_fla_checkpoint`` (backend ``triton`` on CUDA, ``chunk`` elsewhere). Every
measurement builds its model afresh, measures, and frees it (peaks are per model); an out-of-memory error makes
that cell "OOM" and the run goes on; any other error is recorded in the cell the same way. Parts (``--parts``):

- **train**: per batch size B of ``--batches`` (T = ``--seq-len``): float32 parameters, bfloat16 autocast on CUDA
  (float32 elsewhere), fused AdamW (lr 3e-4), no gradient clipping, no checkpointing; ``--warmup`` untimed and
  ``--steps`` timed steps on the same random token batches for both models (one batch per step, fixed seed). FLA's
  model computes its loss its own way (``labels=``: its fused cross entropy); linmem's with ``labels`` and the
  ``loss_chunk_tokens`` the trainer would pick for that micro-batch (``linmem.train.config.loss_chunk_tokens``).
  Reported: the median step time, the peak allocated memory (the counter reset after the model is built), every
  step's loss for both and the largest |difference| over all steps (warm-up included: both start from the same
  weights, so the losses agree to bfloat16 rounding). ``--compile`` adds rows with ``torch.compile(model)`` for
  both. ``--residual`` adds linmem's residual mixer (RDN for GDN shapes, RLA for GLA) of the imported config,
  randomly initialised, against linmem's import: step time and peak ratios. ``--no-fla`` leaves FLA's own model out
  of every part (its checkpoint is still written: linmem's model is its import), for a run that only compares
  linmem's base and residual mixers in two thirds of the time.
- **prefill**: no gradients, the model in bfloat16 on CUDA, B = 1, T = ``--prefill-len``: median forward time
  (``use_cache=False`` for both) over ``--steps`` forwards after ``--warmup``.
- **decode**: greedy ``generate()`` of ``--decode-tokens`` new tokens after a 16-token random prompt, per batch of
  ``--decode-batches``, with no end-of-sequence token (every row makes them all); tokens/s counts every sequence's new
  tokens. linmem's captured decoding is timed too where ``linmem.models.decoding`` has it: ``captured_generate``
  (its graph captured inside the timed call) and a reused ``StaticDecoder`` (captured before the clock starts); the
  tokens of each are checked against linmem's uncaptured greedy tokens. Each generator runs once untimed (a few
  tokens) before its timed run. Where transformers hands the cache over as ``cache=``, which FLA 0.6.0 does not
  read, the bench routes it to FLA's ``past_key_values`` (``route_generation_cache``) and says so.

  Agreement. Free-running greedy sequences part for good at the first flipped argmax, and the flat logits of FLA's
  initialisation flip under bfloat16 rounding, so the bench also checks each step on FLA's own prefix: FLA runs
  first; after its timed run, both models score the prompt P followed by FLA's new tokens F in one forward each
  (``teacher_forced``: no cache, the decode's dtype, only the new tokens' logits kept). Each cell's
  ``teacher_forced`` holds, per row and new token (lists ``[B][new tokens]``), the model's ``argmax`` there, its
  ``below_fla`` (top-1 logit minus the logit of FLA's token, 0 where that token is its argmax), its ``top2_margin``
  (top-1 minus top-2) and its ``top`` logit; linmem's is absent when FLA's cell failed. The row
  (``decode_agreement``) adds ``fla_token_agreement`` (the share of FLA's free-running tokens that linmem's equal),
  ``first_differences`` (per row, the index of the first new token where they differ, None where equal) and
  ``first_difference`` (their earliest, None when every row is equal); with both teacher-forced summaries:
  ``teacher_forced_agreement`` (the share of new-token positions where linmem's argmax on FLA's prefix is FLA's
  token), ``fla_teacher_forced_agreement`` (the same for FLA's own argmax: its parallel forward against its
  recurrent decoding), ``disagreements`` (how many positions linmem's argmax was not FLA's token), and over those
  positions ``linmem_margin`` and ``fla_margin`` (``{"median", "max"}`` of linmem's ``below_fla`` and of FLA's
  ``top2_margin``; None without disagreements) and ``rounding_spacing`` (the spacing of the decode's dtype at the
  largest top-1 logit of either model there). Margins below that spacing are near ties that rounding decides; far
  larger ones point at a real difference in decoding.

Ratios are linmem / FLA: above 1 linmem is slower or larger (time, memory), and faster for tokens/s.

``--recompute-states on|base|writes|off`` sets the op's ``recompute_states`` (``linmem.ops.triton.function``) in every
row for the run, e.g. ``base`` to measure an RDN that keeps its residual memory's per-chunk states for the backward,
or ``writes`` one whose backward rebuilds every state from the writes the forward kept; ``--options JSON`` sets any
launch option the same way (``bench.kernels --options``); the header says so.

FLA 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4 and < 3.7.1 (its issue #640); for timing only this
bench sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` and says in its header whether that bypassed the
check here. FLA's attention layer (the hybrid shape) needs flash-attn; without it, FLA's ``flash_attn_func`` is
replaced with ``fla_parity.sdpa_flash_attn_func``.

``--rounds N`` (train and prefill; default 1) measures each cell of a row N times in ABBA order: round 0 in the
cells' order (fla, linmem, residual), round 1 reversed, round 2 forward again, each time a fresh model through the
same build-measure-free path; a drift of the machine over a row's minutes then falls on every cell alike instead of
on one ratio. With N > 1 a cell holds every round's timed steps (``steps_ms``; prefill: ``forwards_ms``), their
median (``step_ms``; ``ms``), each round's median (``rounds_ms``), the largest peak, the first round's losses and
``max_round_loss_difference`` (the largest |difference| of one step's loss between rounds: the same batches, so a
determinism check). A round that fails makes the cell that failure, and the cell is not measured again. The row adds
``rounds`` (rounds completed per cell: fewer than N where the budget cut the row) and ``rounds_ratio`` (per round,
linmem / FLA; residual rows residual / base; only where both cells are ok), which the tables show in a "per round"
column.

``--profile STEPS`` (train; default 0: no profiling, and the report as without the option) profiles, in each train
cell, STEPS more steps after its timed ones, inside the same model build (the same step on the timed batches again;
their updates come after the timings, which they do not enter), with ``linmem.bench.step_profile``: each kernel's
own time on the GPU (on the CPU: each operator's own CPU time). The cell's ``profile`` holds ``steps``, ``kinds``
(each kind's share), ``top`` (the 15 largest), ``by_name`` (every kernel or operator: ``{ms_per_step,
calls_per_step, kind}``) and ``total_ms`` (their sum: the step's busy time), or ``error`` where profiling raised (the
timings stay). With ``--rounds`` N > 1 only each cell's first round is profiled. The report adds, per residual row,
"Where the residual mixer's extra time goes": both cells' busy ms per step and their difference, each cell's wall −
busy (its median step time less its busy time: the time the host kept the GPU waiting), the kinds side by side and
the 15 kernels or operators with the largest |residual − base|; and per train row FLA's and linmem's kinds side by
side.

``--budget`` (seconds) stops starting new measurements once spent; the skipped ones are listed, and every
"measuring" line says how many seconds the run had taken when it started, so a budget can be planned from a run.
``--out DIR`` writes ``versus_fla.json`` (every raw number) and ``versus_fla.md`` (the tables, versions and
command) after every measurement, each atomically. ``--scaled HIDDEN,LAYERS,VOCAB`` runs scaled-down copies of
the shapes (``fla_parity.scaled_paper_settings``), for dry runs; on the CPU FLA's Triton kernels must be replaced by
the caller (tests/test_bench_versus_fla.py does).

This module builds the models, measures them and runs the command line. ``versus_fla_report`` renders the report
dict as versus_fla.md and the tables a run prints, writes ``--out``'s files, and holds what both modules read of a
cell (``ok``, ``OOM``, ``PROFILE_TOP``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

from linmem.bench import environment
from linmem.bench.fla_parity import PAPER, scaled_paper_settings, sdpa_flash_attn_func, write_fla_checkpoint
from linmem.bench.step_profile import own_time_by_name, profile_steps, synchronize
from linmem.bench.training import free_memory, random_tokens
from linmem.bench.versus_fla_report import (
    OOM,
    PROFILE_TOP,
    format_decode,
    format_prefill,
    format_train,
    header_lines,
    markdown,
    ok,
    write_outputs,
)
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.fla_import import fla_config_to_linmem, load_fla_checkpoint
from linmem.train.config import loss_chunk_tokens

GIB = 2**30
PARTS = ("train", "prefill", "decode")
PROMPT_TOKENS = 16
DECODE_WARMUP_TOKENS = 4
LEARNING_RATE = 3e-4
RESIDUAL_OF = {"gdn": "rdn", "gla": "rla", "sgla": "rla"}


# ---------------------------------------------------------------------------------------------------------------
# Setup: FLA's flags, the models
# ---------------------------------------------------------------------------------------------------------------

def bypass_fla_hopper_check() -> str:
    """Let FLA 0.6.0 run its gated backward on Hopper with Triton in [3.4, 3.7.1) (timing only; its issue #640:
    results there may be wrong, which the loss column would show). Returns the line the header prints."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except ImportError:
        return "FLA is not installed"
    refused = chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    if refused:
        return ("BYPASSED: FLA 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (FLA #640); this run "
                "turned that check off for timing only")
    return "FLA's Hopper / Triton < 3.7.1 check would not refuse here (its flag is set anyway, changing nothing)"


def use_sdpa_attention_without_flash_attn() -> bool:
    """FLA's attention layer calls flash-attn's ``flash_attn_func``; without flash-attn, an SDPA stand-in of the
    same contract. Returns whether the stand-in is in place."""
    try:
        import flash_attn  # noqa: F401
        return False
    except ImportError:
        import fla.layers.attn

        fla.layers.attn.flash_attn_func = sdpa_flash_attn_func
        return True


class Shape:
    """One FLA checkpoint on disk and what builds each model of it: ``fla(dtype)`` (FLA's classes, a copy of the
    saved model), ``linmem(dtype)`` (``load_fla_checkpoint``) and ``residual(dtype)`` (linmem's residual mixer of the
    same config, random init), each on ``device``."""

    def __init__(self, name: str, folder: Path, device: torch.device, backend: str, scaled: tuple[int, ...] | None):
        self.name, self.folder, self.device, self.backend = name, folder, device, backend
        if scaled:
            kind, settings = scaled_paper_settings(name, *scaled)
        else:
            kind, settings, _ = PAPER[name]
        self.fla_model, self.parameters = write_fla_checkpoint(kind, settings, folder)
        self.config = fla_config_to_linmem(json.loads((folder / "config.json").read_text()), backend=backend)
        self.vocab = self.config.vocab_size

    def fla(self, dtype: torch.dtype) -> torch.nn.Module:
        return copy.deepcopy(self.fla_model).to(device=self.device, dtype=dtype)

    def linmem(self, dtype: torch.dtype) -> torch.nn.Module:
        return load_fla_checkpoint(self.folder, dtype=dtype, device=self.device, backend=self.backend)

    @property
    def residual_mixer(self) -> str:
        return RESIDUAL_OF[self.config.mixer]

    def residual(self, dtype: torch.dtype) -> torch.nn.Module:
        config = LinMemConfig.from_dict({**self.config.to_dict(), "mixer": self.residual_mixer})
        torch.manual_seed(0)
        return LinMemForCausalLM(config).to(device=self.device, dtype=dtype)


def trainer_loss_chunk_tokens(batch: int, seq_len: int, vocab: int) -> int:
    """The ``loss_chunk_tokens`` the trainer picks for a micro-batch ``[batch, seq_len]`` when the config leaves it
    unset (``linmem.train.config.loss_chunk_tokens``)."""
    unset = SimpleNamespace(train=SimpleNamespace(loss_chunk_tokens=None), data=SimpleNamespace(seq_len=seq_len))
    return loss_chunk_tokens(unset, batch, vocab)


# ---------------------------------------------------------------------------------------------------------------
# Measurements: each takes a freshly built model and returns raw numbers
# ---------------------------------------------------------------------------------------------------------------

def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def autocast_for(device: torch.device):
    """bfloat16 autocast on CUDA; float32 elsewhere (a CPU dry run)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def train_steps(model: torch.nn.Module, batches: list[torch.Tensor], warmup: int, device: torch.device,
                loss_kwargs: dict, profile: int = 0) -> dict:
    """Train ``model`` one step per batch of ``batches`` (``[B, T]`` ids, also the labels; fused AdamW, lr
    ``LEARNING_RATE``); the steps after the first ``warmup`` are timed one by one. ``loss_kwargs`` go to the forward
    with the labels. Returns ``losses`` (every step), ``steps_ms`` (the timed ones), ``step_ms`` (their median) and
    ``peak_gib`` (None off CUDA). With ``profile`` > 0, that many more steps of the same kind, on the timed batches
    again, are profiled after the timed ones and the peak (``profiled_steps``: the cell's ``profile``)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with autocast_for(device):
            loss = model(input_ids=ids, labels=ids, use_cache=False, **loss_kwargs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    reset_peak(device)
    losses, steps_ms = [], []
    for index, ids in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        loss = step(ids)
        synchronize(device)
        if index >= warmup:
            steps_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    result = dict(losses=losses, steps_ms=steps_ms, step_ms=statistics.median(steps_ms) if steps_ms else None,
                  peak_gib=peak_gib(device))
    if profile:
        # each profiled step reads its loss, as each timed step does (after its clock stopped)
        result["profile"] = profiled_steps(lambda ids: step(ids).item(), batches[warmup:], profile, device)
    return result


def profiled_steps(step: Callable[[torch.Tensor], object], batches: list[torch.Tensor], steps: int,
                   device: torch.device) -> dict:
    """Profile ``steps`` calls of ``step`` on ``batches`` in turn (``step_profile.profile_steps``: kernels' own
    device time on CUDA, operators' own CPU time elsewhere). Returns ``steps``, ``kinds`` (each kind's share),
    ``top`` (the ``PROFILE_TOP`` largest), ``by_name`` (every kernel or operator: ``{ms_per_step, calls_per_step,
    kind}``) and ``total_ms`` (their sum: the busy time of one step), or ``steps`` and ``error`` where profiling
    raised (out of memory included): the profile is a diagnosis, and a failure in it must not cost the cell its
    timings."""
    feed = itertools.cycle(batches)
    try:
        rows, kinds = profile_steps(lambda: step(next(feed)), steps, device, top=None)
    except Exception as error:  # noqa: BLE001 (recorded in the cell's profile; the timings stay)
        traceback.print_exc()
        return dict(steps=steps, error=f"{type(error).__name__}: {str(error)[:300]}")
    by_name = own_time_by_name(rows)
    return dict(steps=steps, kinds=kinds, top=rows[:PROFILE_TOP], by_name=by_name,
                total_ms=sum(entry["ms_per_step"] for entry in by_name.values()))


@torch.no_grad()
def prefill_forwards(model: torch.nn.Module, ids: torch.Tensor, warmup: int, steps: int,
                     device: torch.device) -> dict:
    """``warmup`` untimed and ``steps`` timed forwards of ``ids [1, T]`` (``use_cache=False``). Returns
    ``forwards_ms``, ``ms`` (their median) and ``peak_gib``."""
    model.eval()
    for _ in range(warmup):
        model(ids, use_cache=False)
    reset_peak(device)
    forwards_ms = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        model(ids, use_cache=False)
        synchronize(device)
        forwards_ms.append((time.perf_counter() - start) * 1e3)
    return dict(forwards_ms=forwards_ms, ms=statistics.median(forwards_ms), peak_gib=peak_gib(device))


def captured_decoding() -> tuple[Callable | None, type | None]:
    """``linmem.models.decoding``'s ``captured_generate`` and ``StaticDecoder`` where this linmem has them (None
    each where not)."""
    try:
        import linmem.models.decoding as decoding
    except ImportError:
        return None, None
    return getattr(decoding, "captured_generate", None), getattr(decoding, "StaticDecoder", None)


@torch.no_grad()
def timed_generation(generate: Callable[[int], torch.Tensor], new_tokens: int, batch: int,
                     device: torch.device) -> tuple[torch.Tensor, dict]:
    """Run ``generate(n)`` (greedy, n new tokens, returns ``[B, prompt + n]``) once with a few tokens untimed, then
    with ``new_tokens`` timed. Returns the timed run's new tokens ``[B, new_tokens]`` and ``seconds``,
    ``tokens_per_s`` (B · new tokens / seconds)."""
    generate(min(DECODE_WARMUP_TOKENS, new_tokens))
    synchronize(device)
    start = time.perf_counter()
    out = generate(new_tokens)
    synchronize(device)
    seconds = time.perf_counter() - start
    new = out[:, -new_tokens:]
    if new.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens, not {new_tokens}")
    return new.cpu(), dict(seconds=seconds, tokens_per_s=batch * new_tokens / seconds)


def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """transformers' greedy ``generate()`` of exactly n new tokens: the model's generation config loses its EOS
    (the model is a fresh copy), so no row stops early and no token's logit is masked."""
    model.eval()
    model.generation_config.eos_token_id = None
    return lambda n: model.generate(prompt, max_new_tokens=n, do_sample=False)


def route_generation_cache(model: torch.nn.Module) -> dict:
    """Newer transformers pass the generation cache to the model as ``cache=`` (before: ``past_key_values=``), a
    name FLA 0.6.0's forward does not read: it would decode every token without its state, fast and wrong. Route
    ``cache`` to ``past_key_values`` on this model; the returned dict's ``routed`` turns True once that happened."""
    forward, seen = model.forward, dict(routed=False)

    @functools.wraps(forward)  # transformers reads the signature (logits_to_keep, ...) through __wrapped__
    def forward_with_cache(*args, cache=None, past_key_values=None, **kwargs):
        if past_key_values is None and cache is not None:
            past_key_values, seen["routed"] = cache, True
        return forward(*args, past_key_values=past_key_values, **kwargs)

    model.forward = forward_with_cache
    return seen


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Score ``tokens [B, N]`` (FLA's new tokens) after ``prompt [B, P]`` in one forward of ``P + N − 1`` tokens
    (``use_cache=False``, the model's own dtype), keeping only the N logits that predict them (``logits_to_keep``),
    reduced over the vocabulary in that dtype (no float32 copy of them). Returns lists ``[B][N]``: ``argmax`` (the
    model's greedy choice there), ``below_fla`` (top-1 logit minus the logit of the token of ``tokens`` there),
    ``top2_margin`` (top-1 minus top-2 logit) and ``top`` (the top-1 logit)."""
    model.eval()
    tokens = tokens.to(prompt.device)
    count = tokens.shape[1]
    ids = torch.cat([prompt, tokens[:, :-1]], dim=1)
    logits = model(ids, use_cache=False, logits_to_keep=count).logits  # [B, N, vocab]: position n predicts tokens n
    best = logits.topk(min(2, logits.shape[-1]), dim=-1).values.float()  # [B, N, 2]
    given = logits.gather(-1, tokens[..., None]).float()[..., 0]  # [B, N]
    columns = dict(argmax=logits.argmax(dim=-1), below_fla=best[..., 0] - given,
                   top2_margin=best[..., 0] - best[..., -1], top=best[..., 0])
    return {name: values.tolist() for name, values in columns.items()}


def guarded_teacher_forced(model: torch.nn.Module, prompt: torch.Tensor, tokens: torch.Tensor) -> dict:
    """``teacher_forced``, or ``{"error": ...}`` where it raises (out of memory included): the check is a
    diagnosis, and a failure in it must not cost the cell its decoding speeds."""
    try:
        return teacher_forced(model, prompt, tokens)
    except Exception as error:  # noqa: BLE001 (recorded in the cell; the speeds stay)
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def fla_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    """FLA's ``generate()``, then ``teacher_forced`` on its own new tokens; ``cache_routed``: whether
    ``route_generation_cache`` had to pass the cache on."""
    seen = route_generation_cache(model)
    tokens, numbers = timed_generation(hf_greedy(model, prompt), new_tokens, prompt.shape[0], device)
    return dict(numbers, tokens=tokens.tolist(), cache_routed=seen["routed"],
                teacher_forced=guarded_teacher_forced(model, prompt, tokens))


def linmem_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, device: torch.device,
                  fla_tokens: list[list[int]] | None = None) -> dict:
    """linmem's ``generate()`` and, where they exist, its captured decoding on the same model and prompt:
    ``captured`` (``captured_generate``, which captures its graph inside each call) and ``reused`` (one
    ``StaticDecoder`` built and captured before the clock starts, as a server would keep it); the tokens of each are
    compared with the uncaptured ones (``agrees``). With ``fla_tokens [B][new_tokens]`` (FLA's greedy tokens),
    ``teacher_forced`` scores them as well."""
    batch = prompt.shape[0]
    tokens, numbers = timed_generation(hf_greedy(model, prompt), new_tokens, batch, device)
    result = dict(numbers, tokens=tokens.tolist(), captured=None, reused=None)
    if fla_tokens is not None:
        result["teacher_forced"] = guarded_teacher_forced(model, prompt, torch.tensor(fla_tokens))
    captured_generate, static_decoder = captured_decoding()
    generators = {}
    if captured_generate is not None:
        generators["captured"] = lambda n: captured_generate(model, prompt, n, do_sample=False, eos_token_id=[])
    if static_decoder is not None:
        decoder = static_decoder(model, batch, eos_token_id=[])
        generators["reused"] = lambda n: decoder.generate(prompt, n)
    for name, generate in generators.items():
        other_tokens, other = timed_generation(generate, new_tokens, batch, device)
        result[name] = dict(other, agrees=bool(torch.equal(other_tokens, tokens)))
    return result


def isolated(build: Callable[[], torch.nn.Module], measure: Callable[[torch.nn.Module], dict],
             device: torch.device, compile_model: bool = False) -> dict:
    """Build a model, measure it, and free it with everything it made. Returns the measurement with ``status``
    ``"ok"``, ``"OOM"`` (out of memory) or the error's type and message (any other error, printed)."""
    free_memory(device)
    model = runner = None
    try:
        model = build()
        runner = torch.compile(model) if compile_model else model
        result = dict(measure(runner), status="ok")
    except torch.OutOfMemoryError:
        result = dict(status=OOM)
    except Exception as error:  # noqa: BLE001 (recorded in the cell; the other measurements go on)
        traceback.print_exc()
        result = dict(status=f"{type(error).__name__}: {str(error)[:300]}")
    model = runner = None  # noqa: F841 (drop the model before the memory is returned)
    free_memory(device)
    return result


def combine_rounds(rounds: list[dict], times: str, median: str) -> dict:
    """One cell from its rounds (each an ok measurement of a fresh model, in the order measured): ``times`` (the
    timed steps' key, ``steps_ms`` or ``forwards_ms``) holds every round's, one after the other, and ``median`` their
    median; ``rounds_ms`` each round's median; ``peak_gib`` the largest (None off CUDA). Where the rounds have
    ``losses`` (training), the cell keeps the first round's and ``max_round_loss_difference``: over the steps, the
    largest spread of one step's loss across the rounds (None with a single round)."""
    every = [value for result in rounds for value in result[times]]
    peaks = [result["peak_gib"] for result in rounds if result["peak_gib"] is not None]
    cell = {**rounds[0], times: every, median: statistics.median(every),
            "rounds_ms": [result[median] for result in rounds], "peak_gib": max(peaks) if peaks else None}
    if "losses" in rounds[0]:
        per_step = list(zip(*(result["losses"] for result in rounds)))
        cell["max_round_loss_difference"] = (max(max(step) - min(step) for step in per_step)
                                             if len(rounds) > 1 and per_step else None)
    return cell


def rounds_ratio(top: dict | None, bottom: dict | None) -> list[float] | None:
    """``top``'s per-round medians over ``bottom``'s, round by round (as far as both got); None unless both are
    ok."""
    if not (ok(top) and ok(bottom)):
        return None
    return [a / b for a, b in zip(top["rounds_ms"], bottom["rounds_ms"])]


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------

class Run:
    """The report being built (``report``: settings, environment, rows per part, skipped measurements), the
    budget, and where it is written."""

    def __init__(self, args: argparse.Namespace, device: torch.device, command: str):
        self.args, self.device = args, device
        self.started = time.perf_counter()
        self.deadline = self.started + args.budget if args.budget else float("inf")
        self.backend = "triton" if device.type == "cuda" else "chunk"
        self.compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        env = environment(device)
        self.report = dict(command=command, env=env, settings=settings_of(args, self.backend), notes=[], train=[],
                           residual=[], prefill=[], decode=[], skipped=[])

    def note(self, line: str) -> None:
        print(line, flush=True)
        self.report["notes"].append(line)

    def may_start(self, what: str) -> bool:
        """False (and ``what`` listed as skipped) once the budget is spent."""
        now = time.perf_counter()
        if now < self.deadline:
            print(f"[{now - self.started:5.0f} s] measuring {what}", flush=True)
            return True
        self.report["skipped"].append(what)
        print(f"skipped (budget spent): {what}", flush=True)
        return False

    def measured(self, cells: dict) -> dict:
        """``cells`` (who → what builds and measures it) without FLA's model under ``--no-fla``."""
        return {who: cell for who, cell in cells.items() if not (self.args.no_fla and who == "fla")}

    def in_rounds(self, cells: dict[str, Callable[[], dict]], what: str, times: str,
                  median: str) -> tuple[dict, dict]:
        """Measure each of ``cells`` (who → a call of ``isolated``) ``--rounds`` times, the order reversed every
        other round (fla, linmem, residual, then residual, linmem, fla, ...), so that the machine's drift over the
        row falls on every cell alike. The budget is checked before each measurement; a cell that failed is not
        measured again. Returns the cells, who → the one measurement (one round) or ``combine_rounds`` of its
        rounds, or the failure (absent where none ran), and who → the rounds each completed."""
        count = self.args.rounds
        done, failed = {who: [] for who in cells}, {}
        for index in range(count):
            for who in list(cells) if index % 2 == 0 else list(reversed(cells)):
                label = f"{what} {who}" + (f" round {index + 1}/{count}" if count > 1 else "")
                if who in failed or not self.may_start(label):
                    continue
                result = cells[who]()
                if ok(result):
                    done[who].append(result)
                else:
                    failed[who] = result
                self.save()
        results = {}
        for who, rounds in done.items():
            if who in failed:
                results[who] = failed[who]
            elif rounds:
                results[who] = rounds[0] if count == 1 else combine_rounds(rounds, times, median)
                difference = results[who].get("max_round_loss_difference")
                if difference is not None:
                    print(f"{what} {who}: the losses of {len(rounds)} rounds differ by at most {difference:.2e}",
                          flush=True)
        return results, {who: len(rounds) for who, rounds in done.items()}

    def save(self) -> None:
        if self.args.out is not None:
            write_outputs(self.args.out, self.report)

    def shape(self, shape: Shape) -> None:
        args = self.args
        if "train" in args.parts:
            for batch in args.batches:
                for compiled in (False, True) if args.compile else (False,):
                    self.train(shape, batch, compiled)
        if "prefill" in args.parts:
            self.prefill(shape)
        if "decode" in args.parts:
            for batch in args.decode_batches:
                self.decode(shape, batch)

    def train(self, shape: Shape, batch: int, compiled: bool) -> None:
        args, device = self.args, self.device
        mode = "compiled" if compiled else "eager"
        batches = [random_tokens(step, batch, args.seq_len, shape.vocab, device)
                   for step in range(args.warmup + args.steps)]
        chunk = trainer_loss_chunk_tokens(batch, args.seq_len, shape.vocab)
        row = dict(shape=shape.name, batch=batch, seq_len=args.seq_len, mode=mode, loss_chunk_tokens=chunk)
        cells = self.measured(dict(fla=(shape.fla, {}), linmem=(shape.linmem, dict(loss_chunk_tokens=chunk))))
        if args.residual:
            cells["residual"] = (shape.residual, dict(loss_chunk_tokens=chunk))
        profiled = set()  # the cells profiled so far: with several rounds only the first round of each profiles

        def measure(model: torch.nn.Module, who: str, loss_kwargs: dict) -> dict:
            profile = 0 if who in profiled else args.profile
            profiled.add(who)
            return train_steps(model, batches, args.warmup, device, loss_kwargs, profile)

        measures = {who: functools.partial(
            isolated, lambda build=build: build(torch.float32),
            functools.partial(measure, who=who, loss_kwargs=loss_kwargs), device, compiled)
            for who, (build, loss_kwargs) in cells.items()}
        results, completed = self.in_rounds(measures, f"{shape.name} train B={batch} {mode}", "steps_ms", "step_ms")
        row.update(results)
        fla, linmem = row.get("fla"), row.get("linmem")
        if ok(fla) and ok(linmem):
            row["max_loss_difference"] = max(abs(a - b) for a, b in zip(fla["losses"], linmem["losses"]))
        train_row = {k: v for k, v in row.items() if k != "residual"}
        residual_row = dict(shape=shape.name, batch=batch, seq_len=args.seq_len, mode=mode,
                            mixer=shape.residual_mixer, base=linmem, residual=row.get("residual"))
        if args.rounds > 1:
            train_row["rounds"] = {who: n for who, n in completed.items() if who != "residual"}
            residual_row["rounds"] = dict(base=completed.get("linmem", 0), residual=completed.get("residual", 0))
            for out, top, bottom in ((train_row, linmem, fla), (residual_row, row.get("residual"), linmem)):
                if (ratios := rounds_ratio(top, bottom)) is not None:
                    out["rounds_ratio"] = ratios
        self.report["train"].append(train_row)
        if args.residual:
            self.report["residual"].append(residual_row)
        print(format_train([self.report["train"][-1]]), flush=True)
        self.save()

    def prefill(self, shape: Shape) -> None:
        args, device = self.args, self.device
        ids = random_tokens(args.seed, 1, args.prefill_len, shape.vocab, device)
        row = dict(shape=shape.name, seq_len=args.prefill_len)
        measures = {who: functools.partial(
            isolated, lambda build=build: build(self.compute_dtype),
            lambda model: prefill_forwards(model, ids, args.warmup, args.steps, device), device)
            for who, build in self.measured(dict(fla=shape.fla, linmem=shape.linmem)).items()}
        results, completed = self.in_rounds(measures, f"{shape.name} prefill T={args.prefill_len}", "forwards_ms",
                                            "ms")
        row.update(results)
        if args.rounds > 1:
            row["rounds"] = completed
            if (ratios := rounds_ratio(row.get("linmem"), row.get("fla"))) is not None:
                row["rounds_ratio"] = ratios
        self.report["prefill"].append(row)
        print(format_prefill([row]), flush=True)
        self.save()

    def decode(self, shape: Shape, batch: int) -> None:
        args, device = self.args, self.device
        prompt = random_tokens(args.seed, batch, PROMPT_TOKENS, shape.vocab, device)
        row = dict(shape=shape.name, batch=batch, prompt=PROMPT_TOKENS, new_tokens=args.decode_tokens)
        measures = self.measured(dict(
            fla=(shape.fla, lambda model: fla_decode(model, prompt, args.decode_tokens, device)),
            linmem=(shape.linmem, lambda model: linmem_decode(
                model, prompt, args.decode_tokens, device, row["fla"]["tokens"] if ok(row.get("fla")) else None))))
        for who, (build, measure) in measures.items():  # FLA first: linmem's teacher-forced check reads its tokens
            if self.may_start(f"{shape.name} decode B={batch} {who}"):
                row[who] = isolated(lambda build=build: build(self.compute_dtype), measure, device)
                self.save()
        fla, linmem = row.get("fla"), row.get("linmem")
        if ok(fla) and fla["cache_routed"] and not any("cache=" in note for note in self.report["notes"]):
            self.note("transformers passes the generation cache as cache=, which FLA 0.6.0's forward does not read: "
                      "the bench routed it to FLA's past_key_values")
        if ok(fla) and ok(linmem):
            row.update(decode_agreement(fla, linmem, self.compute_dtype))
        self.report["decode"].append(row)
        print(format_decode([row]), flush=True)
        self.save()


def dtype_spacing(value: float, dtype: torch.dtype) -> float:
    """The gap between ``dtype``'s representable numbers at ``value``'s magnitude (its unit in the last place)."""
    info = torch.finfo(dtype)
    _, exponent = math.frexp(max(abs(value), info.tiny))  # magnitude in [2^(exponent − 1), 2^exponent)
    return info.eps * 2.0 ** (exponent - 1)


def decode_agreement(fla: dict, linmem: dict, dtype: torch.dtype) -> dict:
    """How far linmem's decoding follows FLA's, from the two decode cells (tokens ``[B][N]`` each and, where present,
    their ``teacher_forced`` summaries) and the decode's ``dtype``; the keys are listed in the module docstring."""
    fla_tokens, linmem_tokens = torch.tensor(fla["tokens"]), torch.tensor(linmem["tokens"])
    same = fla_tokens == linmem_tokens  # [B, N]
    first_differences = [None if bool(equal.all()) else int((~equal).nonzero()[0, 0]) for equal in same]
    parted = [index for index in first_differences if index is not None]
    row = dict(fla_token_agreement=same.double().mean().item(), first_differences=first_differences,
               first_difference=min(parted) if parted else None)
    if any("argmax" not in cell.get("teacher_forced", {}) for cell in (fla, linmem)):
        return row
    fla_forced, linmem_forced = fla["teacher_forced"], linmem["teacher_forced"]
    hits = torch.tensor(linmem_forced["argmax"]) == fla_tokens
    misses = ~hits
    row.update(teacher_forced_agreement=hits.double().mean().item(),
               fla_teacher_forced_agreement=(torch.tensor(fla_forced["argmax"]) == fla_tokens).double().mean().item(),
               disagreements=int(misses.sum()), linmem_margin=None, fla_margin=None, rounding_spacing=None)
    if misses.any():
        def spread(values: list[list[float]]) -> dict:
            chosen = torch.tensor(values, dtype=torch.float64)[misses].tolist()
            return dict(median=statistics.median(chosen), max=max(chosen))

        largest_top = max(torch.tensor(forced["top"], dtype=torch.float64)[misses].abs().max().item()
                          for forced in (fla_forced, linmem_forced))
        row.update(linmem_margin=spread(linmem_forced["below_fla"]), fla_margin=spread(fla_forced["top2_margin"]),
                   rounding_spacing=dtype_spacing(largest_top, dtype))
    return row


def settings_of(args: argparse.Namespace, backend: str) -> dict:
    return dict(shapes=args.shapes, batches=args.batches, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
                prefill_len=args.prefill_len, decode_tokens=args.decode_tokens, decode_batches=args.decode_batches,
                compile=args.compile, residual=args.residual, no_fla=args.no_fla, parts=args.parts, budget=args.budget,
                scaled=args.scaled, seed=args.seed, rounds=args.rounds, backend=backend, learning_rate=LEARNING_RATE,
                prompt_tokens=PROMPT_TOKENS, **({"profile": args.profile} if args.profile else {}),
                **({"recompute_states": args.recompute_states} if args.recompute_states else {}),
                **({"kernel_options": args.options} if args.options else {}))


# --recompute-states → the rows' recompute_states
RECOMPUTE_FLAGS = {"on": True, "base": "base", "writes": "writes", "off": False}


def set_recompute_states(choice: str) -> str:
    """Every row of ``KERNEL_OPTIONS`` takes ``recompute_states`` = ``RECOMPUTE_FLAGS[choice]`` for the rest of the
    process; returns the note the run's header gives."""
    from linmem.ops.triton import function

    function.override_options({"recompute_states": RECOMPUTE_FLAGS[choice]})
    return (f"recompute_states {RECOMPUTE_FLAGS[choice]!r} in every row of the op's launch options for this run "
            f"(--recompute-states {choice}), not the rows' own")


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------

def _names(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in PAPER]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PAPER)}; got {text!r}")
    return names


def _parts(text: str) -> list[str]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise argparse.ArgumentTypeError(f"choose from {','.join(PARTS)}; got {text!r}")
    return parts


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers expected; got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_names, default=["GDN-340M", "GDN-1.3B"], help=f"of {', '.join(PAPER)}")
    parser.add_argument("--batches", type=_positive_ints, default=[4, 8], help="training batch sizes")
    parser.add_argument("--seq-len", type=int, default=2048, help="training tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps (and prefill forwards)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (and forwards) before them")
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-batches", type=_positive_ints, default=[1, 32])
    parser.add_argument("--compile", action="store_true", help="also train with torch.compile(model), both models")
    parser.add_argument("--residual", action="store_true", help="also train linmem's RDN / RLA of the same config")
    parser.add_argument("--no-fla", action="store_true",
                        help="leave FLA's own model out (linmem's import and, with --residual, its residual mixer)")
    parser.add_argument("--parts", type=_parts, default=list(PARTS), help=f"of {','.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="train and prefill: measure each cell this many times, in ABBA order (drift cancels)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="train: after each cell's timed steps (first round only), profile STEPS more and report "
                             "every kernel's own time per step, by kind and by name, with the residual mixer's "
                             "difference from linmem's import and each cell's wall − busy gap; 0: no profiling")
    parser.add_argument("--recompute-states", choices=list(RECOMPUTE_FLAGS), default=None,
                        help="the op's recompute_states for this run, every width's row (default: the rows' own): "
                             "on, base (the base memory's passes only: RDN/RLA keep the residual memory's), writes "
                             "(every pass again from the writes u, w the forward kept) or off")
    parser.add_argument("--options", type=json.loads, default=None, metavar="JSON",
                        help="the op's launch options for this run, every width's row, as bench.kernels --options "
                             "takes them, e.g. '{\"forward\": {\"FUSED\": true, \"BV\": 16}}'")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds; 0: no limit")
    parser.add_argument("--out", type=Path, default=None, help="write versus_fla.json and versus_fla.md here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0, help="prompt and prefill tokens")
    parser.add_argument("--scaled", type=_positive_ints, default=None, metavar="HIDDEN,LAYERS,VOCAB",
                        help="scaled-down copies of the shapes (dry runs; see fla_parity.scaled_paper_settings)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if (args.steps < 1 or args.warmup < 0 or args.seq_len < 2 or args.decode_tokens < 1 or args.prefill_len < 1
            or args.rounds < 1 or args.profile < 0):
        raise SystemExit("--steps, --decode-tokens, --prefill-len and --rounds must be >= 1, --warmup and --profile "
                         ">= 0, --seq-len >= 2")
    if args.scaled is not None and len(args.scaled) != 3:
        raise SystemExit(f"--scaled takes HIDDEN,LAYERS,VOCAB; got {args.scaled}")
    device = torch.device(args.device)
    command = "python -m linmem.bench.versus_fla " + shlex.join(sys.argv[1:] if argv is None else argv)
    run = Run(args, device, command)
    run.note(bypass_fla_hopper_check())
    if args.recompute_states:
        run.note(set_recompute_states(args.recompute_states))
    if args.options:
        from linmem.ops.triton import function

        try:
            function.override_options(args.options)
        except ValueError as exc:
            raise SystemExit(f"--options: {exc}") from exc
        run.note(f"the op's launch options {json.dumps(args.options)} in every row for this run (--options), not "
                 "the rows' own")
    if use_sdpa_attention_without_flash_attn():
        run.note("flash-attn is not installed: FLA's attention layers (hybrid shapes) run on an SDPA stand-in")
    if args.profile and "train" in args.parts:
        run.note(f"train cells profile {args.profile} more steps after their timed ones (the first round's only); "
                 "those steps do not enter the timings, and busy (the kernels' own time on the GPU) is not wall time: "
                 "wall − busy is the host's gap")
    if None in captured_decoding():
        run.note("linmem.models.decoding's captured_generate / StaticDecoder is missing here: its columns are n/a")
    print("\n".join(header_lines(run.report)), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.shapes:
            if not run.may_start(f"{name}: write the FLA checkpoint"):
                continue
            shape = Shape(name, Path(workdir) / name.replace(" ", "_"), device, run.backend, args.scaled)
            print(f"{name}: {shape.parameters:,} parameters, FLA checkpoint written", flush=True)
            run.report.setdefault("parameters", {})[name] = shape.parameters
            run.shape(shape)
            del shape
            free_memory(device)
    print("\n" + markdown(run.report), flush=True)
    run.save()
    return run.report


if __name__ == "__main__":
    main()
