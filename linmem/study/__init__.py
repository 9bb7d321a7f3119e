"""``linmem study``: several models trained under one recipe, several seeds each, evaluated alike, and tables with
confidence intervals regenerated from the run folder.

- ``definition``: the study YAML (recipe, models, seeds, evaluation, comparisons, claims) and the one-recipe check;
- ``items``: per-item evaluation records (one value per test window, cloze passage, MQAR or NIAH trial);
- ``estimates``: seed bootstrap, item bootstrap within seeds, paired two-level bootstrap of a difference, the
  paired t-test over seeds, the exact sign-flip test and Holm's correction;
- ``runs``: the run folder, training and evaluating every (model, seed), resumable;
- ``tables``: the tables (JSON and markdown) from the run folder's files, and the decision rule (only the
  study's claims are decided); ``figures``: their plots.
"""
