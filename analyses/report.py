"""Rendering: seaborn figures (PNG, and SVG on request), readable summary tables and Markdown, for
the sweep and ``nopelens intervene``; every file is written atomically.

The sweep's columns, headers and probe panels come from its reads
(:data:`~nopelens.analyses.reads.SWEEP_READS`); this module draws and formats what the analyses
measured and imports none of them.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib
import matplotlib.lines
import matplotlib.patches
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from nopelens.models.io import write_atomic, write_csv_atomic, write_text_atomic  # noqa: E402
from nopelens.analyses.reads import NO_LAYER_CLEARS  # noqa: E402
from nopelens.probes.sinks import GU_EPSILON  # noqa: E402

from . import layers, reads, seeds  # noqa: E402
from .reads import SweepRead  # noqa: E402

SEEDS_NOTE = (
    "Several training seeds: a first layer reads `agreed (per seed)`, where agreed is the first layer by "
    "which every seed recovers the target (`none` if some seed never does); a number reads `mean ± sd` "
    "over seeds. Per-seed rows: `summary_per_seed.csv`; each probe number's mean, across-seed spread "
    "and within-run 95 % CI: `probes_over_seeds.csv`."
)

NUMBER_HEADERS = {
    "best_absolute_r2": "best abs. R²",
    "best_absolute_layer": "at layer",
    "selectivity_at_best": "selectivity (R²)",
    "mad_chance_layer0": "MAD/chance, layer 0",
    "mad_chance_best": "MAD/chance, best",
    "sink_rate": "sink rate",
    "variance_slope_block0": "variance slope, block 0",
}
"""Headers of the summary's numbers (the first-layer columns take theirs from their reads)."""


def summary_headers(sweep_reads: Sequence[SweepRead] | None = None) -> dict[str, str]:
    """Summary column -> header: ``model``, each read's column (``sweep_reads``, default
    :data:`~nopelens.analyses.reads.SWEEP_READS`), then the numbers."""
    chosen = reads.SWEEP_READS if sweep_reads is None else sweep_reads
    return {"model": "model", **{read.column: read.header for read in chosen}, **NUMBER_HEADERS}


REPRODUCIBLE = {"svg.hashsalt": "nopelens"}
"""rcParams that make SVG ids (clip paths, glyphs) a hash of the content instead of a random uuid."""
NO_STAMPS = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}
"""Metadata left out, so a file depends on the figure only (not on the date or matplotlib's version)."""


