"""A state-feature corrector (paper 2, App. F.1): does the chosen component's state still hold the answer when the
model's own read-out picks a wrong candidate?

For every query and each of its 4 candidates ``c`` the features are query-aligned reads of the component's
pre-query state ``S [V, K]``: the read-out ``r = S q`` (``q`` the head's query at the last prompt token) and the
head's value vector ``v_c`` for the candidate (the value the head writes when the fact's value slot holds ``c``:
the query prompt ``before key middle`` followed by ``c``, run from an empty state), as the elementwise product of
the unit vectors ``r̂ ⊙ v̂_c [V]`` (their sum is the cosine). The corrector is a linear scorer shared by the four
candidates, a softmax over them trained by cross-entropy with weight decay (a conditional logit model, convex and
CPU-fast), on development sources; it is frozen and evaluated on confirmation sources, so the two never share a
passage. ``model+corrector`` adds the model's own candidate logits (centred) as one more feature; trained on
shuffled labels it is the chance-level control.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from linmem.memory import plots
from linmem.memory.components import Component
from linmem.memory.evaluate import SplitAt, make_batch
from linmem.memory.experiments import CHANCE, Result, cached_state
from linmem.memory.intervene import shared_prefix
from linmem.memory.metrics import choice_logits
from linmem.memory.recording import backbone, capture, on_model, unembed
from linmem.memory.stats import bootstrap
from linmem.memory.tasks import Item


@dataclass
class Features:
    """Per query: ``state [N, 4, F]`` state features of its candidates, ``logits [N, 4]`` the model's candidate
    logits, ``answer [N]`` the right candidate, ``sources`` the queries' source ids."""

    state: torch.Tensor
    logits: torch.Tensor
    answer: torch.Tensor
    sources: list[str]

    def with_logits(self) -> torch.Tensor:
        """``[N, 4, F + 1]``: the state features and the model's centred candidate logit."""
        centred = self.logits - self.logits.mean(-1, keepdim=True)
        return torch.cat([self.state, centred[..., None]], dim=-1)



def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def state_features(model: nn.Module, items: Sequence[Item], component: Component) -> Features:
    """The corrector's inputs for every binding of every item (each query one example; float64 on the CPU): the
    prefix run once per item (its pre-query state), then one run of all queries from it (the query vector and the
    candidate logits at the last token) and one short run of the candidate facts (their value vectors)."""
    layer, head = component.layer, component.head
    batches = [make_batch(items, binding=j) for j in range(len(items[0].queries))]
    first = batches[0]
    prefix = shared_prefix(model, first.recipient, None, [[SplitAt(first.boundary)]])
    state = cached_state(prefix.cache, component).double().cpu()  # [B, V, K]
    state = state.repeat(len(batches), 1, 1)  # [J·B, V, K], binding-major like the stacked queries
    prompts = torch.cat([b.recipient for b in batches])  # [J·B, T]
    candidates = torch.cat([b.candidates for b in batches])  # [J·B, 4]
    stores: dict[int, dict[str, torch.Tensor]] = {}
    cache, _ = prefix.tiled(len(batches))  # every binding's queries continue each item's prefix
    with capture(model, [layer], stores):
        hidden = backbone(model)(input_ids=on_model(model, prompts[:, first.boundary:]), cache=cache,
                                 use_cache=True).last_hidden_state[:, -1]
    q = stores[layer]["q"][:, -1, head].double().cpu()  # [J·B, K]
    logits = choice_logits(unembed(model, hidden), on_model(model, candidates)).cpu()  # [J·B, 4]
    read = torch.einsum("bvk,bk->bv", state, q)  # [J·B, V]
    query = prompts[:, first.boundary:]  # before key middle
    facts = torch.cat([query.repeat_interleave(4, 0), candidates.reshape(-1, 1)], dim=1)  # [4·J·B, Q + 1]
    with capture(model, [layer], stores):
        backbone(model)(input_ids=on_model(model, facts), use_cache=False)
    values = stores[layer]["v"][:, -1, head].double().cpu().view(len(prompts), 4, -1)  # [J·B, 4, V]
    answer = torch.cat([b.answer for b in batches])
    return Features(_unit(read)[:, None, :] * _unit(values), logits, answer, [s for b in batches for s in b.sources])


