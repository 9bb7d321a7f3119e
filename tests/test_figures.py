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