def save_figure(fig: plt.Figure, stem: str | Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save ``fig`` as ``stem.<format>`` for each of ``formats``, each atomically, then close it.

    The files are reproducible: the same figure gives byte-identical files on every run.
    """
    with matplotlib.rc_context(REPRODUCIBLE):
        paths = [write_atomic(f"{stem}.{ext}", lambda temp, ext=ext: fig.savefig(
                     temp, format=ext, dpi=120, bbox_inches="tight", metadata=NO_STAMPS[ext]))
                 for ext in formats]
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------- styles

LAYER_AXIS = "layer (0 = embeddings, l + 1 = output of block l)"

TOL_BRIGHT = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB")
"""Paul Tol's "bright" qualitative scheme: distinct for the common colour-vision deficiencies
and in greyscale (https://personal.sron.nl/~pault/)."""
TOL_MUTED = ("#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE", "#882255", "#44AA99", "#999933", "#AA4499",
             "#DDDDDD")
"""Paul Tol's "muted" scheme, for up to ten lines."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")


@dataclasses.dataclass(frozen=True)
class Style:
    """How one model is drawn in every figure: its colour and its marker."""

    color: str
    marker: str


def model_styles(models) -> dict[str, Style]:
    """A colour and a marker per model, in order: Tol's bright scheme up to seven models, muted up
    to ten, then the colours repeat with other markers. Every figure of a run uses the same map.

    >>> styles = model_styles(["a", "b", "c"])
    >>> len({style.color for style in styles.values()}), styles["a"].marker
    (3, 'o')
    """
    models = list(dict.fromkeys(models))
    colors = TOL_BRIGHT if len(models) <= len(TOL_BRIGHT) else TOL_MUTED
    return {model: Style(colors[i % len(colors)], MARKERS[i % len(MARKERS)]) for i, model in enumerate(models)}


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


def _model_legend(fig: plt.Figure, styles: dict[str, Style], title: str = "model") -> None:
    """One legend for the figure, in a row under the panels."""
    handles = [matplotlib.lines.Line2D([], [], color=s.color, marker=s.marker, label=m) for m, s in styles.items()]
    fig.legend(handles=handles, title=title, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(handles), 6), frameon=False)


# ----------------------------------------------------------------------------- the sweep's figures


def probe_figure(curves: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None) -> plt.Figure:
    """Per-layer curves (:func:`~nopelens.analyses.layers.layer_curves`), one line per model, one
    panel per read of ``sweep_reads`` plus MAD / chance, in a grid; dashed: the read's threshold.
    The band is the 95 % bootstrap CI with one training seed, and the range over seeds (line:
    their mean) with several."""
    panels = [curve for curve in layers.curves_of(sweep_reads) if curve.title is not None]
    several_seeds = curves.groupby("model")["train_seed"].nunique().max() > 1
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = _grid(len(panels), 4.4, 3.3)
    styles = model_styles(curves["model"].unique())
    for ax, curve in zip(axes, panels):
        rows = curves[curves["curve"] == curve.key]
        for model, group in rows.groupby("model", sort=False):
            if several_seeds:  # line: mean over seeds; band: their range
                stats = group.groupby("layer")["value"].agg(["mean", "min", "max"]).reset_index()
                layer, value, low, high = (stats[c] for c in ("layer", "mean", "min", "max"))
            else:  # line: the value; band: its 95 % CI
                layer, value, low, high = (group[c] for c in ("layer", "value", "ci_low", "ci_high"))
            style = styles[model]
            ax.plot(layer, value, color=style.color, marker=style.marker, markersize=5, label=model)
            ax.fill_between(layer, low, high, color=style.color, alpha=0.2, linewidth=0)
        if curve.threshold is not None:
            ax.axhline(curve.threshold, color="0.35", linestyle="--", linewidth=1)
        values = pd.concat([rows["value"], rows["ci_low"]]).dropna()
        lowest = float(values.min()) if len(values) else 0.0
        top = max(1.05, float(rows["ci_high"].max()) + 0.05) if rows["ci_high"].notna().any() else 1.05
        ax.set(title=curve.title, xlabel=LAYER_AXIS if ax in axes[-3:] else "layer", ylabel=curve.axis,
               ylim=(min(-0.1, lowest - 0.05) if lowest < 0 else -0.03, top))
        ax.title.set_fontsize(11)
        _integer_ticks(ax)
    band = "range over training seeds" if several_seeds else "95 % CI over sequences"
    bars = sorted({curve.threshold for curve in panels if curve.threshold is not None})
    bar = f"threshold {bars[0]:g}" if len(bars) == 1 else "each panel's threshold"
    fig.suptitle(f"Where position becomes linearly recoverable\n(dashed: {bar}; band: {band})")
    fig.tight_layout()
    _model_legend(fig, styles)
    return fig


def site_rows(probes: pd.DataFrame) -> pd.DataFrame:
    """Absolute-index R² (regression, grouped linear probe) at every site of every block: its
    input (``resid_pre``: residual layer l), the finer sites the sweep measured (``attn_out``,
    ``resid_mid``, ``mlp_out``) and its output (``resid_post``: layer l + 1), with ``block`` and
    ``kind`` columns."""
    rows = probes[(probes["probe"] == "linear") & (probes["split"] == "grouped") & (probes["target"] == "absolute_index")
                  & (probes["task"] == "regression") & (probes["metric"] == "r2")]
    residual = rows[rows["layer"].notna()]
    finer = rows[rows["layer"].isna()]
    last = residual.groupby("model")["layer"].transform("max")
    inputs = residual[residual["layer"] < last].assign(kind="resid_pre", block=lambda t: t["layer"].astype(int))
    outputs = residual[residual["layer"] > 0].assign(kind="resid_post", block=lambda t: t["layer"].astype(int) - 1)
    finer = finer.assign(kind=finer["site"].str.rsplit(".", n=1).str[-1].str.removeprefix("hook_"),
                         block=finer["block"].astype(int))
    return pd.concat([inputs, finer, outputs], ignore_index=True)


SITE_KIND_NAMES = {"resid_pre": "block input (resid_pre)", "attn_out": "attention output (attn_out)",
                   "resid_mid": "after attention (resid_mid)", "mlp_out": "MLP output (mlp_out)",
                   "resid_post": "block output (resid_post)"}


def site_figure(probes: pd.DataFrame) -> plt.Figure:
    """Absolute-index R² inside each block, one panel per model: at the block's input, at each
    finer site the sweep measured and at its output (band: 95 % CI; several seeds: their range)."""
    rows = site_rows(probes)
    sns.set_theme(style="whitegrid", context="notebook")
    models = list(rows["model"].unique())
    fig, axes = _grid(len(models), 4.0, 3.2)
    kinds = [kind for kind in SITE_KIND_NAMES if kind in set(rows["kind"])]
    colors = dict(zip(kinds, ("0.55", TOL_BRIGHT[0], TOL_BRIGHT[4], TOL_BRIGHT[1], "0.15")))
    for ax, model in zip(axes, models):
        for kind in kinds:
            line = rows[(rows["model"] == model) & (rows["kind"] == kind)]
            if line.empty:
                continue
            stats = line.groupby("block").agg(value=("value", "mean"), low=("ci_low", "min"), high=("ci_high", "max"),
                                              lo_seed=("value", "min"), hi_seed=("value", "max"), n=("value", "size"))
            several = (stats["n"] > 1).any()
            low, high = (stats["lo_seed"], stats["hi_seed"]) if several else (stats["low"], stats["high"])
            dashed = kind in ("resid_pre", "resid_post")
            ax.plot(stats.index, stats["value"], color=colors[kind], marker="o", markersize=4,
                    linestyle="--" if dashed else "-", label=SITE_KIND_NAMES[kind])
            ax.fill_between(stats.index, low, high, color=colors[kind], alpha=0.15, linewidth=0)
        lowest = float(rows.loc[rows["model"] == model, "value"].min())
        ax.set(title=model, xlabel="block", ylabel="abs. index R²", ylim=(min(-0.1, lowest - 0.05), 1.05))
        _integer_ticks(ax)
    fig.suptitle("Absolute index inside each block: R² at the block's input, its attention and MLP "
                 "outputs,\nand its output (band: 95 % CI over sequences)")
    fig.tight_layout()
    handles = [matplotlib.lines.Line2D([], [], color=colors[k], marker="o", linestyle="--" if k in ("resid_pre", "resid_post")
                                       else "-", label=SITE_KIND_NAMES[k]) for k in kinds]
    fig.legend(handles=handles, title="site", loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(kinds),
               frameon=False)
    return fig


def sink_figure(sinks: pd.DataFrame, every_condition: bool = False) -> plt.Figure:
    """Gu et al.'s sink score (layer x head) per model, as each model was read (``every_condition``:
    one panel per model and condition, with and without BOS), on one colour scale fitted to the
    data and reaching past the sink threshold, which the colour bar marks; heads above it are
    outlined. (Tables without a score, from sequences too short for Gu's window, show the sink
    mass instead.)"""
    sns.set_theme(style="white", context="notebook")
    value = "sink_score" if "sink_score" in sinks else "sink_mass"
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
        title = ("Attention sinks: Gu et al.'s sink score per block and head (mean attention on the first token "
                 f"over the first T ≤ 64 queries; a head above {GU_EPSILON:g} is a sink, outlined)")
    else:
        title = "Attention sinks: sink mass per block and head (mean attention on the first token)"
    title = textwrap.fill(title, int(width * 9))
    height = 2.9 * n_rows + 0.5 + 0.3 * (title.count("\n") + 1)
    fig = plt.figure(figsize=(width, height))
    grid_spec = fig.add_gridspec(n_rows, n_cols + 1, width_ratios=[1] * n_cols + [0.07], wspace=0.35, hspace=0.6,
                                 top=1 - (0.55 + 0.3 * (title.count("\n") + 1)) / height, bottom=0.5 / height)
    cmap = sns.color_palette("rocket_r", as_cmap=True)
    image = None
    for index, (model, grid, condition) in enumerate(zip(models, grids, conditions)):
        ax = fig.add_subplot(grid_spec[index // n_cols, index % n_cols])
        image = _heatmap(ax, grid, cmap, top, GU_EPSILON)
        ax.set(title=f"{model}\n({condition})", xlabel="head", ylabel="block")
        ax.title.set_fontsize(11)
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
            ax.add_patch(matplotlib.patches.Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False,
                                                      edgecolor=TOL_BRIGHT[4], linewidth=3))
        if grid.shape[1] <= 8:
            dark = sns.utils.relative_luminance(cmap(value / top)) <= 0.408  # seaborn's rule for the text colour
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=9, color="white" if dark else "black")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index])
    ax.grid(False)
    return image


def variance_figure(variance: pd.DataFrame) -> plt.Figure:
    """Attention-output variance against position on log-log axes, one panel per model, one line
    per block (several training seeds: their mean, and a band over their range), and a dashed
    slope -1 line (the 1/(i+1) law of uniform causal attention) through block 0's first point."""
    sns.set_theme(style="whitegrid", context="notebook")
    data = variance[variance["variance"] > 0]  # a log axis cannot show an output that never varies
    models = list(data["model"].unique())
    fig, axes = _grid(len(models), 3.8, 3.2, max_cols=3)
    blocks = sorted(data["block"].astype(int).unique())
    palette = dict(zip(blocks, (TOL_BRIGHT * 4)[: len(blocks)]))
    for ax, model in zip(axes, models):
        stats = (data[data["model"] == model].groupby(["block", "position"])["variance"]
                 .agg(["mean", "min", "max"]).reset_index())
        for block, line in stats.groupby("block"):
            x = line["position"] + 1
            ax.plot(x, line["mean"], color=palette[int(block)], label=str(int(block)))
            if (line["max"] > line["min"]).any():
                ax.fill_between(x, line["min"], line["max"], color=palette[int(block)], alpha=0.2)
        first = stats[stats["block"] == stats["block"].min()].iloc[0]
        x = np.array([first["position"] + 1, stats["position"].max() + 1], dtype=float)
        ax.plot(x, first["mean"] * x[0] / x, color="black", linestyle="--", linewidth=1.2)
        ax.set(xscale="log", yscale="log", title=model)
        ax.title.set_fontsize(11)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in axes:
        ax.set_xlabel("position i + 1")
        ax.set_ylabel("variance of attn_out (per dim)")
    fig.suptitle("Variance of each block's attention output across sequences, by position\n"
                 "(dashed: slope −1, the 1/(i+1) law of uniform causal attention)")
    fig.tight_layout()
    handles = [matplotlib.lines.Line2D([], [], color=palette[b], label=f"block {b}") for b in blocks]
    handles.append(matplotlib.lines.Line2D([], [], color="black", linestyle="--", label="slope −1"))
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), frameon=False)
    return fig


