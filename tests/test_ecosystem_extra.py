"""linmem with the habits of interpretability and Hugging Face users: hook points edited in place under autograd,
``output_attentions``, pyvene's module mapping, distributed validation over every window, a CLI that answers before
importing torch, and perplexities that say which text they were measured on."""

from __future__ import annotations

import pytest
import torch

from linmem.layers.hooks import HookPoint
from linmem.models import LinMemConfig, LinMemForCausalLM
from tests.mixer_cases import MIXER_CASES

VOCAB = 48


def tiny_model(case: dict, **overrides) -> LinMemForCausalLM:
    """A two-layer float64 model of ``case`` (``MIXER_CASES``) with fresh random weights."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16)
    settings.update(case)
    settings.update(overrides)
    return LinMemForCausalLM(LinMemConfig(**settings)).double()


def loss_and_grads(model: LinMemForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def hook_point_names(model: LinMemForCausalLM) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, HookPoint)]


def edit_in_place(module, args, out):
    """Copy the first row along axis 1 into the second (a token into the next, or a state's head into the next),
    then scale everything by 0.75."""
    out[:, 1] = out[:, 0]
    out.mul_(0.75)


def edit_out_of_place(module, args, out):
    """``edit_in_place`` on a new tensor, returned to replace the hook point's tensor."""
    edited = out.clone()
    edited[:, 1] = edited[:, 0]
    return edited * 0.75


HOOK_EDIT_CASES = [(case, "chunk") for case in sorted(MIXER_CASES)] + [("rdn", "reference")]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "backend"), HOOK_EDIT_CASES)
def test_every_hook_point_can_be_edited_in_place_under_autograd(case, backend):
    """An in-place edit of a hook point's tensor (index assignment and ``mul_``) gives the loss and gradients of the
    same edit returned as a new tensor, and differs from the unedited run (the edit took effect)."""
    torch.manual_seed(0)
    model = tiny_model(MIXER_CASES[case], backend=backend,
                       num_hidden_layers=MIXER_CASES[case].get("num_hidden_layers", 1))
    ids = torch.randint(0, VOCAB, (2, 7))
    clean_loss, _ = loss_and_grads(model, ids)
    names = hook_point_names(model)
    assert any(name.endswith("hook_readout") for name in names)
    modules = dict(model.named_modules())
    for name in names:
        handle = modules[name].register_forward_hook(edit_in_place)
        try:
            edited_loss, edited_grads = loss_and_grads(model, ids)
        finally:
            handle.remove()
        handle = modules[name].register_forward_hook(edit_out_of_place)
        try:
            expected_loss, expected_grads = loss_and_grads(model, ids)
        finally:
            handle.remove()
        assert torch.isfinite(edited_loss) and all(torch.isfinite(g).all() for g in edited_grads), name
        torch.testing.assert_close(edited_loss, expected_loss, msg=name)
        for got, want in zip(edited_grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, msg=name)
        if not name.endswith("state"):  # the final states feed no output of this forward
            assert edited_loss != clean_loss, f"{name}: the in-place edit had no effect"


HYBRID = MIXER_CASES["rdn_hybrid"]


