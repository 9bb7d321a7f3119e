"""linmem among the tools its users bring: special tokens for ``generate()``, lm-evaluation-harness from the shell,
the package's declared dependencies, model cards the Hub can index, the CLI's version and help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

from linmem import zoo
from linmem.models import LinMemForCausalLM
from linmem.train.config import parse_config
from linmem.train.trainer import train
from tests.test_train_support import tiny_config

ROOT = Path(__file__).resolve().parents[1]
OLD_EOS = 2  # the id every model declared as end-of-text before the ids came from the tokenizer


class ForceTokens(LogitsProcessor):
    """Greedy decoding steered per row: ``plan[row][step]`` is forced at that generation step; end-of-text is
    ruled out at every other step, so generation can only end where the plan puts it."""

    def __init__(self, prompt_length: int, plan: dict[int, dict[int, int]], eos_id: int):
        self.prompt_length, self.plan, self.eos_id = prompt_length, plan, eos_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length
        scores = scores.clone()
        scores[:, self.eos_id] = -float("inf")
        for row, forced in self.plan.items():
            if step in forced:
                scores[row] = -float("inf")
                scores[row, forced[step]] = 0.0
        return scores


def check_special_tokens(folder: Path) -> None:
    """The folder's config and generation config carry its tokenizer's ids, and ``generate()`` ends a row exactly
    at end-of-text (not at the old id 2) and pads it with the pad id."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    model = LinMemForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    assert eos is not None and eos != OLD_EOS
    assert (model.config.eos_token_id, model.generation_config.eos_token_id) == (eos, eos)
    assert (model.config.pad_token_id, model.generation_config.pad_token_id) == (pad, pad)
    assert model.config.bos_token_id == model.generation_config.bos_token_id == tokenizer.bos_token_id
    assert model.config.architectures == ["LinMemForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        saved = f.get_tensor(next(iter(f.keys()))).dtype
    assert json.loads((folder / "config.json").read_text())["dtype"] == str(saved).removeprefix("torch.")
    prompt = torch.tensor([tokenizer("The secret number")["input_ids"]] * 2)
    plan = {0: {1: OLD_EOS, 2: eos}, 1: {4: eos}}  # row 0 passes the old id, then ends; row 1 ends later
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False,
                             logits_processor=LogitsProcessorList([ForceTokens(prompt.shape[1], plan, eos)]))
    generated = out[:, prompt.shape[1]:]
    assert generated.shape[1] == 5  # both rows stopped at their end-of-text, none ran to max_new_tokens
    assert generated[0, 1] == OLD_EOS and generated[0, 2] == eos and generated[0, 3:].eq(pad).all()
    assert generated[1, 4] == eos and not generated[1, :4].eq(eos).any()


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_shipped_model_declares_its_tokenizers_special_tokens(name):
    check_special_tokens(zoo.path(name))
    generation = json.loads((zoo.path(name) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0 and generation["pad_token_id"] == 1


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory) -> Path:
    """A tiny model trained for two updates by ``linmem.train`` (its ``OUT/model`` folder)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(parse_config(tiny_config(dataset, train={"steps": 2, "eval_interval": 2, "checkpoint_interval": 2})), out)
    return out / "model"


def test_trained_model_declares_its_tokenizers_special_tokens(trained, dataset):
    check_special_tokens(trained)
    index = json.loads((dataset / "index.json").read_text())
    config = json.loads((trained / "config.json").read_text())
    assert index["special_token_ids"] == {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ---------------------------------------------------------------- lm-evaluation-harness

# lm_eval joins context and choice with its target delimiter, one space
ITEMS = [("Alice likes the", ["red", "blue"], 0), ("Bob likes the", ["green", "black"], 1),
         ("The quick brown", ["fox", "dog"], 0), ("Every morning bright", ["birds", "wizards"], 0)]
TASK = """task: linmem_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_task(folder: Path) -> Path:
    """A 4-item multiple-choice task over a local JSONL file (``--include_path folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in ITEMS))
    (folder / "linmem_tiny_choice.yaml").write_text(TASK.format(data=data))
    return folder


def run_lm_eval(args: list[str], tmp_path: Path, preamble: str = "") -> dict:
    """lm_eval's CLI in a fresh process started as ``lm_eval``, with linmem's ``.pth`` hook processed as
    site-packages processes it; returns the results JSON (with the logged samples under ``samples``)."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    argv = ["lm_eval", *args, "--output_path", str(out), "--log_samples", "--device", "cpu"]
    code = (f"import site, sys; sys.argv = {argv!r}; site.addsitedir({str(ROOT / 'packaging')!r}); {preamble}"
            "from lm_eval.__main__ import cli_evaluate; cli_evaluate()")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.read_text().splitlines()]
    return {**results, "samples": sorted(samples, key=lambda s: s["doc_id"]), "stdout": done.stdout}


def choice_logprobs(results: dict) -> torch.Tensor:
    return torch.tensor([[float(r[0]) for r in sample["filtered_resps"]] for sample in results["samples"]],
                        dtype=torch.float64)