# ----------------------------------------------------------------------------- tables on a screen


SCREEN_WIDTH = 100
"""Characters a printed table may take; wider ones are split into column groups (:func:`fit_width`)."""


def fit_width(table: pd.DataFrame, render, width: int = SCREEN_WIDTH, keep: int = 1) -> list[str]:
    """``table`` rendered in column groups that each fit ``width`` characters.

    Args:
        table: the table.
        render: DataFrame -> text (``lambda t: t.to_string(index=False)``, ``to_markdown``).
        width: the widest line allowed (a single column wider than that is shown alone).
        keep: how many leading columns (the row labels) every group repeats.

    Returns:
        The rendered groups, in column order.
    """
    fixed, rest = list(table.columns[:keep]), list(table.columns[keep:])
    groups, current = [], []
    for column in rest:
        trial = render(table[fixed + current + [column]])
        if current and max(len(line) for line in trial.splitlines()) > width:
            groups.append(current)
            current = [column]
        else:
            current.append(column)
    groups.append(current)
    return [render(table[fixed + group]) for group in groups]


def _text(table: pd.DataFrame) -> str:
    return table.to_string(index=False)


def _markdown(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False)


def _number(value: float) -> str:
    text = f"{value:.2f}"
    return "0.00" if text == "-0.00" else text


