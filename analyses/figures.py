"""Figures: seaborn and matplotlib drawings of what the analyses measured, for the sweep (those of
``nopelens intervene`` and ``nopelens dynamics`` are in :mod:`nopelens.analyses.command_figures`),
saved atomically and reproducibly (:func:`save_figure`). Every analysis returns tables; the CLI (or
:func:`~nopelens.analyses.report.write_run` for a sweep's run folder) draws them here.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib
import matplotlib.lines
import matplotlib.patches
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from nopelens.models.compat import moved_names  # noqa: E402
from nopelens.models.io import write_atomic  # noqa: E402
from nopelens.probes.sinks import GU_EPSILON  # noqa: E402

# MARKERS and Style lived here before palette.py; they still import from here
from .palette import LINESTYLE_KEY, MARKERS, Style, method_color, method_label, model_styles  # noqa: E402, F401
from .sweep import layers  # noqa: E402
from .sweep.reads import SweepRead  # noqa: E402

REPRODUCIBLE = {"svg.hashsalt": "nopelens"}
"""rcParams that make SVG ids (clip paths, glyphs) a hash of the content instead of a random uuid."""


NO_STAMPS = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}
"""Metadata left out, so a file depends on the figure only (not on the date or matplotlib's version)."""


def save_figure(fig: plt.Figure, stem: str | Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save ``fig`` as ``stem.<format>`` for each of ``formats``, each atomically, then close it.

    The files are reproducible: the same figure gives byte-identical files on every run.
    """
    with matplotlib.rc_context(REPRODUCIBLE):
        paths = [
            write_atomic(
                f"{stem}.{ext}",
                lambda temp, ext=ext: fig.savefig(
                    temp, format=ext, dpi=120, bbox_inches="tight", metadata=NO_STAMPS[ext]
                ),
            )
            for ext in formats
        ]
    plt.close(fig)
    return paths


LAYER_AXIS = "layer (0 = embeddings, l + 1 = output of block l)"
"""The x label of every per-layer figure: the design's layer convention (docs/schema.md)."""


TOL_BRIGHT = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB")
"""Paul Tol's "bright" qualitative scheme: distinct for the common colour-vision deficiencies
and in greyscale (https://personal.sron.nl/~pault/)."""


def _grid(n_panels: int, width: float, height: float, max_cols: int = 3, **kw):
    """A figure of ``n_panels`` axes in rows of at most ``max_cols`` (four make a 2 x 2 grid);
    unused axes hidden."""
    n_cols = 2 if n_panels == 4 and max_cols >= 2 else max(1, min(max_cols, n_panels))
    n_rows = -(-n_panels // n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False, **kw)
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n_panels])


def _integer_ticks(ax: plt.Axes) -> None:
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def _model_legend(fig: plt.Figure, styles: dict[str, Style], title: str = "model (position method; role)") -> None:
    """One legend for the figure, under the panels: each model's colour (its position method),
    line style (its role) and marker."""
    handles = [
        matplotlib.lines.Line2D([], [], color=s.color, marker=s.marker, linestyle=s.linestyle, label=s.label(m))
        for m, s in styles.items()
    ]
    fig.legend(
        handles=handles,
        title=title,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(len(handles), 3),
        frameon=False,
        handlelength=4,
    )


def _method_title(ax: plt.Axes, model: str, style: Style, suffix: str = "") -> None:
    """A per-model panel's title, in the colour of the model's method, naming its method and role;
    the details wrapped to the panel's width, so that neighbouring titles do not run into each other."""
    details = ", ".join(part for part in (style.description, suffix) if part)
    inches = ax.get_position().width * ax.figure.get_figwidth()
    wrapped = textwrap.fill(f"({details})", max(16, int(inches * 14)))  # about 14 characters an inch at 10 pt
    ax.set_title(f"{model}\n{wrapped}" if details else model, color=style.color, fontsize=10)


def probe_figure(
    curves: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None, subjects: dict[str, dict] | None = None
) -> plt.Figure:
    """Per-layer curves (:func:`~nopelens.analyses.sweep.layers.layer_curves`), one line per model, one
    panel per read of ``sweep_reads`` plus MAD / chance, in a grid; grey line: the read's threshold.
    A point is one model's probe score at one layer (layer 0 = embeddings, l + 1 = output of block
    l); the band is the 95 % bootstrap CI over sequences with one training seed, and the range
    over seeds (line: their mean) with several. Colour: the model's position method, line style:
    its role (:func:`~nopelens.analyses.palette.model_styles`, from ``subjects``, the run's
    :attr:`SweepResult.subjects <nopelens.analyses.sweep.driver.SweepResult>`)."""
    panels = [curve for curve in layers.curves_of(sweep_reads) if curve.title is not None]
    several_seeds = curves.groupby("model")["train_seed"].nunique().max() > 1
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = _grid(len(panels), 4.4, 3.3)
    styles = model_styles(curves["model"].unique(), subjects)
    for ax, curve in zip(axes, panels):
        rows = curves[curves["curve"] == curve.key]
        for model, group in rows.groupby("model", sort=False):
            if several_seeds:  # line: mean over seeds; band: their range
                stats = group.groupby("layer")["value"].agg(["mean", "min", "max"]).reset_index()
                layer, value, low, high = (stats[c] for c in ("layer", "mean", "min", "max"))
            else:  # line: the value; band: its 95 % CI
                layer, value, low, high = (group[c] for c in ("layer", "value", "ci_low", "ci_high"))
            style = styles[model]
            ax.plot(
                layer,
                value,
                color=style.color,
                marker=style.marker,
                markersize=5,
                linestyle=style.linestyle,
                label=model,
            )
            ax.fill_between(layer, low, high, color=style.color, alpha=0.2, linewidth=0)
        if curve.threshold is not None:
            ax.axhline(curve.threshold, color="0.45", linewidth=2.5, alpha=0.5)
        values = pd.concat([rows["value"], rows["ci_low"]]).dropna()
        lowest = float(values.min()) if len(values) else 0.0
        top = max(1.05, float(rows["ci_high"].max()) + 0.05) if rows["ci_high"].notna().any() else 1.05
        ax.set(
            title=curve.title,
            xlabel=LAYER_AXIS,
            ylabel=curve.axis,
            ylim=(min(-0.1, lowest - 0.05) if lowest < 0 else -0.03, top),
        )
        ax.title.set_fontsize(11)
        _integer_ticks(ax)
    band = "range over training seeds" if several_seeds else "95 % CI over sequences"
    bars = sorted({curve.threshold for curve in panels if curve.threshold is not None})
    bar = f"threshold {bars[0]:g}" if len(bars) == 1 else "each panel's threshold"
    fig.suptitle(
        "Where position becomes linearly recoverable: a point is one model's probe score at one layer\n"
        f"(grey line: {bar}; band: {band})\ncolour: position method; {LINESTYLE_KEY}"
    )
    fig.tight_layout()
    _model_legend(fig, styles)
    return fig


def site_rows(probes: pd.DataFrame) -> pd.DataFrame:
    """Absolute-index R² (regression, grouped linear probe) along the residual stream and at the
    finer sites the sweep measured, placed on the layer axis (layer 0 = embeddings, l + 1 = output
    of block l): ``kind`` is ``residual`` (at ``x`` = its layer) or the finer site of block l
    (``attn_out``, ``resid_mid``, ``mlp_out``, at ``x`` = l + :data:`SITE_OFFSETS`)."""
    rows = probes[
        (probes["probe"] == "linear")
        & (probes["split"] == "grouped")
        & (probes["target"] == "absolute_index")
        & (probes["task"] == "regression")
        & (probes["metric"] == "r2")
    ]
    residual = rows[rows["layer"].notna()]
    residual = residual.assign(kind="residual", x=residual["layer"].astype(float))
    finer = rows[rows["layer"].isna()]
    kinds = finer["site"].str.rsplit(".", n=1).str[-1].str.removeprefix("hook_")
    finer = finer.assign(kind=kinds, x=finer["block"].astype(float) + kinds.map(SITE_OFFSETS))
    return pd.concat([residual, finer], ignore_index=True)


SITE_OFFSETS = {"attn_out": 0.25, "resid_mid": 0.5, "mlp_out": 0.75}
"""Where block l's finer sites sit between layer l (its input) and layer l + 1 (its output)."""


SITE_KIND_NAMES = {
    "residual": "residual stream (layer l)",
    "attn_out": "block l's attention output (attn_out)",
    "resid_mid": "after block l's attention (resid_mid)",
    "mlp_out": "block l's MLP output (mlp_out)",
}


SITE_COLORS = {"residual": "0.15", "attn_out": TOL_BRIGHT[0], "resid_mid": TOL_BRIGHT[4], "mlp_out": TOL_BRIGHT[1]}


def site_figure(probes: pd.DataFrame, subjects: dict[str, dict] | None = None) -> plt.Figure:
    """Absolute-index R² along the residual stream and inside each block, one panel per model
    (titled in its method's colour): a point is one site's R² of the grouped linear probe, at its
    layer (0 = embeddings, l + 1 = output of block l), with block l's finer sites between layer l
    and l + 1 (band: 95 % CI over sequences; several seeds: their range)."""
    rows = site_rows(probes)
    sns.set_theme(style="whitegrid", context="notebook")
    models = list(rows["model"].unique())
    styles = model_styles(models, subjects)
    fig, axes = _grid(len(models), 4.0, 3.4)
    kinds = [kind for kind in SITE_KIND_NAMES if kind in set(rows["kind"])]
    for ax, model in zip(axes, models):
        for kind in kinds:
            line = rows[(rows["model"] == model) & (rows["kind"] == kind)]
            if line.empty:
                continue
            stats = line.groupby("x").agg(
                value=("value", "mean"),
                low=("ci_low", "min"),
                high=("ci_high", "max"),
                lo_seed=("value", "min"),
                hi_seed=("value", "max"),
                n=("value", "size"),
            )
            several = (stats["n"] > 1).any()
            low, high = (stats["lo_seed"], stats["hi_seed"]) if several else (stats["low"], stats["high"])
            if kind == "residual":  # one curve over the layers, its CI a band
                ax.plot(
                    stats.index,
                    stats["value"],
                    color=SITE_COLORS[kind],
                    marker="o",
                    markersize=4,
                    label=SITE_KIND_NAMES[kind],
                )
                ax.fill_between(stats.index, low, high, color=SITE_COLORS[kind], alpha=0.15, linewidth=0)
            else:  # points between the layers, their CIs error bars
                errors = np.vstack([np.clip(stats["value"] - low, 0, None), np.clip(high - stats["value"], 0, None)])
                ax.errorbar(
                    stats.index,
                    stats["value"],
                    yerr=np.nan_to_num(errors),
                    color=SITE_COLORS[kind],
                    marker="o",
                    markersize=4,
                    linestyle="none",
                    capsize=2,
                    label=SITE_KIND_NAMES[kind],
                )
        lowest = float(rows.loc[rows["model"] == model, "value"].min())
        ax.set(xlabel=LAYER_AXIS, ylabel="abs. index R²", ylim=(min(-0.1, lowest - 0.05), 1.05))
        ax.xaxis.label.set_fontsize(9)
        _method_title(ax, model, styles[model])
        _integer_ticks(ax)
    fig.suptitle(
        "Absolute index along the residual stream and inside each block: a point is the R² of the "
        "grouped linear probe\nat one site (block l's attention and MLP outputs between layer l and "
        "l + 1; band: 95 % CI over sequences)"
    )
    fig.tight_layout()
    handles = [
        matplotlib.lines.Line2D(
            [],
            [],
            color=SITE_COLORS[k],
            marker="o",
            linestyle="-" if k == "residual" else "none",
            label=SITE_KIND_NAMES[k],
        )
        for k in kinds
    ]
    fig.legend(handles=handles, title="site", loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    return fig


def sink_figure(
    sinks: pd.DataFrame, every_condition: bool = False, subjects: dict[str, dict] | None = None
) -> plt.Figure:
    """Gu et al.'s sink score (block x head: a cell is one head) per model, panels titled in the
    colour of the model's position method, as each model was read (``every_condition``:
    one panel per model and condition, with and without BOS), on one colour scale fitted to the
    data and reaching past the sink threshold, which the colour bar marks; heads above it are
    outlined. (Tables without a score, from sequences too short for Gu's window, show the sink
    mass instead.)"""
    sns.set_theme(style="white", context="notebook")
    value = "sink_score" if "sink_score" in sinks else "sink_mass"
    styles = model_styles(sinks["model"].unique(), subjects)
    models, grids, conditions = [], [], []
    for model in sinks["model"].unique():
        rows = sinks[sinks["model"] == model]
        for condition in rows["condition"].unique()[: None if every_condition else 1]:
            picked = rows[rows["condition"] == condition]
            models.append(model)
            grids.append(picked.pivot_table(index="block", columns="head", values=value))
            conditions.append(condition.replace("_", " ").replace("bos", "BOS"))
    top = max(float(max(grid.to_numpy().max() for grid in grids)), GU_EPSILON * 1.1)
    n_cols = max(1, min(3, len(models)))
    n_rows = -(-len(models) // n_cols)
    width = 3.3 * n_cols + 1.2
    if value == "sink_score":
        title = (
            "Attention sinks: a cell is one head's Gu et al. sink score (mean attention on the first token "
            f"over the first T ≤ 64 queries; a head above {GU_EPSILON:g} is a sink, outlined)"
        )
    else:
        title = "Attention sinks: a cell is one head's sink mass (mean attention on the first token)"
    title = textwrap.fill(title, int(width * 9))
    height = 2.9 * n_rows + 0.5 + 0.3 * (title.count("\n") + 1)
    fig = plt.figure(figsize=(width, height))
    grid_spec = fig.add_gridspec(
        n_rows,
        n_cols + 1,
        width_ratios=[1] * n_cols + [0.07],
        wspace=0.35,
        hspace=0.6,
        top=1 - (0.55 + 0.3 * (title.count("\n") + 1)) / height,
        bottom=0.5 / height,
    )
    cmap = sns.color_palette("rocket_r", as_cmap=True)
    image = None
    for index, (model, grid, condition) in enumerate(zip(models, grids, conditions)):
        ax = fig.add_subplot(grid_spec[index // n_cols, index % n_cols])
        image = _heatmap(ax, grid, cmap, top, GU_EPSILON)
        _method_title(ax, model, styles[model], condition)
        ax.set(xlabel="head", ylabel="block l")
    bar = fig.colorbar(image, cax=fig.add_subplot(grid_spec[:, -1]))
    bar.ax.axhline(GU_EPSILON, color=TOL_BRIGHT[4], linewidth=3)
    nice = matplotlib.ticker.MaxNLocator(nbins=5).tick_values(0, top)
    bar.set_ticks(sorted({float(t) for t in nice if 0 <= t <= top and abs(t - GU_EPSILON) > 0.02 * top} | {GU_EPSILON}))
    bar.set_label(f"{'sink score' if value == 'sink_score' else 'sink mass'} (line: sink threshold {GU_EPSILON:g})")
    fig.suptitle(title, y=1 - 0.15 / height)
    return fig


def _heatmap(ax: plt.Axes, grid: pd.DataFrame, cmap, top: float, threshold: float):
    """``grid`` as cells on the scale 0 .. ``top``, annotated when there are at most 8 columns;
    cells above ``threshold`` outlined. Returns the image (for a colour bar).

    Drawn with matplotlib: ``seaborn.heatmap`` draws the whole figure once per call to check its
    tick labels for overlap, which made a six-model figure cost seconds.
    """
    values = grid.to_numpy()
    image = ax.imshow(values, vmin=0, vmax=top, cmap=cmap, aspect="auto", interpolation="nearest")
    for (i, j), value in np.ndenumerate(values):
        if value > threshold:
            ax.add_patch(
                matplotlib.patches.Rectangle(
                    (j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor=TOL_BRIGHT[4], linewidth=3
                )
            )
        if grid.shape[1] <= 8:
            dark = sns.utils.relative_luminance(cmap(value / top)) <= 0.408  # seaborn's rule for the text colour
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=9, color="white" if dark else "black")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index])
    ax.grid(False)
    return image


def variance_figure(variance: pd.DataFrame, subjects: dict[str, dict] | None = None) -> plt.Figure:
    """Attention-output variance against position on log-log axes, one panel per model (titled in
    its method's colour), one line per block: a point is the variance across sequences of block
    l's ``attn_out`` at one position (several training seeds: their mean, and a band over their
    range), and a dashed slope -1 line (the 1/(i+1) law of uniform causal attention) through block
    0's first point."""
    sns.set_theme(style="whitegrid", context="notebook")
    data = variance[variance["variance"] > 0]  # a log axis cannot show an output that never varies
    models = list(data["model"].unique())
    styles = model_styles(models, subjects)
    fig, axes = _grid(len(models), 3.8, 3.2, max_cols=3)
    blocks = sorted(data["block"].astype(int).unique())
    palette = dict(zip(blocks, (TOL_BRIGHT * 4)[: len(blocks)]))
    for ax, model in zip(axes, models):
        stats = (
            data[data["model"] == model]
            .groupby(["block", "position"])["variance"]
            .agg(["mean", "min", "max"])
            .reset_index()
        )
        for block, line in stats.groupby("block"):
            x = line["position"] + 1
            ax.plot(x, line["mean"], color=palette[int(block)], label=str(int(block)))
            if (line["max"] > line["min"]).any():
                ax.fill_between(x, line["min"], line["max"], color=palette[int(block)], alpha=0.2)
        first = stats[stats["block"] == stats["block"].min()].iloc[0]
        x = np.array([first["position"] + 1, stats["position"].max() + 1], dtype=float)
        ax.plot(x, first["mean"] * x[0] / x, color="black", linestyle="--", linewidth=1.2)
        ax.set(xscale="log", yscale="log")
        _method_title(ax, model, styles[model])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in axes:
        ax.set_xlabel("position i + 1")
        ax.set_ylabel("variance of attn_out (per dim)")
    fig.suptitle(
        "Variance of each block's attention output across sequences: a point is block l's attn_out "
        "at one position\n(dashed: slope −1, the 1/(i+1) law of uniform causal attention)"
    )
    fig.tight_layout()
    handles = [matplotlib.lines.Line2D([], [], color=palette[b], label=f"block {b}") for b in blocks]
    handles.append(matplotlib.lines.Line2D([], [], color="black", linestyle="--", label="slope −1"))
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), frameon=False)
    return fig


CONDITION_COLORS = {"clean": "0.65", "remove_key": TOL_BRIGHT[1], "mean_value": TOL_BRIGHT[0]}


CONDITION_NAMES = {"clean": "clean", "remove_key": "first key removed", "mean_value": "first value set to the mean"}


def _bars(
    ax: plt.Axes,
    groups: list[int],
    series: dict[str, tuple[list, list, list]],
    colors: dict[str, str],
    names: dict[str, str],
) -> None:
    """Grouped bars with 95 % CI error bars: ``series[name] = (values, ci_lows, ci_highs)`` per group."""
    width = 0.8 / max(1, len(series))
    for i, (label, (values, lows, highs)) in enumerate(series.items()):
        x = np.arange(len(groups)) + (i - (len(series) - 1) / 2) * width
        values, lows, highs = (np.asarray(v, dtype=float) for v in (values, lows, highs))
        errors = np.vstack([np.clip(values - lows, 0, None), np.clip(highs - values, 0, None)])
        ax.bar(
            x,
            values,
            width,
            color=colors.get(label, "0.5"),
            label=names.get(label, label),
            yerr=errors,
            capsize=2,
            error_kw=dict(elinewidth=1, ecolor="0.2"),
        )
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])


