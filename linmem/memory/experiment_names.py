"""The names of the memory lab's experiments, in the order the protocol (``linmem.memory.probe``) runs them, and
the clean-recall gate they share: standard library only, so that ``linmem probe --help``, its ``--only`` choices
and the study tables need no torch."""

from __future__ import annotations

EXPERIMENTS = ("head_scan", "lifecycle", "write_reach", "head_interaction", "four_facts", "hybrid_attribution",
               "s_vs_r", "sweep_num_bindings", "sweep_gap", "load_vs_gap", "overlap", "overlap_sweep", "logit_lens",
               "neutral_suppression", "joint_topk", "write_read_spearman", "corrector", "subspace_transfer")

# clean recall (4 candidates, chance 0.25) a model must reach before the probe attributes anything to a component:
# the paper drops conditions near chance
CLEAN_RECALL_GATE = 0.5