def _with_ci(value, low, high, clears) -> str:
    if pd.isna(value):
        return "n/a"
    ci = "" if pd.isna(low) else f" [{_number(low)}, {_number(high)}]"
    return f"{_number(value)}{ci}{'*' if clears is True else ''}"


def layer_table(curves: pd.DataFrame, model: str, sweep_reads: Sequence[SweepRead] | None = None) -> pd.DataFrame:
    """One model's per-layer table: a row per layer, a column per curve
    (:func:`~nopelens.analyses.layers.curves_of`), each cell ``value [95 % CI]``, ``*`` where the
    CI clears the read's bar, ``n/a`` where the model has no such site; sink heads as ``k/n``.
    With several training seeds a cell holds the means over seeds (value and CI bounds), ``*``
    where every seed clears the bar, and the sink column the mean fraction of sink heads."""
    rows = curves[curves["model"] == model]
    several = rows["train_seed"].nunique() > 1
    table = pd.DataFrame({"layer": sorted(rows["layer"].unique())})
    for curve in layers.curves_of(sweep_reads):
        picked = rows[rows["curve"] == curve.key]
        by_layer = picked.groupby("layer").agg(value=("value", "mean"), ci_low=("ci_low", "mean"),
                                               ci_high=("ci_high", "mean"), n_heads=("n_heads", "first"),
                                               clears=("clears", lambda c: bool(c.notna().all() and c.all())
                                                       if c.notna().any() else None))
        if curve.key == layers.SINK_RATE:
            cells = {layer: ("n/a" if row.value != row.value else f"{row.value:.2f}" if several
                             else f"{round(row.value * row.n_heads)}/{row.n_heads}")  # n/a: no head got a verdict
                     for layer, row in by_layer.iterrows()}
            missing = np.where(table["layer"] == 0, "", "n/a")  # layer 0: the embeddings, no block
            table[curve.label] = table["layer"].map(cells).fillna(pd.Series(missing, index=table.index))
        else:
            cells = {layer: _with_ci(row.value, row.ci_low, row.ci_high, row.clears) for layer, row in by_layer.iterrows()}
            table[curve.label] = table["layer"].map(cells).fillna("n/a")
    return table


LAYER_NOTE = ("value [95 % CI over sequences] per layer (0 = embeddings, l + 1 = output of block l; an attention "
              "read of block l sits at layer l + 1); * = the CI clears the read's bar; n/a = no such site (or a "
              "block --layers left out: listed under Not applicable), or a metric undefined there (Spearman's ρ of "
              "predictions that are all equal); "
              "MAD/chance: 0 = exact, about 0.75 = predicting the mean; sink heads: heads of block l with Gu et "
              "al.'s score > 0.3, at layer l + 1 (n/a: no verdict where uniform attention alone scores > 0.3 over the "
              "queries scored, under a short window or on short sequences: gu_chance in sinks.csv; or no sink read "
              "at that block: listed under Not applicable).")
SEEDS_LAYER_NOTE = (" Several training seeds: each cell is the mean over seeds of the value and of its CI bounds; "
                    "* = every seed clears the bar; sink heads: the mean fraction.")


def layer_tables_text(curves: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None,
                      width: int = SCREEN_WIDTH) -> str:
    """Every model's :func:`layer_table` as plain text, each part at most ``width`` characters."""
    several = curves.groupby("model")["train_seed"].nunique().max() > 1
    parts = [textwrap.fill(LAYER_NOTE + (SEEDS_LAYER_NOTE if several else ""), width)]
    for model in curves["model"].unique():
        parts.append(f"\n{model}")
        parts.extend(fit_width(layer_table(curves, model, sweep_reads), _text, width))
    return "\n".join(parts)


def layer_tables_markdown(curves: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None) -> list[str]:
    """The "Per layer" section of ``summary.md``: :func:`layer_table` of every model."""
    several = curves.groupby("model")["train_seed"].nunique().max() > 1
    lines = ["## Per layer", "", LAYER_NOTE + (SEEDS_LAYER_NOTE if several else ""), ""]
    for model in curves["model"].unique():
        lines += [f"### {model}", ""]
        for part in fit_width(layer_table(curves, model, sweep_reads), _markdown):
            lines += [part, ""]
    return lines


