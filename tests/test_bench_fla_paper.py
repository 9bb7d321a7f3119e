"""The paper's FLA shapes (``linmem.bench.fla_parity.PAPER``): FLA 0.6.0's own classes give the paper's parameter
counts, and scaled-down copies written by ``write_fla_checkpoint`` import with ``load_fla_checkpoint`` and compute
FLA's logits (FLA's kernels replaced by the float64 stand-ins of tests/test_fla_import.py)."""

from __future__ import annotations

import pytest
import torch

from linmem.bench.fla_parity import PAPER, relative_error, scaled_paper_settings, write_fla_checkpoint
from linmem.models.fla_import import load_fla_checkpoint
from tests.test_fla_import import fla_on_cpu  # noqa: F401  (fixture)


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_shapes_have_the_papers_parameter_counts(name, fla_on_cpu):  # noqa: F811
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM

    kind, settings, paper_count = PAPER[name]
    config_class, model_class = ((GLAConfig, GLAForCausalLM) if kind == "gla"
                                 else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM))
    with torch.device("meta"):
        model = model_class(config_class(**settings))
    count = sum(p.numel() for p in model.parameters())
    unit = 1e6 if paper_count >= 1e9 else 1e5  # the paper's last digit: 1.466B, 341.7M
    assert abs(count - paper_count) <= unit / 2
    layer = model.model.layers[0].attn
    state = (layer.head_k_dim, layer.head_v_dim)
    assert state == ((128, 256) if kind == "gla" else (256, 256))


@pytest.mark.parametrize("name", list(PAPER))
@torch.no_grad()
def test_scaled_paper_checkpoints_import_with_fla_logits(name, tmp_path, fla_on_cpu):  # noqa: F811
    kind, settings = scaled_paper_settings(name, hidden=64, layers=3, vocab=300)
    seed = int(torch.randint(0, 2**31, ()).item())
    fla_model, count = write_fla_checkpoint(kind, settings, tmp_path, seed=seed, init="order-one",
                                            dtype=torch.float64)
    model = load_fla_checkpoint(tmp_path, dtype=torch.float64, backend="chunk")
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.config.attention.layers == ([2] if "attn" in settings else [])
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(seed))
    expected = fla_model.double()(ids, use_cache=False).logits
    assert relative_error(model(ids, use_cache=False).logits, expected) < 1e-5  # FLA's references: float32 inside
