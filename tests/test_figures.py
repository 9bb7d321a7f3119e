"""Figures make their point at a glance: one colour scale where memories are compared, readable axes."""

import numpy as np

from linmem.memory import plots


def _scan_rows(rng):
    rows = []
    for memory, size in (("R", 0.02), ("S", 20.0)):
        for layer in range(3):
            for head in range(2):
                rows.append(dict(memory=memory, layer=layer, head=head, mean=float(rng.normal()) * size))
    return rows


def test_head_scan_panels_share_one_colour_scale():
    rows = _scan_rows(np.random.default_rng())
    fig = plots.head_scan(rows)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 2
    limits = {image.get_clim() for image in images}
    assert len(limits) == 1, limits
    largest = max(abs(r["mean"]) for r in rows)
    assert np.isclose(limits.pop()[1], largest)
    assert [ax.get_title() for ax in fig.axes if ax.images][0].endswith("(S)")  # the base memory first


def test_topk_ticks_are_the_k_values():
    rows = [dict(k=k, mean=0.2 * i, low=0.2 * i - 0.1, high=0.2 * i + 0.1) for i, k in enumerate((1, 2, 4, 8))]
    fig = plots.topk(rows)
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["1", "2", "4", "8"]


def _zoo_like_tasks(rng, ppl):
    lengths, depths = [256, 512], [0.0, 0.5, 1.0]
    return {"ppl": {"metrics": {"ppl": ppl, "loss": float(np.log(ppl)), "tokens": 100, "seq_len": 64}},
            "mqar": {"table": [{"pairs": p, "accuracy": float(rng.uniform())} for p in (8, 32)],
                     "metrics": {"mean_accuracy": 0.5, "seq_len": 64}},
            "niah": {"grid": {"lengths": lengths, "depths": depths,
                              "accuracy": rng.uniform(size=(len(lengths), len(depths))).tolist()},
                     "metrics": {"mean_accuracy": 0.5}}}


def test_demo_figures_compare_sizes_from_zero_and_draw_the_niah_grid():
    from linmem.demo import summary_figures

    rng = np.random.default_rng()
    models = {name: {"tasks": _zoo_like_tasks(rng, ppl)} for name, ppl in (("a", 38.0), ("b", 3.0))}
    figures = dict(summary_figures(models))
    ppl = next(fig for caption, fig in figures.items() if caption.startswith("Perplexity"))
    ax = ppl.axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    niah = next(fig for caption, fig in figures.items() if caption.startswith("Needle"))
    grids = [a for a in niah.axes if a.images]
    assert len(grids) == 2 and all(a.images[0].get_array().shape == (2, 3) for a in grids)
    assert {a.images[0].get_clim() for a in grids} == {(0, 1)}


def test_s_vs_r_share_is_withheld_where_the_layer_swap_does_nothing():
    from linmem.demo import s_vs_r_rows

    rows = []
    for layer, (low, high) in ((0, (-0.01, 0.01)), (1, (2.0, 4.0))):
        rows.append(dict(layer=layer, memory="S+R", metric="donor_margin_shift", mean=(low + high) / 2, low=low,
                         high=high))
        rows.append(dict(layer=layer, memory="S", metric="share_of_layer", mean=0.9, low=-3.0, high=5.6))
    table = {(r["layer"], r["memory swapped"]): r for r in s_vs_r_rows(rows)}
    assert table[(0, "S")]["share of the layer's S+R swap"].startswith("–")
    assert table[(1, "S")]["share of the layer's S+R swap"].startswith("0.9")


def test_lab_recall_curves_put_formats_in_rows_loads_in_columns_on_one_scale():
    from linmem.study.figures import lab_recall_figure

    rng = np.random.default_rng()
    names = [f"val_lab_recall:{fmt}@{k}" for fmt in ("keeps/roles/materials", "code/names/colors") for k in (1, 4)]

    def log(offset: int) -> list[dict]:  # rows with and without an evaluation, and tokens that differ by a row
        rows = []
        for step in range(1, 7):
            row = {"step": step, "tokens": 1000 * step, "loss": 1.0}
            if step % 2 == 0:
                row.update({name: float(rng.uniform()) for name in names}, val_recall_acc=float(rng.uniform()))
            rows.append(row)
        return rows[offset:]

    logs = {"gdn": [log(0), log(0)], "rdn": [log(0)]}
    fig = lab_recall_figure(logs)
    assert len(fig.axes) == 4
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["code/names/colors, 1 fact", "code/names/colors, 4 facts",
                      "keeps/roles/materials, 1 fact", "keeps/roles/materials, 4 facts"]
    assert {ax.get_ylim() for ax in fig.axes} == {(0.0, 1.0)}
    gdn_line = next(line for line in fig.axes[3].lines if line.get_label() == "gdn (2 seeds)")
    name = "val_lab_recall:keeps/roles/materials@4"
    expected = np.mean([[r[name] for r in run if name in r] for run in logs["gdn"]], axis=0)
    assert np.allclose(gdn_line.get_ydata(), expected) and np.allclose(gdn_line.get_xdata(), [0.002, 0.004, 0.006])
    assert lab_recall_figure({"gdn": [[{"step": 1, "tokens": 10, "loss": 1.0}]]}) is None
