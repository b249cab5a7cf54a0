"""The figures of the commands beside the sweep: ``nopelens intervene``
(:func:`intervention_figure`) and ``nopelens dynamics`` (:func:`dynamics_figure`), drawn with the
helpers and palette of :mod:`nopelens.analyses.figures`. Rendering: only the CLI imports it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt  # after figures' matplotlib.use("Agg") or before: pyplot switches
import numpy as np
import pandas as pd
import seaborn as sns

from .figures import CONDITION_COLORS, CONDITION_NAMES, TOL_BRIGHT, _bars, _heatmap, _integer_ticks
from .palette import method_color, method_label


def intervention_figure(tables: dict[str, pd.DataFrame], name: str):
    """Three panels: sink ablation (absolute-index R² at layer l + 1, clean and ablated in block l,
    with 95 % CIs), the shift a clean probe reads at later layers after the index direction at
    layer l was shifted, and the share of the index that moves with a patched state (95 % CIs)."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    summary = tables["summary"]
    probes = tables["sink_probes"]
    if "abs_r2" in summary:
        blocks = sorted(summary["ablated_block"].astype(int).unique())
        clean = probes[
            (probes["condition"] == "clean")
            & (probes["probe"] == "linear")
            & (probes["target"] == "absolute_index")
            & (probes["metric"] == "r2")
        ].set_index("layer")
        series = {
            "clean": (
                [clean.loc[b + 1, "value"] for b in blocks],
                [clean.loc[b + 1, "ci_low"] for b in blocks],
                [clean.loc[b + 1, "ci_high"] for b in blocks],
            )
        }
        for mode, rows in summary.groupby("condition", sort=False):
            rows = rows.set_index("ablated_block").reindex(blocks)
            series[mode] = (rows["abs_r2"].tolist(), rows["abs_r2_ci_low"].tolist(), rows["abs_r2_ci_high"].tolist())
        _bars(axes[0], blocks, series, CONDITION_COLORS, CONDITION_NAMES)
        lowest = min(float(np.nanmin(values)) for _, values, _ in series.values())
        axes[0].set_ylim(min(-0.1, lowest - 0.05), 1.1)
        axes[0].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(series), frameon=False)
    axes[0].set(
        title="sink ablated in block l:\nabs. index R² at layer l + 1",
        xlabel="block l",
        ylabel="abs. index R² (refitted probe)",
    )
    directions = tables["directions"]
    if "read_shift" in directions:
        shifted = directions[directions["intervention"] == "shift"]
        for i, (layer, line) in enumerate(shifted.groupby("layer")):
            ax_color = (TOL_BRIGHT * 3)[i]
            axes[1].plot(
                line["read_layer"],
                line["read_shift"] / line["k"],
                marker="o",
                color=ax_color,
                label=f"layer {int(layer)}",
            )
        carried = shifted["read_shift"] / shifted["k"]
        axes[1].set_ylim(min(-0.1, float(carried.min()) - 0.05), max(1.1, float(carried.max()) + 0.05))
        axes[1].legend(
            fontsize=9,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=4,
            frameon=False,
            title="index shifted at",
            title_fontsize=9,
        )
        _integer_ticks(axes[1])
    axes[1].set(
        title="index direction shifted by k at layer l:\nshift a clean probe reads / k",
        xlabel="read layer",
        ylabel="read shift / k (1 = all carried)",
    )
    patching = tables["patching"]
    if "moved" in patching:
        for i, (position, line) in enumerate(patching.groupby("position")):
            errors = np.vstack([line["moved"] - line["moved_ci_low"], line["moved_ci_high"] - line["moved"]])
            axes[2].errorbar(
                line["layer"],
                line["moved"],
                yerr=np.clip(np.nan_to_num(errors), 0, None),
                marker="o",
                capsize=2,
                color=(TOL_BRIGHT * 3)[i],
                label=f"position {int(position)}",
            )
        moved = pd.concat([patching["moved_ci_low"], patching["moved_ci_high"]]).dropna()
        if len(moved):
            axes[2].set_ylim(min(-0.1, float(moved.min()) - 0.05), max(1.1, float(moved.max()) + 0.05))
        axes[2].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
        _integer_ticks(axes[2])
    axes[2].set(
        title="state patched from a shifted copy:\nshare of the index that moves (last layer)",
        xlabel="patched layer (resid_pre)",
        ylabel="share moved (0 = recomputed)",
    )
    fig.suptitle(f"{name}: does the model make and use the position a probe reads? (error bars: 95 % CI)")
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.32, wspace=0.3)
    return fig


