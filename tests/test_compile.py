"""``torch.compile`` of the blocks (``linmem.train.compile``): a compiled model's loss and every gradient equal the
eager model's in float64, with and without gradient checkpointing (the recomputation runs the compiled code too)
and under FSDP2; the op is the only graph break; ``train.compile`` and ``--compile`` are checked and recorded.

Compiled with dynamo's ``aot_eager`` backend: the same tracing, autograd graphs and graph breaks as inductor, no C++
compiler and seconds per test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

from linmem.bench import training
from linmem.models import LinMemConfig, LinMemForCausalLM
from linmem.train.compile import BLOCK_PARTS, COMPILE_MODES, compile_blocks, compile_mode, compiled_parts
from linmem.train.config import TrainConfig, parse_config
from linmem.train.distributed import Distributed, enable_gradient_checkpointing, fully_shard_model, start_local_group
from linmem.train.trainer import build_optimizer, setup
from tests.test_train_support import tiny_config  # noqa: F401  (fixture)

LAYERS = 2


class CountingBackend:
    """Dynamo's ``aot_eager`` backend that counts the graphs it compiles and how often their forward runs."""

    def __init__(self):
        self.graphs = 0
        self.calls = 0
        self.inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        compiled = self.inner(graph, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # graphs of another test (or model shape) are not reused here
    yield
    torch._dynamo.reset()


def tiny_model(mixer: str, seed: int) -> LinMemForCausalLM:
    torch.manual_seed(seed)
    config = LinMemConfig(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_heads=2, head_dim=16,
                          intermediate_size=48, mixer=mixer, backend="chunk", use_cache=False)
    return LinMemForCausalLM(config).double()


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in model.named_parameters()}
    return loss.detach(), grads