def sink_ablation_figure(table: pd.DataFrame, subjects: dict[str, dict] | None = None):
    """The sweep's figure: per model (titled in its method's colour), a pair of bars per layer
    l + 1 (the output of block l): absolute-index R² there, clean and with the first key removed in
    block l, with 95 % CIs (several seeds: means of the values and CI bounds)."""
    sns.set_theme(style="whitegrid", context="notebook")
    keys = ["model", "block"]
    numbers = [
        "r2_clean",
        "r2_clean_ci_low",
        "r2_clean_ci_high",
        "r2_ablated",
        "r2_ablated_ci_low",
        "r2_ablated_ci_high",
    ]
    measured = table[table["status"] == "measured"].groupby(keys, sort=False)[numbers].mean().reset_index()
    models = list(measured["model"].unique())
    styles = model_styles(models, subjects)
    fig, axes = _grid(len(models), 3.6, 3.1)
    lowest = float(measured[["r2_clean_ci_low", "r2_ablated_ci_low"]].min().min())
    for ax, model in zip(axes, models):
        rows = measured[measured["model"] == model]
        layers_read = (rows["block"].astype(int) + 1).tolist()
        series = {
            "clean": (rows["r2_clean"], rows["r2_clean_ci_low"], rows["r2_clean_ci_high"]),
            "remove_key": (rows["r2_ablated"], rows["r2_ablated_ci_low"], rows["r2_ablated_ci_high"]),
        }
        _bars(ax, layers_read, series, CONDITION_COLORS, CONDITION_NAMES)
        ax.set(xlabel="layer l + 1 (output of block l)", ylabel="abs. index R²", ylim=(min(-0.1, lowest - 0.05), 1.1))
        _method_title(ax, model, styles[model])
    several = "train_seed" in table and table.groupby("model")["train_seed"].nunique().max() > 1
    fig.suptitle(
        "Sink ablation: a bar is the absolute-index R² at layer l + 1, clean and with the first token\n"
        "removed from the keys of block l (error bars: 95 % CI over sequences"
        + ("; bars and bounds: means over training seeds)" if several else ")")
    )
    fig.tight_layout()
    handles = [
        matplotlib.patches.Patch(color=CONDITION_COLORS[c], label=CONDITION_NAMES[c]) for c in ("clean", "remove_key")
    ]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    return fig


# the figures of nopelens intervene and nopelens dynamics live in command_figures.py (it imports this module)
__getattr__ = moved_names(
    __name__, moved=dict.fromkeys(("intervention_figure", "dynamics_figure"), "nopelens.analyses.command_figures")
)