def summary_text(summary: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None,
                 width: int = SCREEN_WIDTH, not_applicable: Mapping[str, Mapping[str, str]] | None = None) -> str:
    """The summary table (:func:`summary_table`) as plain text in column groups of at most ``width``,
    then the reads each model left out and why (``not_applicable``, :func:`not_applicable_reads`)."""
    tables = fit_width(summary_table(summary, sweep_reads, not_applicable), _text, width)
    return "\n\n".join(tables + [not_applicable_text(not_applicable, width=width)] if not_applicable else tables)


NOT_READ = "n/a (see below)"
"""A summary number whose read the model made impossible (the reason is listed under the summary)."""


def not_applicable_reads(subjects: Mapping[str, dict]) -> dict[str, dict[str, str]]:
    """Model -> {read: why it was not applicable} from each measured subject's info
    (:attr:`SweepResult.subjects <nopelens.analyses.sweep.SweepResult>`, as ``done.json`` holds it),
    merged over training seeds; models that left nothing out are absent."""
    reasons: dict[str, dict[str, str]] = {}
    for label, info in subjects.items():
        if info.get("not_applicable"):
            reasons.setdefault(info.get("name", label), {}).update(info["not_applicable"])
    return reasons


def not_applicable_text(not_applicable: Mapping[str, Mapping[str, str]], bullet: str = "",
                        width: int | None = None) -> str:
    """``not_applicable`` (:func:`not_applicable_reads`) as lines ``model, read: why``, each wrapped at
    ``width`` characters when given (on screen; Markdown keeps one line per read)."""
    lines = [f"{bullet}{model}, {read}: {why}" for model, notes in not_applicable.items()
             for read, why in sorted(notes.items())]
    if width is not None:
        lines = [textwrap.fill(line, width, subsequent_indent="  ") for line in lines]
    return "\n".join(["Not applicable:"] + lines)


def summary_table(summary: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None,
                  not_applicable: Mapping[str, Mapping[str, str]] | None = None) -> pd.DataFrame:
    """The summary with readable headers, "none" for targets no layer recovered, "n/a" for reads the
    model has no site for (no ``hook_attn_scores``) and for selectivity where the control task is
    undefined, rounded numbers; ``sweep_reads`` are the reads whose first layers it holds (default
    :data:`~nopelens.analyses.reads.SWEEP_READS`). A sink rate or variance slope whose read a model
    left out (``not_applicable``: model -> {read: why}, :func:`not_applicable_reads`; e.g. every
    block a DSA past ``index_topk``) reads :data:`NOT_READ`; a variance slope otherwise missing is
    an output that never varies.

    With several training seeds (columns from :func:`~nopelens.analyses.seeds.over_seeds`) a
    first layer reads ``2 (1/1/2)``: the layer all seeds agree on, then each seed's; a number
    reads ``0.953 ± 0.012``: mean ± standard deviation across seeds.
    """
    table = summary.copy()
    for column in reads.read_columns(sweep_reads):
        table[column] = table[column].map(_layer_text)
        if f"{column}_per_seed" in table:
            per_seed = table.pop(f"{column}_per_seed").str.replace(str(NO_LAYER_CLEARS), "none")
            table[column] = [f"{agreed} ({seeds})" if n_seeds > 1 else agreed
                             for agreed, seeds, n_seeds in zip(table[column], per_seed, table["n_seeds"])]
    table = table.round(3)
    skipped = not_applicable or {}

    def missing(model, read: str, otherwise: str) -> str:
        return NOT_READ if read in skipped.get(model, {}) else otherwise

    table["variance_slope_block0"] = [missing(model, "variance read", "n/a (variance 0)") if pd.isna(v) else f"{v:.3f}"
                                      for model, v in zip(table["model"], table["variance_slope_block0"])]
    if "sink_rate" in table:
        table["sink_rate"] = [missing(model, "sink read", "n/a") if pd.isna(v) else v
                              for model, v in zip(table["model"], table["sink_rate"])]
    # NaN selectivity: the control task is undefined (every sampled token has one id)
    if "selectivity_at_best" in table:
        table["selectivity_at_best"] = table["selectivity_at_best"].map(
            lambda v: "n/a (one token id)" if pd.isna(v) else v)
    for column in [c for c in table.columns if c.endswith("_seed_sd")]:
        spread = table.pop(column)
        name = column[: -len("_seed_sd")]
        table[name] = [value if pd.isna(sd) else f"{value} ± {sd:.3f}" for value, sd in zip(table[name], spread)]
    return table.rename(columns=summary_headers(sweep_reads) | {"n_seeds": "training seeds"})


def rounded_text(table: pd.DataFrame, decimals: int = 3) -> pd.DataFrame:
    """``table`` rounded for printing, every missing number shown as ``n/a`` (never ``NaN``)."""
    return table.round(decimals).astype(object).where(table.notna(), "n/a")


def _layer_text(layer) -> str:
    if layer is None or pd.isna(layer):
        return "n/a"
    return "none" if layer == NO_LAYER_CLEARS else str(int(layer))


