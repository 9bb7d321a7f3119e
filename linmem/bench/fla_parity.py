"""FLA checkpoint parity on a GPU: flash-linear-attention's own Triton forward against the imported linmem model.

    python -m linmem.bench.fla_parity [--lengths 40 1000] [--batch 2] [--models ...] [--first-config] [--out FILE]
    python -m linmem.bench.fla_parity --paper [--dtypes bfloat16] [--out FILE]     # the paper's four shapes
    python -m linmem.bench.fla_parity --write-paper DIR [--models GDN-1.3B]        # only write the folders

``--paper`` runs the shapes of "How Linear Attention Remembers" (Table 1 / appendix A: GLA-340M, GDN-340M,
GDN-1.3B, hybrid GDN-340M; ``PAPER``), each written as an FLA checkpoint folder by FLA 0.6.0's own config and model
classes (FLA's initialisation: random weights), with its parameter count next to the paper's. Every row also gives
the relative error ``‖linmem − FLA‖ / ‖FLA‖`` over all logits (Frobenius), checked against ``--tolerance``
(1e-2).

Builds random FLA 0.6.0 models on the GPU (a GLA hybrid with a windowed GQA softmax-attention layer, and a plain
Gated DeltaNet, so that one model runs FLA's Triton kernels end to end), saves each as safetensors, imports it with
``load_fla_checkpoint`` (linmem backends ``chunk`` and ``triton``), and prints, per model, length, dtype and backend,
the largest logit differences

- against FLA's forward in the same dtype (``abs`` = max |Δ|, ``rel`` = max |Δ| / max |FLA logit|), and the share of
  positions whose top-1 token agrees;
- of both FLA and linmem against a float64 linmem forward (chunk backend), which tells whose rounding a difference is.

FLA's GLA and GDN layers switch from their ``fused_recurrent`` to their ``chunk`` kernels above 64 tokens: the default
lengths (40 and 1000) run both. flash-attn is not needed: its ``flash_attn_func`` is replaced with a
scaled-dot-product-attention stand-in of the same contract (FLA's attention layer needs it); every other op of the
FLA model is FLA's own. linmem's ``triton`` backend runs its fused kernels for GDN; for GLA's per-key-channel decay it
falls back to ``chunk`` (see ``linmem.ops.triton``). A CPU dry run (``--device cpu``) works only with FLA's kernels
replaced, as tests/test_fla_import.py does.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from linmem.bench import environment
from linmem.models.fla_import import load_fla_checkpoint

VOCAB = 4096
MODELS = {
    "GLA hybrid": ("gla", dict(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_heads=4, num_kv_heads=2, expand_k=0.5,
        expand_v=1.0, use_short_conv=True, conv_size=4, norm_eps=1e-6,
        attn=dict(layers=[1], num_heads=8, num_kv_heads=2, qkv_bias=True, window_size=256, rope_theta=10000.0),
    )),
    "GDN": ("gated_deltanet", dict(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_heads=4, head_dim=64, expand_v=2.0,
        norm_eps=1e-6,
    )),
}

# The paper's models (Table 1 / appendix A of "How Linear Attention Remembers"): FLA 0.6.0 settings whose parameter
# counts are the paper's. Vocabulary 32,000 (FLA's default, the Llama/Mistral tokenizer of fla-hub's checkpoints).
# GLA-340M: D = 1024, 4 heads of K = D·0.5/4 = 128, V = 256, no short conv, tied embeddings (341.7M; untied would be
# 374.5M). GDN: head_dim 256 and expand_v 1 give the 256 x 256 state; D = 1024 with 4 heads gives 399.5M, D = 2048
# with 8 heads 1.466B. The hybrid: GDN-340M with softmax attention (16 query heads, 8 kv heads, full causal) in
# layers 2, 5, ..., 23, 382.6M (8 kv heads: 16 gives 391.0M, 4 gives 378.4M).
PAPER_VOCAB = 32000
PAPER = {
    "GLA-340M": ("gla", dict(
        vocab_size=PAPER_VOCAB, hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0,
        use_short_conv=False, tie_word_embeddings=True,
    ), 341.7e6),
    "GDN-340M": ("gated_deltanet", dict(
        vocab_size=PAPER_VOCAB, hidden_size=1024, num_hidden_layers=24, num_heads=4, head_dim=256, expand_v=1.0,
        use_short_conv=True, conv_size=4,
    ), 399.5e6),
    "GDN-1.3B": ("gated_deltanet", dict(
        vocab_size=PAPER_VOCAB, hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1.0,
        use_short_conv=True, conv_size=4,
    ), 1.466e9),
    "hybrid GDN-340M": ("gated_deltanet", dict(
        vocab_size=PAPER_VOCAB, hidden_size=1024, num_hidden_layers=24, num_heads=4, head_dim=256, expand_v=1.0,
        use_short_conv=True, conv_size=4,
        attn=dict(layers=list(range(2, 24, 3)), num_heads=16, num_kv_heads=8, qkv_bias=False, window_size=None,
                  rope_theta=10000.0),
    ), 382.6e6),
}


def scaled_paper_settings(name: str, hidden: int = 64, layers: int = 6, vocab: int = 512) -> tuple[str, dict]:
    """A scaled-down copy of ``PAPER[name]`` (tests): width ``hidden``, ``layers`` layers (the hybrid's attention
    in every third layer from layer 2, as in the paper), ``vocab`` tokens; every other setting (heads, the key /
    value ratio of the state, convs, tying, attention kind) as in the paper's model."""
    if name not in PAPER:
        raise ValueError(f"name must be one of {list(PAPER)}; got {name!r}")
    kind, settings, _ = PAPER[name]
    settings = {**settings, "hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab}
    if kind == "gated_deltanet":
        settings["head_dim"] = hidden * settings["head_dim"] // PAPER[name][1]["hidden_size"]
    if "attn" in settings:
        settings["attn"] = {**settings["attn"], "layers": list(range(2, layers, 3)), "num_heads": 4,
                            "num_kv_heads": 2}
    return kind, settings


def write_fla_checkpoint(kind: str, settings: dict, path: str | Path, *, seed: int = 0, init: str = "fla",
                         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.nn.Module, int]:
    """Build an FLA 0.6.0 model of ``settings`` with FLA's own config and model classes, and save it to ``path``
    (FLA's checkpoint format: ``config.json`` + safetensors, weights in ``dtype``). ``init``: ``"fla"`` keeps FLA's
    initialisation, ``"order-one"`` draws weights of order-one activations (``randomise``). Returns the model (float32,
    CPU, eval mode, its weights rounded to ``dtype``) and its parameter count."""
    if init not in ("fla", "order-one"):
        raise ValueError(f"init must be 'fla' or 'order-one'; got {init!r}")
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM

    config_class, model_class = ((GLAConfig, GLAForCausalLM) if kind == "gla"
                                 else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM))
    torch.manual_seed(seed)
    model = model_class(config_class(**settings))
    if init == "order-one":
        randomise(model, seed)
    model = model.to(dtype)
    model.save_pretrained(path)
    return model.float().eval(), sum(p.numel() for p in model.parameters())