def reference_logprobs(folder: Path) -> torch.Tensor:
    """log p(choice | context) of every item, from the model's float64 logits over the tokens as given (no
    document start: what ``hf`` scores)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    model = LinMemForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()
    rows = []
    for context, choices, _ in ITEMS:
        row = []
        for choice in choices:
            ids, cont = tokenizer(context)["input_ids"], tokenizer(" " + choice)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids + cont])).logits[0].log_softmax(-1)
            row.append(sum(float(logits[len(ids) - 1 + i, t]) for i, t in enumerate(cont)))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.slow
def test_lm_eval_cli_runs_linmem_on_a_local_task(trained, tmp_path):
    """``lm_eval --model linmem`` runs a local task in a process started as the lm_eval CLI, and with
    ``document_start=false`` scores each choice as the model's own log-probabilities over the plain tokens."""
    tasks = write_task(tmp_path / "tasks")
    results = run_lm_eval(["--model", "linmem", "--model_args", f"pretrained={trained},document_start=false",
                           "--tasks", "linmem_tiny_choice", "--include_path", str(tasks), "--batch_size", "2"],
                          tmp_path)
    assert len(results["samples"]) == len(ITEMS)
    expected = reference_logprobs(trained)
    torch.testing.assert_close(choice_logprobs(results), expected, rtol=0, atol=1e-4)
    accuracy = sum(int(row.argmax()) == answer for row, (*_, answer) in zip(expected, ITEMS)) / len(ITEMS)
    assert results["results"]["linmem_tiny_choice"]["acc,none"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_lm_eval_cli_keeps_its_own_models(trained, tmp_path):
    """With linmem's hook, the lm_eval CLI still lists and runs its built-in models: ``--model hf`` on the same
    weights (linmem imported first, so transformers knows the model type) scores each choice as linmem's adapter
    does with ``document_start=false``."""
    pytest.importorskip("accelerate")  # lm_eval's hf model needs it (lm_eval[hf], part of linmem[eval])
    tasks = write_task(tmp_path / "tasks")
    results = run_lm_eval(["--model", "hf", "--model_args", f"pretrained={trained},dtype=float32", "--tasks",
                           "linmem_tiny_choice", "--include_path", str(tasks), "--batch_size", "2"], tmp_path,
                          preamble="import linmem; from lm_eval.api.registry import model_registry as r; "
                          "print('MODELS', sorted(r.keys())); ")
    listed = [line for line in results["stdout"].splitlines() if line.startswith("MODELS")][0]
    assert "'hf'" in listed and "'linmem'" in listed and "'vllm'" in listed
    torch.testing.assert_close(choice_logprobs(results), reference_logprobs(trained), rtol=0, atol=1e-4)


def test_harness_registry_keeps_lm_evals_models_and_checks_model_args(trained):
    from lm_eval.api.registry import get_model, model_registry

    import linmem.eval.harness as harness

    assert get_model("linmem") is harness.LinMemLM
    assert "hf" in model_registry and get_model("dummy").__name__ == "DummyLM"  # lm_eval's own models stay
    with pytest.raises(ValueError, match="unknown model_args.*max_lenght"):
        harness.LinMemLM.create_from_arg_string(f"pretrained={trained},max_lenght=64")
    with pytest.raises(ValueError, match="dtype"):
        harness.LinMemLM(pretrained=str(trained), dtype="float8")
    lm = harness.LinMemLM.create_from_arg_string(f"pretrained={trained},dtype=bfloat16,document_start=false")
    assert lm.em.model.dtype == torch.bfloat16
    ids = lm.em.encode("Alice likes")
    assert lm._encode_context("Alice likes") == ids
    framed = harness.LinMemLM(pretrained=lm.em)
    assert framed._encode_context("Alice likes") == [lm.em.document_start, *ids]


# ---------------------------------------------------------------- packaging, cards, CLI


def test_declared_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    assert any(d.startswith("matplotlib") for d in base)  # the demo draws its figures with it
    assert "torch>=2.6" in base  # torch.distributed.fsdp.fully_shard is public from 2.6
    extras = project["optional-dependencies"]
    for extra in ("fla", "dev"):
        assert "flash-linear-attention>=0.6.0,<0.7" in extras[extra]
    assert set(extras) >= {"data", "gpu", "fla", "eval", "memory", "dev"}


@pytest.mark.parametrize("name", zoo.names())
def test_shipped_model_card_has_hub_front_matter(name):
    import yaml

    text = (zoo.path(name) / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["library_name"] == "linmem" and meta["license"] == "apache-2.0"
    record = zoo.eval_record(name)
    architecture = "transformer" if name == "transformer" else record["mixer"]
    assert meta["pipeline_tag"] == "text-generation" and {"linmem", architecture} <= set(meta["tags"])
    assert text.split("---\n", 2)[2].lstrip("\n").startswith(f"# linmem zoo: `{name}`")


def test_cli_version_and_data_help(capsys):
    from linmem import __version__
    from linmem.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"linmem {__version__}"
    for command in ("build", "info"):
        with pytest.raises(SystemExit):
            main(["data", command, "--help"])
        description = capsys.readouterr().out.split("\n\n")[1]
        assert not description.lstrip().startswith(("positional", "options")) and len(description) > 40


def test_fla_import_keeps_flas_special_tokens(tmp_path):
    """An imported FLA checkpoint keeps the ids its own config declares (FLA's tokenizers, not linmem's), in
    ``config.json`` and ``generation_config.json``."""
    pytest.importorskip("fla")
    from linmem.models import convert_fla_checkpoint
    from tests.test_fla_import import GLA_PLAIN, save_fla  # building and saving needs no FLA kernel

    ids = {"bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7}
    save_fla("gla", {**GLA_PLAIN, **ids}, tmp_path / "fla", seed=0)
    out = convert_fla_checkpoint(tmp_path / "fla", tmp_path / "linmem")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert {k: config[k] for k in ids} == {k: generation[k] for k in ids} == ids
    assert config["architectures"] == ["LinMemForCausalLM"]