def first_layer_note(sweep_reads: Sequence[SweepRead] | None = None) -> str:
    """What the summary's first-layer columns mean, with the bars of ``sweep_reads``."""
    chosen = reads.SWEEP_READS if sweep_reads is None else sweep_reads
    bars = sorted({read.threshold for read in chosen})
    lower = all(read.higher_is_better for read in chosen)
    if len(bars) == 1 and lower:
        rule = f"whose 95 % CI lower bound clears {bars[0]:g}"
    else:
        rule = ("whose 95 % CI clears the bar in its column's header (≥: the lower bound reaches it; ≤: the upper "
                "bound stays at or below it)")
    return (f"First layer {rule} (layer 0 = embeddings, layer l + 1 = output of block l; an attention read of "
            "block l is reported at layer l + 1). `none`: no layer cleared it; `n/a`: the model has no site for "
            "that read, or its metric is undefined there (Spearman's ρ of predictions that are all equal). The numbers behind each first layer are in the per-layer tables below.")


READS_TEXT = (
    "Relative distance i − j is read three ways. *Pairs*: a linear probe on [h_i; h_j] from the residual "
    "stream (it inherits any absolute index). *Head scores*: a linear probe on each head's pre-softmax "
    "score of key j, content and position bias together (`hook_attn_scores`, taken relative to the "
    "query's own key, since the softmax ignores a constant per query): what the head itself can use, "
    "on the same footing for NoPE, RoPE, ALiBi and Shaw. *Content q·k*: a bilinear probe on the "
    "(rotated) q_i and k_j only; it sees RoPE but never a bias added to the score, so ALiBi and Shaw "
    "show their position there only through what earlier layers wrote."
)
NUMBERS_TEXT = (
    "Selectivity = probe score minus the Hewitt & Liang control-task score at the same layer. "
    "MAD/chance: mean absolute distance of the regression probe over its chance value E|X − Y| for positions "
    "drawn as scored ((L² − 1)/(3L) for L uniform positions; Haviv et al. 2022), at the embeddings and at the "
    "best layer. Sink rate: fraction of (layer, head) pairs whose Gu et al. (2025) sink score (mean attention "
    "on token 0 over the first T ≤ 64 queries) exceeds 0.3; uniform attention gives 0.0741 per head. Variance "
    "slope: log-log slope of block 0's attention-output variance against position + 1 (-1 is the 1/(i+1) law). "
    "Every column of every table is described in docs/schema.md."
)

FIGURE_TITLES = {"probes": "per-layer probe curves", "sites": "absolute index inside each block",
                 "sinks": "attention-sink scores", "variance": "attention-output variance",
                 "sink_ablation": "sink ablation"}


def summary_markdown(result, settings, command: str, versions: dict[str, str],
                     ablation_sequences: int | None = None, figures: Sequence[str] = (), name: str = "sweep") -> str:
    """The ``summary.md`` of a sweep or ``nopelens probe`` (``name``): the summary, the per-layer
    tables, the figures in ``figures`` (the stems written; only those are linked), the sink
    ablation (``ablation_sequences``: how many sequences it probed), command, settings and versions.

    ``result`` and ``settings`` are the sweep's :class:`~nopelens.analyses.sweep.SweepResult` and
    :class:`~nopelens.analyses.sweep.SweepSettings` (not imported here: the sweep imports this module)."""
    sweep_reads = result.reads
    skipped = not_applicable_reads(result.subjects)
    tables = fit_width(summary_table(result.summary, sweep_reads, skipped), _markdown)
    if skipped:
        tables.append(not_applicable_text(skipped, bullet="- "))
    settings_text = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items())
    pictures = [f"![{FIGURE_TITLES.get(stem, stem)}]({stem}.png)" for stem in figures if stem != "sink_ablation"]
    return "\n".join([
        f"# nopelens {name}",
        "",
        first_layer_note(sweep_reads),
        *([""] + [SEEDS_NOTE] if "n_seeds" in result.summary else []),
        "",
        "\n\n".join(tables),
        "",
        READS_TEXT,
        "",
        NUMBERS_TEXT,
        "",
        *(layer_tables_markdown(result.curves, sweep_reads) if result.curves is not None else []),
        *[line for picture in pictures for line in (picture, "")],
        *_sink_ablation_section(result, ablation_sequences, "sink_ablation" in figures),
        f"Command: `{command}`",
        "",
        f"Settings: {settings_text}",
        "",
        f"Versions: {version_text}",
        "",
    ])


SWEEP_FIGURES = ("probes", "sites", "sinks", "variance", "sink_ablation")
"""The stems of every figure :func:`write_run` may draw."""