def dynamics_figure(table: pd.DataFrame, name: str, threshold: float, position: str | None = None):
    """Heatmaps (layer x step) of absolute-index R² and of the score read, the sink rate and
    validation loss against step (log scale, 95 % CI band), and on Bigram-Backcopy each head's
    attention on BOS (non-trigger queries) and on the previous token (trigger queries); cells above
    ``threshold`` (:data:`~nopelens.analyses.dynamics.THRESHOLD`) outlined. A heatmap cell is one
    checkpoint's probe score at one layer (0 = embeddings, l + 1 = output of block l) or block; the
    sink rate is drawn in the colour of the model's position method(s), ``position``
    (:func:`~nopelens.analyses.palette.method_color`)."""
    sns.set_theme(style="whitegrid", context="notebook")
    heads = table[table["measure"].isin(["first_mass", "previous_mass"])]
    n_panels = 4 if len(heads) else 3
    fig, axes = plt.subplots(1, n_panels, figsize=(4.6 * n_panels, 3.9))

    for ax, measure, title, label in (
        (axes[0], "absolute_r2", "absolute index R²", "layer (0 = embeddings)"),
        (axes[1], "score_read_r2", "head-score read of i − j, R²", "block"),
    ):
        rows = table[table["measure"] == measure]
        if rows.empty:
            ax.set_axis_off()
            continue
        grid = rows.assign(row=(rows["layer"] - (1 if measure == "score_read_r2" else 0)).astype(int)).pivot(
            index="row", columns="step", values="value"
        )
        image = _heatmap(ax, grid.clip(lower=0).iloc[::-1], sns.color_palette("rocket_r", as_cmap=True), 1.0, threshold)
        if ax is axes[1]:
            fig.colorbar(image, ax=ax, fraction=0.05)
        ax.set(title=title, xlabel="training step", ylabel=label)
        ax.tick_params(axis="x", labelrotation=90)
    ax = axes[2]
    sink = table[table["measure"] == "sink_rate"].sort_values("step")
    x = sink["step"].clip(lower=0.5)
    color = method_color(position)
    ax.plot(x, sink["value"], marker="o", color=color, label="sink rate (Gu, > 0.3)")
    ax.fill_between(x, sink["ci_low"], sink["ci_high"], color=color, alpha=0.25)
    loss = table[table["measure"] == "validation_loss"].sort_values("step")
    twin = ax.twinx()
    twin.plot(loss["step"].clip(lower=0.5), loss["value"], color="C3", marker=".", label="validation loss")
    twin.set_ylabel("validation loss (nats/token)", color="C3")
    twin.grid(False)
    ax.set(
        xscale="log",
        ylim=(-0.02, 1.02),
        xlabel="training step (0 drawn at 0.5)",
        ylabel="sink rate",
        title="sink rate (95 % CI) and loss",
    )
    if n_panels == 4:
        ax = axes[3]
        for (block, head, cls, measure), rows in heads.groupby(["block", "head", "query_class", "measure"]):
            if (measure, cls) not in (("first_mass", "non_trigger"), ("previous_mass", "trigger")):
                continue
            rows = rows.sort_values("step")
            style = "-" if measure == "first_mass" else "--"
            ax.plot(
                rows["step"].clip(lower=0.5),
                rows["value"],
                style,
                marker=".",
                label=f"block {int(block)} head {int(head)}: "
                f"{'BOS, non-trigger' if style == '-' else 'previous, trigger'}",
            )
        ax.set(
            xscale="log",
            ylim=(-0.02, 1.02),
            xlabel="training step",
            ylabel="attention",
            title="dormant (on BOS) and active (on previous)",
        )
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1)
    method = f" ({method_label(position)})" if position else ""
    fig.suptitle(
        f"{name}{method} through training: a cell is one checkpoint's R² at one layer or block (R² below 0 drawn as 0)",
        y=1.03,
    )
    fig.subplots_adjust(wspace=0.5)
    return fig
