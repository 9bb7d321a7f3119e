"""The op's backend is chosen when a model runs: never saved in ``config.json``, one found there not used, set by
``--backend`` on every command that runs a model (and ``model.set_backend``), and a named ``triton`` runs the
kernels or says why it cannot."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from linmem.cli import build_parser
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.models.loading import load_weights
from linmem.ops import linear_memory
from tests.test_train_support import tiny_config

ZOO_MODEL = "zoo:rdn"


def tiny_model(**options) -> LinMemForCausalLM:
    torch.manual_seed(0)
    config = LinMemConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_heads=2, head_dim=8, mixer="rdn",
                          intermediate_size=24, **options)
    return LinMemForCausalLM(config).eval()


def mixer_backends(model) -> set[str]:
    return {layer.attn.backend for layer in model.model.layers}


IDS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- config.json


def test_saved_config_json_has_no_backend(tmp_path):
    tiny_model(backend="reference").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "backend" not in saved and saved["mixer"] == "rdn"


def test_a_config_json_with_a_backend_loads_on_the_backend_chosen_at_load(tmp_path, monkeypatch):
    """A folder whose config.json says 'triton' (saved on a GPU machine) loads and runs on a CPU without Triton's
    interpreter: the saved backend is not used."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "backend": "triton"}))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with torch.no_grad():
        want = model(IDS).logits
        loaded, _ = load_weights(tmp_path)
        assert mixer_backends(loaded) == {"auto"}
        assert torch.equal(loaded(IDS).logits, want)
        chosen, _ = load_weights(tmp_path, backend="reference")
        assert mixer_backends(chosen) == {"reference"} and chosen.config.backend == "reference"
        assert torch.allclose(chosen(IDS).logits, want, atol=1e-5)
        from_hf = LinMemForCausalLM.from_pretrained(tmp_path, backend="chunk")
        assert mixer_backends(from_hf) == {"chunk"}


def test_set_backend_checks_the_name_and_sets_every_mixer():
    model = tiny_model()
    assert model.set_backend("reference") is model and mixer_backends(model) == {"reference"}
    with pytest.raises(ValueError, match="backend must be one of .*got 'cuda'"):
        model.set_backend("cuda")
    with pytest.raises(ValueError, match="got 'cuda'"):
        tiny_model(backend="cuda")


# ---------------------------------------------------------------- triton named where it cannot run


def test_triton_on_the_cpu_without_the_interpreter_says_why(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model().set_backend("triton")
    with pytest.raises(ValueError, match="backend='triton' cannot run here: the tensors are on cpu.*TRITON_INTERPRET"):
        model(IDS)


def memory_inputs(key_dim: int = 8, dtype=torch.float32, per_key: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, key_dim, generator=gen, dtype=dtype) for _ in range(3))
    decay_shape = (1, 6, 2, key_dim) if per_key else (1, 6, 2)
    g = -torch.rand(*decay_shape, generator=gen, dtype=dtype)
    beta, gamma = (torch.rand(1, 6, 2, generator=gen, dtype=dtype) for _ in range(2))
    return dict(q=torch.nn.functional.normalize(q, dim=-1), k=torch.nn.functional.normalize(k, dim=-1), v=v, g=g,
                beta=beta, gamma=gamma)


UNCOVERED = [
    (dict(dtype=torch.float64), {}, "q, k and v are float64"),
    (dict(per_key=True), {}, r"g is a per-key-channel decay \[B, T, H, K\] with a residual memory"),
    (dict(key_dim=272), {}, "the heads are K = 272, V = 272 wide"),
]