def reference_weights(model: LinMemForCausalLM, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """``softmax(q kᵀ / √d)`` under a causal mask, in float64, from the queries and keys the attention layer
    ``layer`` sees at its hook points (kv heads repeated for grouped-query attention): ``[B, H, T, T]``."""
    seen = {}
    attn = model.model.layers[layer].attn
    handles = [getattr(attn, f"hook_{name}").register_forward_hook(
        lambda module, args, out, name=name: seen.__setitem__(name, out.detach())) for name in ("q", "k")]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    q, k = seen["q"].transpose(1, 2), seen["k"].transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def test_output_attentions_gives_each_attention_layers_weights_and_none_for_memories():
    """A hybrid's ``attentions`` hold the softmax weights of its attention layer (equal to a float64 reference from
    the hooked queries and keys) and None for its linear-memory layers; logits and gradients equal those of the
    fused-kernel path."""
    torch.manual_seed(1)
    model = tiny_model(HYBRID)
    ids = torch.randint(0, VOCAB, (2, 9))
    out = model(ids, output_attentions=True)
    assert len(out.attentions) == model.config.num_hidden_layers
    for layer, weights in enumerate(out.attentions):
        if layer not in model.config.attention.layers:
            assert weights is None
            continue
        assert weights.shape == (2, model.config.attention.num_heads, 9, 9)
        torch.testing.assert_close(weights, reference_weights(model, ids, layer))
    assert model(ids).attentions is None
    _, fused_grads = loss_and_grads(model, ids)
    model.zero_grad()
    explicit = model(ids, labels=ids, output_attentions=True)
    explicit.loss.backward()
    torch.testing.assert_close(explicit.logits, model(ids).logits)
    for got, want in zip([p.grad for p in model.parameters() if p.grad is not None], fused_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_output_attentions_with_padding_and_a_cache_match_each_row_alone():
    """With a padded batch, each row's weights equal the row run alone (0 at padded keys and queries); a decoding
    step's weights ``[B, H, 1, T + 1]`` equal the last query row of the whole sequence's weights; a model without
    attention layers gives one None per layer."""
    torch.manual_seed(2)
    model = tiny_model(HYBRID).eval()
    layer = model.config.attention.layers[0]
    ids = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    for use_cache in (True, False):  # the masked path and the unpadded (packed) path
        weights = model(ids, attention_mask=mask, use_cache=use_cache, output_attentions=True).attentions[layer]
        for row in range(2):
            real = mask[row].bool()
            alone = model(ids[row:row + 1, real], output_attentions=True).attentions[layer][0]
            torch.testing.assert_close(weights[row][:, real][:, :, real], alone)
            assert (weights[row][:, ~real] == 0).all() and (weights[row][:, :, ~real] == 0).all()
    full = model(ids, output_attentions=True).attentions[layer]
    prefix = model(ids[:, :-1], use_cache=True)
    step = model(ids[:, -1:], cache=prefix.cache if hasattr(prefix, "cache") else prefix.past_key_values,
                 use_cache=True, output_attentions=True).attentions[layer]
    assert step.shape == (2, model.config.attention.num_heads, 1, 8)
    torch.testing.assert_close(step, full[:, :, -1:])
    plain = tiny_model(MIXER_CASES["rla"])
    assert plain(ids, output_attentions=True).attentions == (None,) * plain.config.num_hidden_layers


def test_every_printed_perplexity_says_which_text_and_how_many_tokens(tmp_path, capsys):
    """``linmem zoo list``, ``linmem eval`` (its output and results.md) and the demo's summary table give each
    perplexity with the split and the number of tokens it was measured on, as the measurement recorded them."""
    import json

    from linmem import zoo
    from linmem.cli import main
    from linmem.demo import summary_rows

    assert main(["zoo", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    for name in zoo.names():
        metrics = json.loads((zoo.path(name) / "eval.json").read_text())["eval"]["tasks"]["ppl"]["metrics"]
        row = next(line for line in listed if line.split()[0] == name)
        assert f"{metrics['ppl']:.1f}  first {metrics['tokens']:,} {metrics['split']} tokens" in row

    max_tokens = int(torch.randint(3, 6, ()).item()) * 128
    out = tmp_path / "eval"
    assert main(["eval", "zoo:rla", "--tasks", "ppl", "--max-tokens", str(max_tokens), "--seq-len", "128",
                 "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    results = (out / "results.md").read_text()
    metrics = report["tasks"]["ppl"]["metrics"]
    assert metrics["tokens"] == max_tokens // 128 * 127
    described = f"{metrics['ppl']:.2f} (first {metrics['tokens']:,} test tokens, 128-token windows)"
    assert f"ppl: test ppl {described}" in printed
    assert f"Test perplexity {described}." in results

    rows = summary_rows({"rla": {**report, "mixer": "rla", "seconds": 1.0, "vocab_size": 1024}})
    assert rows[0]["test ppl"] == described


def test_rank_batches_cover_every_row_once_with_equal_batch_counts():
    """``rank_batches`` puts each row on exactly one of W processes (shares differ by at most one row) and gives
    every process the same number of batches, the padding batches marked as not counted."""
    from linmem.train.distributed import Distributed, rank_batches

    for _ in range(20):
        rows, world, batch = (int(torch.randint(lo, hi, ())) for lo, hi in ((0, 40), (1, 5), (1, 6)))
        items = torch.randperm(100)[:rows]
        per_rank = [list(rank_batches(items, Distributed(rank=r, world_size=world), batch)) for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        counted = [b for batches in per_rank for b, keep in batches if keep]
        assert sorted(torch.cat(counted).tolist() if counted else []) == sorted(items.tolist())
        shares = [sum(len(b) for b, keep in batches if keep) for batches in per_rank]
        assert max(shares) - min(shares) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_validate_every_window_like_one(dataset, tmp_path, parallel):
    """Validation over 2 processes scores all 5 windows and all 5 recall samples (odd counts, so an equal split
    would drop one): val_loss and recall accuracy equal the one-process run's, under DDP and FSDP2 (where the
    process with the smaller share runs a padding batch to keep the all-gathers in step). The learning rate is ~0,
    so both runs validate the same weights."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from linmem.train.config import parse_config
    from linmem.train.trainer import train
    from tests.test_train_support import tiny_config

    seq_len = 32
    config = tiny_config(dataset, optim={"lr": 1e-12, "min_lr": 1e-12, "warmup_steps": 0},
                         train={"steps": 1, "eval_interval": 1, "eval_tokens": 5 * seq_len, "eval_recall_samples": 5,
                                "checkpoint_interval": 0, "micro_batch_size": 2, "parallel": parallel})
    train(parse_config(config), tmp_path / "one")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "linmem.cli", "train", str(path), "--out", str(tmp_path / "two")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def validation(folder):
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r.get("val_loss") is not None)

    one, two = validation(tmp_path / "one"), validation(tmp_path / "two")
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    assert two["val_recall_acc"] == pytest.approx(one["val_recall_acc"], abs=1e-12)


@pytest.mark.parametrize("case", ["rdn", "rdn_hybrid"])
def test_pyvene_swaps_a_block_output_like_a_forward_hook(case):
    """After ``register_pyvene``, pyvene's vanilla intervention on ``block_output`` (a position of the base run
    replaced by the source run's) gives the logits of the same swap done with a plain forward hook, and its
    collect intervention returns the block's output at that position. Skipped without pyvene."""
    pyvene = pytest.importorskip("pyvene")
    from linmem.integrations.pyvene import register_pyvene

    register_pyvene()
    torch.manual_seed(3)
    model = tiny_model(MIXER_CASES[case]).eval()
    layer, position = int(torch.randint(0, model.config.num_hidden_layers, ())), 3
    base, source = torch.randint(0, VOCAB, (2, 1, 7))
    with torch.no_grad():
        seen = {}
        block = model.model.layers[layer]
        handle = block.register_forward_hook(lambda m, a, out: seen.__setitem__("source", out.clone()))
        model(source)
        handle.remove()

        def swap(module, args, out):
            out = out.clone()
            out[:, position] = seen["source"][:, position]
            return out

        handle = block.register_forward_hook(swap)
        expected = model(base).logits
        handle.remove()
        clean = model(base).logits

    swapped = pyvene.IntervenableModel({"layer": layer, "component": "block_output",
                                        "intervention_type": pyvene.VanillaIntervention}, model)
    _, out = swapped({"input_ids": base}, [{"input_ids": source}],
                     {"sources->base": ([[[position]]], [[[position]]])})
    torch.testing.assert_close(out.logits, expected)
    assert not torch.allclose(out.logits, clean)
    collect = pyvene.IntervenableModel({"layer": layer, "component": "block_output",
                                        "intervention_type": pyvene.CollectIntervention}, model)
    (_, collected), _ = collect({"input_ids": source}, unit_locations={"base": position})
    torch.testing.assert_close(collected[0].reshape(-1), seen["source"][0, position])


def test_cli_parser_and_package_import_load_neither_torch_nor_transformers():
    """In the ``linmem`` console command (``sys.argv[0]`` is the script), ``import linmem.cli`` and building the
    top-level parser (what ``linmem --help``, ``--version`` and an unknown command need) import neither torch nor
    transformers; the first use of a model name imports them and registers the Auto classes. The time of
    ``linmem --help`` is printed, not asserted."""
    import subprocess
    import sys
    import time

    check = ("import sys\nsys.argv = ['/usr/bin/linmem', '--help']\nimport linmem, linmem.cli\n"
             "linmem.cli.build_parser()\n"
             "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
             "assert not heavy, heavy\n"
             "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
             "assert 'linmem' not in CONFIG_MAPPING\n"
             "config = linmem.LinMemConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_heads=1)\n"
             "assert CONFIG_MAPPING['linmem'] is type(config)\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = time.perf_counter()
    script = "import sys\nsys.argv = ['linmem', '--help']\nimport linmem.cli\nsys.exit(linmem.cli.main())"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "COMMAND" in proc.stdout
    print(f"linmem --help: {time.perf_counter() - start:.2f} s")


# Runs in a fresh interpreter as the console command: for every command of ``COMMANDS`` and every subcommand found
# in its parser, ``--help`` (exit 0, its usage printed) and an unknown option (argparse's usage error, exit 2) through
# ``linmem.cli.main``; after each, neither torch nor transformers may be in ``sys.modules``. Prints what it checked.
HELP_CHECK = """
import argparse, contextlib, io, json, sys
sys.argv = ['/usr/bin/linmem']
import linmem.cli as cli

def subcommands(parser):
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}

checked = []
for name in cli.COMMANDS:
    command = subcommands(cli.build_parser(name))[name]
    for path in [[name], *([name, sub] for sub in subcommands(command))]:
        for tail, expected in ((['--help'], 0), (['--no-such-option'], 2)):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    cli.main(path + tail)
                    code = None
                except SystemExit as stop:
                    code = stop.code
            assert code == expected, (path + tail, code, err.getvalue()[-500:])
            usage = 'usage: linmem ' + ' '.join(path) if expected == 0 else 'usage: linmem'
            assert usage in out.getvalue() + err.getvalue(), (path + tail, out.getvalue(), err.getvalue())
            heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)
            assert not heavy, (path + tail, heavy)
        checked.append(' '.join(path))
print(json.dumps(checked))
"""


def test_every_command_help_and_usage_error_load_neither_torch_nor_transformers():
    """``linmem CMD --help``, ``linmem CMD SUB --help`` and their argparse usage errors, for every command and every
    nested subcommand, answer without importing torch or transformers (``sys.modules`` checked after each, in a
    fresh interpreter started as the console command); the subcommands are found in the parsers, so a new one is
    checked too."""
    import json
    import subprocess
    import sys

    from linmem.cli import COMMANDS

    proc = subprocess.run([sys.executable, "-c", HELP_CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(COMMANDS) <= set(checked)
    assert {"data build", "data info", "zoo list", "zoo ship", "zoo remeasure"} <= set(checked), checked


def test_a_closed_output_pipe_ends_a_command_quietly():
    """``linmem zoo list | head -1``: when the reader of stdout has gone, the command stops with exit code 141
    (128 + SIGPIPE, as shell tools do) and prints no error."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "linmem.cli", "zoo", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command prints its first line
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr
    assert stderr.strip() == "", stderr


def test_zoo_list_reads_records_without_torch():
    """``linmem zoo list`` prints the shipped models' records (eval.json) and imports neither torch nor
    transformers, so it answers at once."""
    import subprocess
    import sys

    check = ("import sys\nsys.argv = ['/usr/bin/linmem', 'zoo', 'list']\nimport linmem.cli\n"
             "code = linmem.cli.main(['zoo', 'list'])\n"
             "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "0 []", lines[-1]
    assert any(line.startswith("rdn ") for line in lines) and "test ppl" in lines[0]


def test_plain_import_registers_the_auto_classes():
    """Outside the console command, ``import linmem`` alone lets ``AutoModelForCausalLM`` load a linmem folder."""
    import subprocess
    import sys

    check = ("import linmem\n"
             "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
             "assert CONFIG_MAPPING['linmem'].__name__ == 'LinMemConfig'\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_linmem_eval_shows_a_progress_bar(tmp_path, capsys):
    """``linmem eval`` draws a progress bar over its tasks (on stderr), naming the task it runs."""
    from linmem.cli import main

    assert main(["eval", "zoo:rdn", "--tasks", "ppl", "--max-tokens", "128", "--out", str(tmp_path / "eval")]) == 0
    err = capsys.readouterr().err
    assert "eval:" in err and "1/1" in err and "task=ppl" in err