class Corrector(nn.Module):
    """Scores ``[N, 4]`` of candidates from features ``[N, 4, F]``: standardized with the training set's
    statistics, then one linear map shared by the candidates."""

    def __init__(self, mean: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("scale", scale)
        self.linear = nn.Linear(len(mean), 1, bias=False, dtype=torch.float64)
        nn.init.zeros_(self.linear.weight)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear((features - self.mean) / self.scale)[..., 0]

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """The chosen candidate ``[N]``."""
        with torch.no_grad():
            return self(features).argmax(-1)


def fit_corrector(features: torch.Tensor, answer: torch.Tensor, weight_decay: float = 1e-2,
                  steps: int = 100) -> Corrector:
    """A ``Corrector`` fitted by L-BFGS to ``features [N, 4, F]`` and ``answer [N]`` (cross-entropy over the
    4 candidates plus ``weight_decay``·‖w‖²; the objective is convex, so the fit does not depend on a seed)."""
    if features.dim() != 3 or features.shape[:2] != (len(answer), 4):
        raise ValueError(f"features must be [N, 4, F] and answer [N]; got {list(features.shape)} and "
                         f"{list(answer.shape)}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0; got {weight_decay}")
    features = features.double()
    flat = features.reshape(-1, features.shape[-1])
    corrector = Corrector(flat.mean(0), flat.std(0).clamp_min(1e-8))
    optimizer = torch.optim.LBFGS(corrector.parameters(), max_iter=steps, tolerance_grad=1e-10,
                                  tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = nn.functional.cross_entropy(corrector(features), answer) + weight_decay * corrector.linear.weight.pow(
            2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    return corrector.eval()


def corrector(model: nn.Module, train_items: Sequence[Item], test_items: Sequence[Item], component: Component,
              weight_decay: float = 1e-2, seed: int = 0, shuffles: int = 20) -> Result:
    """Held-out 4-choice accuracy of the model alone, the state-feature corrector, the model with the corrector
    (its logits as one more feature) and the corrector trained on shuffled labels (the mean over ``shuffles``
    permutations drawn from ``seed``: a single fit on shuffled labels lands near 0 or near 1 by the sign a
    feature happens to get, their mean near chance), each with a source-bootstrap CI; the paired change of
    model+corrector over the model, and how many of the model's errors it rescued and of its right answers it
    broke (F.1). ``train_items`` and ``test_items`` must come from disjoint sources."""
    shared = {it.source_id for it in train_items} & {it.source_id for it in test_items}
    if shared:
        raise ValueError(f"rule 'disjoint sources': the corrector's training and test items share sources "
                         f"{sorted(shared)[:3]}; train on development and test on confirmation sources")
    train, test = state_features(model, train_items, component), state_features(model, test_items, component)
    rng = np.random.default_rng(seed)
    picks = {
        "model": test.logits.argmax(-1),
        "corrector": fit_corrector(train.state, train.answer, weight_decay).predict(test.state),
        "model+corrector": fit_corrector(train.with_logits(), train.answer, weight_decay).predict(test.with_logits()),
    }
    correct = {name: (pick == test.answer).double() for name, pick in picks.items()}
    correct["shuffled labels"] = torch.stack([  # a null distribution: each fit's sign is luck, their mean is not
        (fit_corrector(train.state, train.answer[torch.from_numpy(rng.permutation(len(train.answer)))],
                       weight_decay).predict(test.state) == test.answer).double() for _ in range(shuffles)]).mean(0)
    rows = [{"predictor": name, "metric": "accuracy", **bootstrap(c.numpy(), test.sources).as_dict()}
            for name, c in correct.items()]
    change = correct["model+corrector"] - correct["model"]
    rows.append({"predictor": "model+corrector − model", "metric": "accuracy_change",
                 **bootstrap(change.numpy(), test.sources).as_dict()})
    right = correct["model"].bool()
    summary = {"component": str(component), "train_queries": len(train.answer), "test_queries": len(test.answer),
               "train_sources": len(set(train.sources)), "test_sources": len(set(test.sources)),
               "features": train.state.shape[-1], "weight_decay": weight_decay, "chance": CHANCE,
               "rescued": int((~right & correct["model+corrector"].bool()).sum()), "model_wrong": int((~right).sum()),
               "broken": int((right & ~correct["model+corrector"].bool()).sum()), "model_right": int(right.sum())}
    return Result("corrector", rows, summary, plots.corrector(rows))
