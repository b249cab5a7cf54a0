"""The figures of ``nopelens lengthgen`` (:mod:`~nopelens.analyses.lengthgen`): exact match
against size, the out-of-distribution score through training, and the attention distances, each
row in its position method's fixed colour (:mod:`~nopelens.analyses.palette`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker
import pandas as pd
import seaborn as sns

from . import kazemnejad
from .figures import save_figure
from .kazemnejad import SECOND_SEED
from .palette import method_color


def _styles(methods) -> dict:
    """Each row's fixed colour (its position method's, :mod:`~nopelens.analyses.palette`) and its
    dashes: solid for the paper's choices, dashed for nopelens' own defaults of the same method."""
    return dict(
        palette={m: method_color(kazemnejad.VARIANTS[m].position) for m in methods},
        style="method",
        dashes={m: (4, 2) if m in kazemnejad.DEFAULT_ROWS else "" for m in methods},
    )


def plot(results: pd.DataFrame, out_stem: Path) -> list[Path]:
    """Draw :func:`lengthgen_figure` into ``<out_stem>.png`` and ``<out_stem>.svg``, atomically;
    returns their paths."""
    return save_figure(lengthgen_figure(results), out_stem)


def lengthgen_figure(results: pd.DataFrame):
    """Exact match against size, one line per row (in its method's fixed colour; nopelens' defaults
    dashed), one panel per task: a point is a row's mean exact match over seeds at one problem size
    (band: range over seeds)."""
    L = int(results["train_max_len"].iloc[0])
    methods = [m for m in tuple(kazemnejad.VARIANTS) if m in set(results["method"])]
    sns.set_theme(style="whitegrid", context="notebook")
    grid = sns.relplot(
        data=results,
        x="length",
        y="exact_match",
        hue="method",
        hue_order=methods,
        **_styles(methods),
        col="task",
        col_wrap=min(3, results["task"].nunique()),
        kind="line",
        errorbar=("pi", 100),
        height=3.0,
        aspect=1.3,
    )
    for ax in grid.axes.flat:
        ax.axvline(L + 0.5, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    grid.set_titles("{col_name}")
    grid.set_axis_labels("problem size (symbols)", "exact match (fraction of sequences)")
    grid.figure.suptitle(
        f"Length generalization: trained on sizes 1-{L} (left of the grey line), tested up to "
        f"{2 * L}\n(a point: mean exact match over seeds; band: their range)",
        y=1.06,
    )
    return grid.figure


def plot_curve(curve: pd.DataFrame, out_stem: Path) -> list[Path]:
    """Exact match on the unseen sizes against training step (log axis), one line per method."""
    methods = [m for m in tuple(kazemnejad.VARIANTS) if m in set(curve["method"])]
    sns.set_theme(style="whitegrid", context="notebook")
    grid = sns.relplot(
        data=curve,
        x="step",
        y="exact_match_longer",
        hue="method",
        hue_order=methods,
        **_styles(methods),
        col="task",
        col_wrap=min(3, curve["task"].nunique()),
        kind="line",
        marker="o",
        errorbar=("ci", 95),
        height=3.0,
        aspect=1.3,
    )
    for ax in grid.axes.flat:
        ax.set_xscale("log")
        ax.set_xticks(sorted(set(curve["step"])))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_ylim(-0.03, 1.03)
    grid.set_titles("{col_name}")
    grid.set_axis_labels("training step", "exact match, unseen sizes")
    grid.figure.suptitle("Out-of-distribution exact match through training (band: 95 % CI over seeds)", y=1.04)
    return save_figure(grid.figure, out_stem)


def plot_distances(distances: pd.DataFrame, out_stem: Path) -> list[Path]:
    """Heatmaps of the layer-mean Jensen-Shannon distance (bits) between the paper's methods (and
    NoPE's second seed), one per task; attention_distance.csv has every row."""
    tasks = list(dict.fromkeys(distances["task"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        grid = distances[distances["task"] == task].pivot_table(index="model_a", columns="model_b", values="jsd_bits")
        names = [m for m in [*kazemnejad.PAPER_VARIANTS, SECOND_SEED] if m in grid.index] or list(grid.index)
        sns.heatmap(
            grid.loc[names, names],
            ax=ax,
            annot=True,
            fmt=".3f",
            cmap="viridis",
            vmin=0,
            cbar=False,
            annot_kws={"size": 8},
        )
        ax.set_title(task)
        ax.set_xlabel("")
        ax.set_ylabel("")
    fig.suptitle(
        "Attention distance (Kazemnejad et al. 2023, Sec. 5.2): mean JSD of attention rows (bits),\n"
        "min over head pairs, mean over layers",
        y=1.02,
    )
    fig.tight_layout()
    return save_figure(fig, out_stem)