def assert_same(compiled: tuple, eager: tuple) -> None:
    """Loss and every gradient equal in float64 (the compiled graphs run the same ATen ops; only the order of a
    few float64 roundings may differ)."""
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-12, atol=1e-12)
    assert compiled[1].keys() == eager[1].keys()
    for name, grad in eager[1].items():
        assert grad is not None and bool(grad.abs().sum() > 0), name
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["rdn", "gdn"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_match_eager(mixer, checkpointing):
    eager = tiny_model(mixer, seed=len(mixer))
    model = copy.deepcopy(eager)
    if checkpointing:
        enable_gradient_checkpointing(eager)
        enable_gradient_checkpointing(model)
    backend = CountingBackend()
    assert compile_blocks(model, backend=backend) == LAYERS * len(BLOCK_PARTS) == compiled_parts(model)
    assert compiled_parts(eager) == 0 and model.state_dict().keys() == eager.state_dict().keys()
    ids = torch.randint(0, 64, (2, 24))
    expected = loss_and_grads(eager, ids)
    assert_same(loss_and_grads(model, ids), expected)
    graphs, calls = backend.graphs, backend.calls
    assert graphs > 0, "nothing was compiled"
    # every block runs the same graphs: one per norm and MLP, and the mixer's code on each side of the op
    assert calls % LAYERS == 0 and calls >= LAYERS * len(BLOCK_PARTS)
    again = loss_and_grads(model, ids)  # a second step reuses the graphs
    assert_same(again, expected)
    assert backend.graphs == graphs and backend.calls == 2 * calls


def test_checkpointing_recomputes_through_the_compiled_graphs():
    """Under checkpointing the backward pass reruns each block: the compiled forward graphs run twice per step."""
    runs = {}
    for checkpointing in (False, True):
        torch._dynamo.reset()
        model = tiny_model("rdn", seed=1)
        if checkpointing:
            enable_gradient_checkpointing(model)
        backend = CountingBackend()
        compile_blocks(model, backend=backend)
        loss_and_grads(model, torch.randint(0, 64, (1, 16)))
        runs[checkpointing] = backend.calls
    assert runs[False] > 0 and runs[True] == 2 * runs[False]


def test_the_op_is_the_only_graph_break():
    """The mixer (projections, short convolutions, gates, output norm), the norms and the MLP trace whole; the
    mixer splits where it calls ``linear_memory`` (marked ``torch.compiler.disable``) and nowhere else."""
    block = tiny_model("rdn", seed=2).model.layers[0]
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    for part in ("attn_norm", "mlp_norm", "mlp"):
        explained = torch._dynamo.explain(getattr(block, part))(x)
        assert explained.graph_break_count == 0, part
    explained = torch._dynamo.explain(block.attn)(x)
    reasons = [b.reason for b in explained.break_reasons]
    assert explained.graph_break_count >= 1 and reasons
    assert all("linear_memory" in r and "torch.compiler.disable" in r for r in reasons), reasons
    conv = block.attn.q_conv1d
    assert torch._dynamo.explain(conv)(torch.randn(2, 16, conv.hidden_size, dtype=torch.float64)).graph_break_count \
        == 0


def test_compiled_blocks_under_fsdp2_match_eager():
    """Compile, then ``fully_shard`` (one process, gloo): FSDP2's hooks stay outside the compiled parts."""
    started = start_local_group(torch.device("cpu"))
    try:
        eager = tiny_model("rdn", seed=3)
        model = copy.deepcopy(eager)
        for m in (eager, model):
            enable_gradient_checkpointing(m)
        backend = CountingBackend()
        compile_blocks(model, backend=backend)
        fully_shard_model(eager)
        fully_shard_model(model)
        ids = torch.randint(0, 64, (2, 16))
        assert_same(loss_and_grads(model, ids), loss_and_grads(eager, ids))
        assert backend.graphs > 0 and compiled_parts(model) == LAYERS * len(BLOCK_PARTS)
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("value, mode", [(False, None), (True, "default"),
                                         *[(m, m) for m in COMPILE_MODES]])
def test_config_option_round_trips(dataset, value, mode):
    config = parse_config(tiny_config(dataset, train={"compile": value}))
    assert compile_mode(config.train.compile) == mode
    again = parse_config(config.to_dict())
    assert isinstance(again, TrainConfig) and again.train.compile == config.train.compile
    assert parse_config(tiny_config(dataset)).train.compile is False  # off unless asked


@pytest.mark.parametrize("value", ["fast", "inductor", 1, 0.5, None, ["default"], {"mode": "default"}])
def test_bad_compile_values_name_the_key(dataset, value):
    with pytest.raises(ValueError, match=r"train\.compile"):
        parse_config(tiny_config(dataset, train={"compile": value}))
    with pytest.raises(ValueError, match="mode must be one of"):
        compile_blocks(tiny_model("gdn", seed=0), mode="fast")


def test_trainer_compiles_the_blocks_only_when_asked(dataset, tmp_path):
    for value, parts in ((False, 0), (True, None)):
        run = setup(parse_config(tiny_config(dataset, train={"compile": value, "device": "cpu"})), tmp_path,
                    Distributed(), "config")
        blocks = len(run.model.model.layers)
        assert compiled_parts(run.model) == (parts if parts is not None else blocks * len(BLOCK_PARTS))


def test_bench_records_compile():
    parser = training.build_parser()
    assert parser.parse_args([]).compile is None
    assert parser.parse_args(["--compile"]).compile == "default"
    assert parser.parse_args(["--compile", "max-autotune-no-cudagraphs"]).compile == "max-autotune-no-cudagraphs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "fast"])
    env = dict(device="cpu", gpu=None, torch=torch.__version__, triton=None)
    for argv, text in (([], "eager (no torch.compile)"), (["--compile"], "torch.compile per block (mode default)")):
        args = parser.parse_args(argv)
        args.intermediate_size = 3 * args.hidden
        assert text in training.settings_line(args, env)
        args.checkpointing, args.loss_chunk = "on", 0
        assert text in training.paper_settings_line(args, env)


def test_fused_adamw_takes_the_default_steps_under_fsdp2():
    """``optim.fused``: PyTorch's fused AdamW on FSDP2's sharded parameters makes the same updates as the default
    (for-each) AdamW, in float64, with weight decay on the matrices only."""
    started = start_local_group(torch.device("cpu"))
    try:
        models, ids = [], torch.randint(0, 64, (2, 16))
        for fused in (False, True):
            model = fully_shard_model(tiny_model("rdn", seed=5))
            config = parse_config({"name": "t", "data": {"dir": "unused"}, "optim": {"fused": fused, "lr": 1e-2}})
            optimizer = build_optimizer(model, config)
            assert optimizer.defaults["fused"] is (True if fused else None)
            for _ in range(3):
                loss_and_grads(model, ids)
                optimizer.step()
            models.append({name: p.full_tensor() for name, p in model.named_parameters()})
        start = tiny_model("rdn", seed=5).state_dict()
        for name, fused_value in models[1].items():
            torch.testing.assert_close(fused_value, models[0][name], rtol=1e-12, atol=1e-12, msg=name)
            assert not torch.equal(fused_value, start[name]), f"{name} did not move"
    finally:
        if started:
            dist.destroy_process_group()
