"""How much of a GPU kernel's dv error the clip target explains on its own.

    python -m linmem.bench.clip_sensitivity [--trials 3]

The clipped residual target ``r = clip(err, ±c)`` has the derivative ``ρ' ∈ {0, 1}``: an element of the base
memory's prediction error that lies within rounding distance of ±c flips between the two when the inputs are
rounded, and its whole gradient to v moves with it. This script runs the exact float64 ``chunk`` op twice, once on
the inputs and once on q, k, v rounded to tf32 (10 mantissa bits, what the GPU's float32 dots see), and prints the
relative Frobenius change of every input gradient (the initial states' too) for the clip and the tanh target. The
gap between the two is the part of a kernel's gradient error that no kernel can remove: dv moves most (it takes
``ρ'`` directly), and dk, dg, dβ and the base memory's initial state dS0 move with it through the base memory's
backward; ``linmem.bench.kernel_checks`` sets its clip-case tolerances from it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from linmem.ops.linear_memory import linear_memory

B, T, H, D = 2, 300, 3, 128  # the kernel benchmark's main check shape


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its mantissa rounded to 10 explicit bits (tf32), kept in x's dtype."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**11) / 2**11, exponent)


GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dgamma", "dS0", "dR0")


def input_gradients(inputs: list[torch.Tensor], grad_o: torch.Tensor, rule: str, target: str) -> dict:
    """The residual memory's gradients for ``inputs = [q, k, v, g, beta, gamma, S0, R0]`` (the initial states
    ``[B, H, V, K]``), named as in ``GRADIENTS``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, _ = linear_memory(*leaves[:6], rule=rule, residual=True, residual_target=target, initial_state=tuple(leaves[6:]),
                         backend="chunk")
    o.backward(grad_o)
    return {name: leaf.grad for name, leaf in zip(GRADIENTS, leaves)}


def random_inputs(generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    def normal(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator)

    q, k = (F.normalize(normal(B, T, H, D), dim=-1) for _ in range(2))
    g = F.logsigmoid(normal(B, T, H) + 3)
    beta, gamma = (torch.rand(B, T, H, dtype=torch.float64, generator=generator) for _ in range(2))
    states = [0.3 * normal(B, H, D, D) for _ in range(2)]  # the kernel checks' initial states' scale
    return [q, k, normal(B, T, H, D), g, beta, gamma, *states], normal(B, T, H, D)


def main(argv: list[str] | None = None) -> dict[tuple[str, str, str], float]:
    """The worst relative change of each gradient, keyed by (rule, target, gradient name)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="default: fresh random inputs")
    args = parser.parse_args(argv)
    generator = torch.Generator()
    generator.manual_seed(args.seed) if args.seed is not None else generator.seed()
    worst: dict[tuple[str, str, str], float] = {}
    print(f"worst relative change of each gradient from tf32-rounded q, k, v over {args.trials} trials")
    print(f"{'rule':8} {'target':6} " + " ".join(f"{name:>7}" for name in GRADIENTS))
    for rule in ("delta", "additive"):
        for target in ("clip", "tanh"):
            for _ in range(args.trials):
                inputs, grad_o = random_inputs(generator)
                exact = input_gradients(inputs, grad_o, rule, target)
                rounded = input_gradients([round_to_tf32(t) for t in inputs[:3]] + inputs[3:], grad_o, rule, target)
                for name in GRADIENTS:
                    change = ((rounded[name] - exact[name]).norm() / exact[name].norm()).item()
                    worst[rule, target, name] = max(worst.get((rule, target, name), 0.0), change)
            print(f"{rule:8} {target:6} " + " ".join(f"{worst[rule, target, n]:7.1e}" for n in GRADIENTS))
    return worst


if __name__ == "__main__":
    main()