@pytest.mark.parametrize(("inputs", "switches", "reason"), UNCOVERED, ids=["float64", "per-key", "wide"])
def test_triton_refuses_inputs_its_kernels_do_not_take_and_auto_runs_chunk(inputs, switches, reason, monkeypatch):
    """Named, the kernels' backend refuses (the reason names the input or switch) instead of running chunk; auto
    still runs chunk there."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels could run on this device: only the inputs stop them
    x = memory_inputs(**inputs)
    options = dict(rule="additive", residual=True, **switches)
    with pytest.raises(ValueError, match=f"backend='triton' cannot run here: {reason}"):
        linear_memory(**x, **options, backend="triton")
    auto, _ = linear_memory(**x, **options, backend="auto")
    assert torch.equal(auto, linear_memory(**x, **options, backend="chunk")[0])


# ---------------------------------------------------------------- --backend on every command


class OpCalled(Exception):
    """Raised by the op's stand-in at its first call, with the backend the mixer passed it."""


@pytest.fixture
def op_backend(monkeypatch):
    """The mixers' op replaced by one that stops the command at its first call, naming the backend it got."""
    def first_call(*args, backend, **kwargs):
        raise OpCalled(backend)

    monkeypatch.setattr("linmem.layers.recurrent.linear_memory", first_call)


def run_command(argv: list[str]) -> str:
    """The backend the first op call of ``linmem ARGV`` got."""
    args = build_parser(argv[0]).parse_args(argv)
    with pytest.raises(OpCalled) as called:
        args.func(args)
    return called.value.args[0]


@pytest.mark.parametrize("command", ["eval", "probe", "demo"])
def test_backend_option_reaches_the_op(command, op_backend, tmp_path):
    fillers = [tmp_path / f"filler{i}.txt" for i in range(12)]  # passages of a split by source: several files
    for i, path in enumerate(fillers):
        path.write_text(f"Text number {i} for the probe's filler, read before the model runs. " * 30)
    argv = {"eval": ["eval", ZOO_MODEL, "--tasks", "mqar", "--device", "cpu"],
            "probe": ["probe", ZOO_MODEL, "--device", "cpu", "--sources", *map(str, fillers), "--filler", "64",
                      "--no-sweeps", "--bindings", "2", "--repeats", "1"],
            "demo": ["demo", "--quick", "--models", "rdn"]}[command]
    argv += ["--out", str(tmp_path / "out")]
    assert run_command([*argv, "--backend", "reference"]) == "reference"
    assert build_parser(command).parse_args(argv).backend == "auto"
    with pytest.raises(SystemExit):
        build_parser(command).parse_args([*argv, "--backend", "cuda"])


def test_train_backend_option_reaches_the_op(op_backend, dataset, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(dataset, train={"backend": "chunk"})))
    assert run_command(["train", str(path), "--out", str(tmp_path / "run")]) == "chunk"
    assert run_command(["train", str(path), "--out", str(tmp_path / "run2"), "--backend", "reference"]) == "reference"


def test_a_training_config_with_model_backend_still_reads():
    from linmem.train.config import build_model_config, parse_config

    config = parse_config(tiny_config(Path("data"), model={"backend": "reference"}))
    assert config.train.backend == "reference" and "backend" not in config.model
    assert build_model_config(config, 600).backend == "reference"
    with pytest.raises(ValueError, match="model.backend 'chunk' and train.backend 'reference' differ"):
        parse_config(tiny_config(Path("data"), model={"backend": "chunk"}, train={"backend": "reference"}))
    with pytest.raises(ValueError, match="train.backend must be one of"):
        parse_config(tiny_config(Path("data"), train={"backend": "cuda"}))


# ---------------------------------------------------------------- the zoo


def test_zoo_loads_with_the_same_logits_on_a_chosen_backend():
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        default, folder = load_weights(ZOO_MODEL)
        chunk, _ = load_weights(ZOO_MODEL, backend="chunk")
        assert "backend" in json.loads((folder / "config.json").read_text())  # the shipped config.json names one
        assert mixer_backends(default) == {"auto"} and mixer_backends(chunk) == {"chunk"}
        assert torch.equal(default(ids).logits, chunk(ids).logits)
