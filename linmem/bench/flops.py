"""Model FLOPs of one training token of a ``LinMemForCausalLM``, for model FLOPs utilisation (MFU).

    FLOPs per token = 6 · N_matmul + 6 · L_linear · H · m · K · V + 6 · L_attention · H_q · d · T

- ``6 · N_matmul``: every weight that multiplies the token's activations costs 2 FLOPs per token in the forward
  pass and 4 in the backward pass. ``N_matmul`` is every parameter except the input embedding table (a lookup);
  the output head counts (tied or not).
- The memory of each linear layer: per head, ``m`` matrix-vector products or rank-1 updates with a K x V state,
  2·K·V FLOPs each, in the recurrent form of the main configuration (times 3 for forward and backward):
  sGLA / GLA m = 2 (write, read ``S q``), GDN m = 3 (also the prediction ``S k`` of the delta rule), RLA m = 5
  (``S k`` for the residual, S write, R write, ``S q``, ``R q``), RDN m = 6 (also ``R k`` for R's delta rule).
- Softmax attention: ``QKᵀ`` and ``AV`` over on average T / 2 keys of a causal window of T, 2·2·d·T/2 FLOPs per
  query channel group of width d per token, times 3.

These are model FLOPs: what the model needs, not what a kernel runs. The chunked kernels do more arithmetic than
the recurrent form, and gradient checkpointing runs every forward again in the backward pass; neither counts, as
in the usual MFU definition (PaLM, App. B). At these sizes the memory term is about 2% of the total.
"""

from __future__ import annotations

from linmem.models import LinMemConfig
from linmem.train.params import count_model_parameters

MEMORY_PRODUCTS = {"sgla": 2, "gla": 2, "gdn": 3, "rla": 5, "rdn": 6}
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H100 / H200 SXM dense bfloat16 tensor-core peak (no sparsity)


def matmul_parameters(config: LinMemConfig) -> int:
    """Parameters that multiply activations: all but the input embedding table (kept when tied to the head)."""
    count = count_model_parameters(config)
    return count.total - (count.embeddings if count.lm_head else 0)


def flops_per_token(config: LinMemConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) at context ``seq_len``: ``{"matmul", "memory", "attention",
    "total"}`` (see the module doc for the formula)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    attention_layers = len(config.attention.layers)
    linear_layers = config.num_hidden_layers - attention_layers
    value_width = round(config.head_dim * config.expand_v)
    memory = 6.0 * linear_layers * config.num_heads * MEMORY_PRODUCTS[config.mixer] * config.head_dim * value_width
    head_dim = config.attention.head_dim or config.hidden_size // config.attention.num_heads
    attention = 6.0 * attention_layers * config.attention.num_heads * head_dim * seq_len
    matmul = 6.0 * matmul_parameters(config)
    return dict(matmul=matmul, memory=memory, attention=attention, total=matmul + memory + attention)


def mfu(tokens_per_s: float, flops_per_token_total: float, peak_tflops: float = H200_BF16_DENSE_TFLOPS) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (``peak_tflops`` in TFLOP/s)."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be > 0; got {peak_tflops}")
    return tokens_per_s * flops_per_token_total / (peak_tflops * 1e12)
