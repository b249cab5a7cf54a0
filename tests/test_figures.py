"""Figures are reproducible: the same figure saved twice gives byte-identical PNG and SVG (issue 15)."""

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from nopelens.analyses.figures import save_figure


def figure(shift=0.0):
    data = pd.DataFrame({"layer": [0, 1, 2] * 2, "value": [0.1, 0.5 + shift, 0.9, 0.2, 0.3, 0.4], "model": ["a"] * 3 + ["b"] * 3})
    fig, ax = plt.subplots(figsize=(3, 2))
    sns.lineplot(data=data, x="layer", y="value", hue="model", marker="o", ax=ax)  # clip paths, legend, text
    ax.fill_between([0, 1, 2], [0, 0.1, 0.2], [0.3, 0.4, 0.5], alpha=0.2)
    ax.set_title("R² per layer")
    return fig


def test_saving_the_same_figure_twice_gives_identical_files(tmp_path):
    first = save_figure(figure(), tmp_path / "one")
    second = save_figure(figure(), tmp_path / "two")
    other = save_figure(figure(shift=0.2), tmp_path / "three")
    for a, b, c in zip(first, second, other):
        assert a.read_bytes() == b.read_bytes(), a.name
        assert a.read_bytes() != c.read_bytes(), a.name  # the comparison can fail
    svg = first[1].read_text()
    assert "<dc:date>" not in svg and "clip-path" in svg
