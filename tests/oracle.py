"""An independent float64 oracle for the four memories, written apart from ``linmem.ops``.

It works on one (batch, head) pair at a time with explicit ``[V, K]`` matrices and explicit transition matrices
(``diag(α)``, ``I − β k kᵀ``), in row-by-row Python, so that it shares no code path with the reference or chunk
backends. Differentiable through autograd; slow; for tiny shapes only.
"""

from __future__ import annotations

import torch


def _rho(x, target, clip):
    if target == "clip":
        return torch.minimum(torch.maximum(x, torch.full_like(x, -clip)), torch.full_like(x, clip))
    if target == "tanh":
        return clip * torch.tanh(x / clip)
    return x


def oracle(q, k, v, g, beta, gamma, S0, R0, *, rule, residual, target="clip", clip=1.0, fit_history=True,
           output_gates=True, scale=None):
    """Shapes as ``linear_memory``: ``q, k [B,T,H,K]``, ``v [B,T,H,V]``, ``g [B,T,H]`` or ``[B,T,H,K]``, gates
    ``[B,T,H]``, states ``[B,H,V,K]``. Returns ``o, S_T, R_T`` (R_T None without residual)."""
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    eye = torch.eye(K, dtype=q.dtype)
    outs, finals_s, finals_r = [], [], []
    for b in range(B):
        head_outs, head_s, head_r = [], [], []
        for h in range(H):
            S = S0[b, h]
            R = R0[b, h] if residual else None
            rows = []
            for t in range(T):
                qt, kt, vt = q[b, t, h].unsqueeze(1), k[b, t, h].unsqueeze(1), v[b, t, h].unsqueeze(1)  # columns
                alpha = torch.diag(g[b, t, h].exp()) if g.dim() == 4 else g[b, t, h].exp() * eye
                bt = beta[b, t, h]
                transition = alpha if rule == "additive" else (eye - bt * kt @ kt.T) @ alpha
                S_new = S @ transition + bt * vt @ kt.T
                if residual:
                    ct = gamma[b, t, h]
                    r = _rho(vt - S @ kt, target, clip)
                    if fit_history:
                        r_transition = alpha if rule == "additive" else (eye - ct * kt @ kt.T) @ alpha
                        R = R @ r_transition + ct * r @ kt.T
                    else:
                        R = r @ kt.T
                    if output_gates:
                        o = scale * (S @ alpha @ qt + ct * R @ qt)
                    else:
                        o = scale * (S @ qt + R @ qt)
                else:
                    o = scale * S_new @ qt
                S = S_new
                rows.append(o.squeeze(1))
            head_outs.append(torch.stack(rows) if rows else v.new_zeros(0, v.shape[-1]))
            head_s.append(S)
            head_r.append(R)
        outs.append(torch.stack(head_outs, dim=1))
        finals_s.append(torch.stack(head_s))
        finals_r.append(torch.stack(head_r) if residual else None)
    return torch.stack(outs), torch.stack(finals_s), (torch.stack(finals_r) if residual else None)