def write_run(result, settings, command: str, versions: dict[str, str],
              svg: bool = False, ablation_sequences: int | None = None, name: str = "sweep",
              draw: bool = True) -> list[str]:
    """Write the tables, figures (PNG; also SVG if ``svg``; none unless ``draw``) and ``summary.md`` of a sweep into
    ``result.out_dir``: ``layers.csv`` (the main curves), and with several training seeds also
    ``summary_per_seed.csv`` and ``probes_over_seeds.csv`` (:mod:`~nopelens.analyses.seeds`).
    ``result`` and ``settings``: as :func:`summary_markdown`.

    A figure or table this run does not write (``--no-figures``, no SVG asked, nothing to show) is
    removed if an earlier run in the folder left one, so the folder describes this run only.

    Returns:
        The stems of the figures written (a figure with nothing to show is not written: no
        ``variance`` when no attention output varies, no ``sites`` without finer sites).
    """
    out = result.out_dir
    for table in ("probes", "sinks", "variance", "summary"):
        write_csv_atomic(getattr(result, table), out / f"{table}.csv")
    write_csv_atomic(result.curves, out / "layers.csv")
    if "n_seeds" in result.summary:
        write_csv_atomic(result.summary_per_seed, out / "summary_per_seed.csv")
        write_csv_atomic(seeds.probes_over_seeds(result.probes), out / "probes_over_seeds.csv")
    else:  # one training seed now: the tables of an earlier run over several would describe other parts
        for stale in ("summary_per_seed.csv", "probes_over_seeds.csv"):
            (out / stale).unlink(missing_ok=True)
    formats = ("png", "svg") if svg else ("png",)
    figures = {"probes": lambda: probe_figure(result.curves, result.reads)}
    if not site_rows(result.probes).query("kind not in ('resid_pre', 'resid_post')").empty:
        figures["sites"] = lambda: site_figure(result.probes)
    if not result.sinks.empty:  # no sink read applies (every block a DSA past index_topk): no figure
        figures["sinks"] = lambda: sink_figure(result.sinks)
    if (result.variance.get("variance", pd.Series(dtype=float)) > 0).any():  # nothing varies: no figure
        figures["variance"] = lambda: variance_figure(result.variance)
    if not result.sink_ablation.empty:
        write_csv_atomic(result.sink_ablation, out / "sink_ablation.csv")
        if (result.sink_ablation["status"] == "measured").any():
            figures["sink_ablation"] = lambda: sink_ablation_figure(result.sink_ablation)
    else:
        (out / "sink_ablation.csv").unlink(missing_ok=True)
    if not draw:
        figures = {}
    for stem, figure in figures.items():
        save_figure(figure(), out / stem, formats)
    for stem in SWEEP_FIGURES:  # an earlier run's figures would show what this run did not draw
        for ext in ("png", "svg"):
            if stem not in figures or ext not in formats:
                (out / f"{stem}.{ext}").unlink(missing_ok=True)
    write_text_atomic(out / "summary.md", summary_markdown(result, settings, command, versions, ablation_sequences,
                                                           list(figures), name))
    return list(figures)


def _sink_ablation_section(result, n_sequences: int | None, figure: bool = True) -> list[str]:
    """The summary's sink-ablation table (``nopelens intervene`` has the full measurement)."""
    if result.sink_ablation.empty:
        return []
    which = "all" if n_sequences is None else f"first {n_sequences}"
    return [
        "## Sink ablation",
        "",
        "Absolute-index R² (regression probe, tokens after the first, "
        f"{which} evaluation sequences) at layer l + 1, clean → with the first "
        "token removed from the keys of every later query in block l: on the same sequences and settings, the "
        "numbers of the `remove_key` rows of `nopelens intervene MODEL`. `n/a`: the ablation cannot be applied "
        "and checked on that model (see sink_ablation.csv).",
        "",
        sink_ablation_markdown(seeds.sink_ablation_over_seeds(result.sink_ablation)),
        "",
        *(["![sink ablation](sink_ablation.png)", ""] if figure else []),
    ]


# ----------------------------------------------------------------------------- nopelens intervene


CONDITION_COLORS = {"clean": "0.65", "remove_key": TOL_BRIGHT[1], "mean_value": TOL_BRIGHT[0]}
CONDITION_NAMES = {"clean": "clean", "remove_key": "first key removed", "mean_value": "first value set to the mean"}