def write_paper_checkpoints(out_dir: str | Path, names: list[str] | None = None, *, seed: int = 0,
                            init: str = "fla", dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[Path, int]]:
    """Write the paper's models (``PAPER``; all when ``names`` is None) as FLA checkpoint folders under ``out_dir``
    (one folder per model, spaces as ``_``), printing each parameter count beside the paper's. Returns ``name ->
    (folder, parameters)``."""
    written = {}
    for name in names or list(PAPER):
        if name not in PAPER:
            raise ValueError(f"names must be among {list(PAPER)}; got {name!r}")
        kind, settings, paper_count = PAPER[name]
        path = Path(out_dir) / name.replace(" ", "_")
        model, count = write_fla_checkpoint(kind, settings, path, seed=seed, init=init, dtype=dtype)
        del model
        gc.collect()
        print(f"{name}: {count:,} parameters ({count / 1e6:.1f}M; paper {paper_count / 1e6:.1f}M) -> {path}",
              flush=True)
        written[name] = (path, count)
    return written


def sdpa_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple[int, int] = (-1, -1), **unused) -> torch.Tensor:
    """flash-attn's ``flash_attn_func`` contract on SDPA: ``q [B, T, H, d]``, ``k, v [B, S, H_kv, d]`` →
    ``[B, T, H, d]``; query i (aligned to the last of the S keys) sees key j iff ``i' − left <= j <= i' + right``
    with ``i' = i + S − T`` (``right = 0`` when causal; −1: unbounded)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    queries, keys = q.shape[1], k.shape[1]
    offset = (torch.arange(keys, device=q.device)[None, :] - torch.arange(queries, device=q.device)[:, None]
              - (keys - queries))
    left, right = window_size
    right = 0 if causal else right
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                                       dropout_p=dropout_p, scale=softmax_scale)
    return o.transpose(1, 2)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Order-one activations: projections N(0, 1/fan_in), norm weights 1 ± 0.3, biases N(0, 0.5) (GLA's gate bias
    N(0, 2)), GDN decays ``exp(−e^A_log · softplus(a + dt_bias))`` mostly in (0.8, 1): long memories."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            value = torch.empty(p.shape).uniform_(math.log(0.05), math.log(2.0), generator=gen)
        elif name.endswith("dt_bias"):
            value = torch.randn(p.shape, generator=gen) - 2.0
        elif "norm" in name:
            value = 1 + 0.3 * torch.randn(p.shape, generator=gen)
        elif name.endswith("gk_proj.1.bias"):
            value = 2.0 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.5 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5
        p.copy_(value)


def build_fla(kind: str, settings: dict, seed: int) -> torch.nn.Module:
    """A random FLA ``*ForCausalLM`` (float32, CPU)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM

    config_class, model_class = ((GLAConfig, GLAForCausalLM) if kind == "gla"
                                 else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM))
    torch.manual_seed(seed)
    model = model_class(config_class(**settings))
    randomise(model, seed)
    return model.eval()


def compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """``(max |Δ|, max |Δ| / max |expected|)`` of two ``[B, T, vocab]`` logit tensors (in float64)."""
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff, diff / expected.double().abs().max().item()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` over every logit (Frobenius norms, in float64)."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def top1_agreement(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.argmax(-1) == expected.argmax(-1)).double().mean().item()


class Report:
    """Markdown lines, printed and (with a path) appended to a file as they come, so that a run stopped part-way
    keeps what it measured; ``log`` prints progress with the seconds since the start (not part of the report)."""

    def __init__(self, path: Path | None):
        self.start = time.perf_counter()
        self.file = None if path is None else path.open("w", buffering=1)

    def add(self, line: str) -> None:
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


def logits_of(model: torch.nn.Module, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {n: model(ids, use_cache=False).logits for n, ids in inputs.items()}


def free(device: torch.device) -> None:
    """Return the memory of dropped models to the device (large models one after another)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def run_model(name: str, fla_model: torch.nn.Module, path: Path, lengths: list[int], batch: int,
              device: torch.device, report: Report, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
              backends: tuple[str, ...] = ("chunk", "triton"), tolerance: float = 1e-2) -> list[str]:
    """Table rows for one model saved at ``path`` (``fla_model``: the same model, float32 on the CPU): FLA and each
    linmem backend, per dtype and length. Returns the rows whose relative error exceeds ``tolerance`` (or failed)."""
    vocab = fla_model.config.vocab_size
    inputs = {n: torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n)).to(device)
              for n in lengths}
    exact = logits_of(load_fla_checkpoint(path, dtype=torch.float64, device=device, backend="chunk"), inputs)
    free(device)
    report.log(f"{name}: float64 reference done")
    failures = []
    for dtype in dtypes:
        labels = {n: f"| {name} | {n} | {str(dtype).removeprefix('torch.')} |" for n in lengths}
        try:
            fla_logits = logits_of(copy.deepcopy(fla_model).to(device=device, dtype=dtype), inputs)
        except Exception as error:  # report and go on
            traceback.print_exc()
            for n in lengths:
                report.add(f"{labels[n]} FLA (Triton) | failed: {type(error).__name__}: {error} | | | | | |")
                failures.append(f"{name} T={n} {dtype} FLA")
            continue
        free(device)
        report.log(f"{name} {dtype}: FLA forward done")
        for n in lengths:
            report.add(f"{labels[n]} FLA (Triton) | – | – | – | – | – | {compare(fla_logits[n], exact[n])[1]:.2e} |")
        for backend in backends:
            try:
                logits = logits_of(load_fla_checkpoint(path, dtype=dtype, device=device, backend=backend), inputs)
            except Exception as error:  # one backend failing must not hide the others
                traceback.print_exc()
                for n in lengths:
                    report.add(f"{labels[n]} linmem {backend} | failed: {type(error).__name__}: {error} | | | | | |")
                    failures.append(f"{name} T={n} {dtype} {backend}")
                continue
            free(device)
            for n in lengths:
                diff, rel = compare(logits[n], fla_logits[n])
                frobenius = relative_error(logits[n], fla_logits[n])
                verdict = "yes" if frobenius <= tolerance else "NO"
                if verdict == "NO":
                    failures.append(f"{name} T={n} {dtype} {backend}: {frobenius:.2e}")
                report.add(f"{labels[n]} linmem {backend} | {diff:.2e} | {rel:.2e} | {frobenius:.2e} | {verdict} | "
                           f"{top1_agreement(logits[n], fla_logits[n]):.4f} | {compare(logits[n], exact[n])[1]:.2e} |")
    return failures


def first_config_only() -> None:
    """Skip Triton's autotuning: every autotuned kernel (FLA's and linmem's) runs the first of its configs that its
    own pruning keeps for the call's shapes. Block sizes and warps change only the order of floating-point sums, not
    the math; autotuning dozens of configs per kernel and dtype costs minutes of compilation a parity check does not
    need."""
    from triton.runtime.autotuner import Autotuner

    tuned_run = Autotuner.run

    def run(self, *args, **kwargs):
        all_configs = self.configs
        if len(all_configs) > 1:
            configs = all_configs
            if getattr(self, "early_config_prune", None):
                configs = self.early_config_prune(configs, dict(zip(self.arg_names, args)), **kwargs)
            self.configs = list(configs)[:1]
        try:
            return tuned_run(self, *args, **kwargs)
        finally:
            self.configs = all_configs

    Autotuner.run = run


def environment_lines(device: torch.device) -> list[str]:
    import transformers

    env = environment(device)
    return [f"- device: {env['gpu'] or 'CPU'}", f"- torch {env['torch']}, triton {env['triton'] or 'not installed'}, "
            f"flash-linear-attention {env['fla']}, transformers {transformers.__version__}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 1000])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS) + list(PAPER),
                        help=f"default: {list(MODELS)}, or with --paper / --write-paper {list(PAPER)}")
    parser.add_argument("--paper", action="store_true", help="the paper's four shapes (PAPER), bfloat16 unless "
                                                             "--dtypes says otherwise")
    parser.add_argument("--write-paper", type=Path, default=None, metavar="DIR",
                        help="only write the paper's models as FLA checkpoint folders under DIR and print their sizes")
    parser.add_argument("--init", default="fla", choices=("fla", "order-one"),
                        help="paper models: FLA's own initialisation, or order-one activations (see randomise)")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=("float32", "bfloat16"),
                        help="default: float32 bfloat16 (toy models), bfloat16 (--paper)")
    parser.add_argument("--backends", nargs="+", default=["chunk", "triton"], choices=("chunk", "triton"))
    parser.add_argument("--tolerance", type=float, default=1e-2, help="largest ‖linmem − FLA‖ / ‖FLA‖ that passes")
    parser.add_argument("--first-config", action="store_true", help="skip Triton autotuning (see first_config_only)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here, line by line")
    args = parser.parse_args(argv)
    import fla.layers.attn

    fla.layers.attn.flash_attn_func = sdpa_flash_attn_func  # FLA's attention layer looks it up here
    paper = args.paper or args.write_paper is not None
    names = args.models or list(PAPER if paper else MODELS)
    if args.write_paper is not None:
        write_paper_checkpoints(args.write_paper, names, init=args.init)
        return 0
    device = torch.device(args.device)
    dtypes = tuple(getattr(torch, d) for d in (args.dtypes or (["bfloat16"] if paper else ["float32", "bfloat16"])))
    report = Report(args.out)
    report.log("imported fla")
    if args.first_config:
        first_config_only()
    for line in environment_lines(device) + [
        f"- batch {args.batch}; FLA runs in the row's dtype (its Triton kernels' default fp32 dot "
        f"precision{', first autotune config' if args.first_config else ''}); exact: linmem chunk in float64; "
        f"‖Δ‖/‖FLA‖ over all logits must be <= {args.tolerance:g}", "",
        "| model | T | dtype | logits of | max abs Δ vs FLA | max rel Δ vs FLA | ‖Δ‖/‖FLA‖ | <= tol | top-1 agrees "
        "| max rel Δ vs exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]:
        report.add(line)
    failures = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            path = Path(workdir) / name.replace(" ", "_")
            if name in PAPER:
                kind, settings, paper_count = PAPER[name]
                fla_model, count = write_fla_checkpoint(kind, settings, path, init=args.init)
                report.log(f"{name}: {count:,} parameters (paper {paper_count / 1e6:.1f}M), saved")
            else:
                kind, settings = MODELS[name]
                fla_model = build_fla(kind, settings, seed=len(name))
                fla_model.save_pretrained(path)  # float32 safetensors
            failures += run_model(name, fla_model, path, args.lengths, args.batch, device, report, dtypes,
                                  tuple(args.backends), args.tolerance)
            del fla_model
            free(device)
    report.add("")
    report.add(f"relative error above {args.tolerance:g}: {failures}" if failures
               else f"every linmem row within {args.tolerance:g} of FLA")
    report.log("done")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
