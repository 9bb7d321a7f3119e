"""The names of the memory lab's experiments, in the order the protocol (``linmem.memory.probe``) runs them:
standard library only, so that ``linmem probe --help`` and its ``--only`` choices need no torch."""

from __future__ import annotations

EXPERIMENTS = ("head_scan", "lifecycle", "head_interaction", "four_facts", "hybrid_attribution", "s_vs_r",
               "sweep_num_bindings", "sweep_gap", "overlap", "overlap_sweep", "logit_lens", "neutral_suppression",
               "joint_topk", "write_read_spearman", "corrector", "subspace_transfer")