def _bars(ax: plt.Axes, groups: list[int], series: dict[str, tuple[list, list, list]], colors: dict[str, str],
          names: dict[str, str]) -> None:
    """Grouped bars with 95 % CI error bars: ``series[name] = (values, ci_lows, ci_highs)`` per group."""
    width = 0.8 / max(1, len(series))
    for i, (label, (values, lows, highs)) in enumerate(series.items()):
        x = np.arange(len(groups)) + (i - (len(series) - 1) / 2) * width
        values, lows, highs = (np.asarray(v, dtype=float) for v in (values, lows, highs))
        errors = np.vstack([np.clip(values - lows, 0, None), np.clip(highs - values, 0, None)])
        ax.bar(x, values, width, color=colors.get(label, "0.5"), label=names.get(label, label), yerr=errors,
               capsize=2, error_kw=dict(elinewidth=1, ecolor="0.2"))
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])


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
        clean = probes[(probes["condition"] == "clean") & (probes["probe"] == "linear")
                       & (probes["target"] == "absolute_index") & (probes["metric"] == "r2")].set_index("layer")
        series = {"clean": ([clean.loc[b + 1, "value"] for b in blocks], [clean.loc[b + 1, "ci_low"] for b in blocks],
                            [clean.loc[b + 1, "ci_high"] for b in blocks])}
        for mode, rows in summary.groupby("condition", sort=False):
            rows = rows.set_index("ablated_block").reindex(blocks)
            series[mode] = (rows["abs_r2"].tolist(), rows["abs_r2_ci_low"].tolist(), rows["abs_r2_ci_high"].tolist())
        _bars(axes[0], blocks, series, CONDITION_COLORS, CONDITION_NAMES)
        lowest = min(float(np.nanmin(values)) for _, values, _ in series.values())
        axes[0].set_ylim(min(-0.1, lowest - 0.05), 1.1)
        axes[0].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(series), frameon=False)
    axes[0].set(title="sink ablated in block l:\nabs. index R² at layer l + 1", xlabel="block l",
                ylabel="abs. index R² (refitted probe)")
    directions = tables["directions"]
    if "read_shift" in directions:
        shifted = directions[directions["intervention"] == "shift"]
        for i, (layer, line) in enumerate(shifted.groupby("layer")):
            ax_color = (TOL_BRIGHT * 3)[i]
            axes[1].plot(line["read_layer"], line["read_shift"] / line["k"], marker="o", color=ax_color,
                         label=f"layer {int(layer)}")
        carried = shifted["read_shift"] / shifted["k"]
        axes[1].set_ylim(min(-0.1, float(carried.min()) - 0.05), max(1.1, float(carried.max()) + 0.05))
        axes[1].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False,
                       title="index shifted at", title_fontsize=9)
        _integer_ticks(axes[1])
    axes[1].set(title="index direction shifted by k at layer l:\nshift a clean probe reads / k", xlabel="read layer",
                ylabel="read shift / k (1 = all carried)")
    patching = tables["patching"]
    if "moved" in patching:
        for i, (position, line) in enumerate(patching.groupby("position")):
            errors = np.vstack([line["moved"] - line["moved_ci_low"], line["moved_ci_high"] - line["moved"]])
            axes[2].errorbar(line["layer"], line["moved"], yerr=np.clip(np.nan_to_num(errors), 0, None), marker="o",
                             capsize=2, color=(TOL_BRIGHT * 3)[i], label=f"position {int(position)}")
        moved = pd.concat([patching["moved_ci_low"], patching["moved_ci_high"]]).dropna()
        if len(moved):
            axes[2].set_ylim(min(-0.1, float(moved.min()) - 0.05), max(1.1, float(moved.max()) + 0.05))
        axes[2].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
        _integer_ticks(axes[2])
    axes[2].set(title="state patched from a shifted copy:\nshare of the index that moves (last layer)",
                xlabel="patched layer (resid_pre)", ylabel="share moved (0 = recomputed)")
    fig.suptitle(f"{name}: does the model make and use the position a probe reads? (error bars: 95 % CI)")
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.32, wspace=0.3)
    return fig


def sink_ablation_figure(table: pd.DataFrame):
    """The sweep's figure: per model, absolute-index R² at layer l + 1, clean and with the first
    key removed in block l, with 95 % CIs (several seeds: means of the values and CI bounds)."""
    sns.set_theme(style="whitegrid", context="notebook")
    keys = ["model", "block"]
    numbers = ["r2_clean", "r2_clean_ci_low", "r2_clean_ci_high", "r2_ablated", "r2_ablated_ci_low", "r2_ablated_ci_high"]
    measured = table[table["status"] == "measured"].groupby(keys, sort=False)[numbers].mean().reset_index()
    models = list(measured["model"].unique())
    fig, axes = _grid(len(models), 3.6, 2.9)
    lowest = float(measured[["r2_clean_ci_low", "r2_ablated_ci_low"]].min().min())
    for ax, model in zip(axes, models):
        rows = measured[measured["model"] == model]
        blocks = rows["block"].astype(int).tolist()
        series = {"clean": (rows["r2_clean"], rows["r2_clean_ci_low"], rows["r2_clean_ci_high"]),
                  "remove_key": (rows["r2_ablated"], rows["r2_ablated_ci_low"], rows["r2_ablated_ci_high"])}
        _bars(ax, blocks, series, CONDITION_COLORS, CONDITION_NAMES)
        ax.set(title=model, xlabel="block l", ylabel="R² at layer l + 1", ylim=(min(-0.1, lowest - 0.05), 1.1))
        ax.title.set_fontsize(11)
    several = "train_seed" in table and table.groupby("model")["train_seed"].nunique().max() > 1
    fig.suptitle("Sink ablation: absolute-index R² at layer l + 1, clean and with the first token\nremoved "
                 "from the keys of block l (error bars: 95 % CI over sequences"
                 + ("; bars and bounds: means over training seeds)" if several else ")"))
    fig.tight_layout()
    handles = [matplotlib.patches.Patch(color=CONDITION_COLORS[c], label=CONDITION_NAMES[c]) for c in ("clean", "remove_key")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    return fig


def sink_ablation_markdown(table: pd.DataFrame) -> str:
    """The sweep's compact table: one row per model, one column per block (R² clean → ablated)."""
    def cell(row) -> str:
        if row["status"] != "measured":
            return "n/a"
        return f"{row['r2_clean']:.2f} → {row['r2_ablated']:.2f}"

    grid = table.assign(cell=table.apply(cell, axis=1)).pivot(index="model", columns="block", values="cell")
    grid.columns = [f"block {int(b)}" for b in grid.columns]
    return grid.reset_index().fillna("").to_markdown(index=False)
