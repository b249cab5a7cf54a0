"""Rendering: seaborn figures (PNG, and SVG on request), readable summary tables and Markdown, for
the sweep and ``nopelens intervene``; every file is written atomically.

The sweep's columns, headers and probe panels come from its reads
(:data:`~nopelens.analyses.reads.SWEEP_READS`); this module draws and formats what the analyses
measured and imports none of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import matplotlib.lines
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from nopelens.models.io import write_atomic, write_csv_atomic, write_text_atomic  # noqa: E402
from nopelens.probes.linear import NOT_RECOVERED  # noqa: E402

from . import reads, seeds  # noqa: E402

if TYPE_CHECKING:
    from .reads import SweepRead
    from .sweep import SweepResult, SweepSettings

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


def summary_headers() -> dict[str, str]:
    """Summary column -> header: ``model``, each read's column (:data:`~nopelens.analyses.reads.SWEEP_READS`),
    then the numbers."""
    return {"model": "model", **{read.column: read.header for read in reads.SWEEP_READS}, **NUMBER_HEADERS}


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


def probe_panel_rows(probes: pd.DataFrame, read: "SweepRead") -> pd.DataFrame:
    """The linear-probe rows the panel of ``read`` in :func:`probe_figure` plots, by model and layer."""
    return read.rows(probes).sort_values(["model", "layer"])


def probe_figure(probes: pd.DataFrame) -> plt.Figure:
    """Per-layer probe score, one line per model, one panel per read
    (:data:`~nopelens.analyses.reads.SWEEP_READS`, dashed: its threshold). The band is the 95 %
    bootstrap CI with one training seed, and the range over seeds (line: their mean) with several."""
    panels = reads.SWEEP_READS
    several_seeds = "train_seed" in probes.columns and probes.groupby("model")["train_seed"].nunique().max() > 1
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), sharey=False, squeeze=False)
    axes = axes[0]
    palette = dict(zip(probes["model"].unique(), sns.color_palette("colorblind", probes["model"].nunique())))
    for ax, read in zip(axes, panels):
        rows = probe_panel_rows(probes, read)
        for model, group in rows.groupby("model", sort=False):
            if several_seeds:  # line: mean over seeds; band: their range
                over_seeds = group.groupby("layer")["value"].agg(["mean", "min", "max"]).reset_index()
                layer, value, low, high = (over_seeds[c] for c in ("layer", "mean", "min", "max"))
            else:  # line: the value; band: its 95 % CI
                layer, value, low, high = (group[c] for c in ("layer", "value", "ci_low", "ci_high"))
            ax.plot(layer, value, marker="o", color=palette[model], label=model)
            ax.fill_between(layer, low, high, color=palette[model], alpha=0.2)
        ax.axhline(read.threshold, color="grey", linestyle="--", linewidth=1)
        ax.set(title=read.panel, xlabel="layer (0 = embeddings)", ylabel=read.metric,
               ylim=(-0.1 if read.metric == "r2" else 0, 1.05))
    axes[-1].legend(handles=[matplotlib.lines.Line2D([], [], color=color, marker="o", label=model)
                             for model, color in palette.items()],
                    title="model", loc="upper left", bbox_to_anchor=(1.02, 1))
    band = "range over training seeds" if several_seeds else "95 % CI"
    bars = sorted({read.threshold for read in panels})
    bar = f"threshold {bars[0]:g}" if len(bars) == 1 else "each panel's threshold"
    fig.suptitle(f"Where position becomes linearly recoverable (dashed: {bar}; band: {band})", y=1.04)
    return fig


def sink_figure(sinks: pd.DataFrame) -> plt.Figure:
    """Sink mass heatmap (layer x head) per model, as each model was read."""
    sns.set_theme(style="white", context="notebook")
    models = list(sinks["model"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = sinks[sinks["model"] == model]
        rows = rows[rows["condition"] == rows["condition"].iloc[0]]
        grid = rows.pivot_table(index="block", columns="head", values="sink_mass")
        _heatmap(ax, grid, colorbar=ax is axes[0][-1])
        ax.set(title=f"{model}\n({rows['condition'].iloc[0].replace('_', ' ')})", xlabel="head", ylabel="layer (block)")
    fig.suptitle("Attention-sink mass: mean attention on the first token", y=1.08)
    return fig


def _heatmap(ax: plt.Axes, grid: pd.DataFrame, colorbar: bool) -> None:
    """``grid`` (values in [0, 1]) as cells, annotated when there are at most 8 columns.

    Drawn with matplotlib: ``seaborn.heatmap`` draws the whole figure once per call to check its
    tick labels for overlap, which made a six-model figure cost seconds.
    """
    cmap = sns.color_palette("rocket_r", as_cmap=True)
    values = grid.to_numpy()
    image = ax.imshow(values, vmin=0, vmax=1, cmap=cmap, aspect="auto", interpolation="nearest")
    if grid.shape[1] <= 8:
        for (i, j), value in np.ndenumerate(values):
            dark = sns.utils.relative_luminance(cmap(value)) <= 0.408  # seaborn's rule for the text colour
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if dark else "black")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index])
    ax.grid(False)
    if colorbar:
        ax.figure.colorbar(image, ax=ax)


def variance_figure(variance: pd.DataFrame) -> plt.Figure:
    """Attention-output variance against position on log-log axes, one panel per model, one line
    per block (several training seeds: their mean, and a band over their range)."""
    sns.set_theme(style="whitegrid", context="notebook")
    data = variance[variance["variance"] > 0]  # a log axis cannot show an output that never varies
    models = list(data["model"].unique())
    n_cols = min(4, len(models))
    n_rows = -(-len(models) // n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(3.4 * n_cols + 1, 3.2 * n_rows), squeeze=False, sharex=True)
    fig.subplots_adjust(wspace=0.35, hspace=0.4)
    blocks = sorted(data["block"].astype(int).unique())
    palette = dict(zip(blocks, sns.color_palette(n_colors=len(blocks))))
    for ax, model in zip(axes.flat, models):
        stats = (data[data["model"] == model].groupby(["block", "position"])["variance"]
                 .agg(["mean", "min", "max"]).reset_index())
        for block, line in stats.groupby("block"):
            x = line["position"] + 1
            ax.plot(x, line["mean"], color=palette[int(block)], label=str(int(block)))
            if (line["max"] > line["min"]).any():
                ax.fill_between(x, line["min"], line["max"], color=palette[int(block)], alpha=0.2)
        ax.set(xscale="log", yscale="log", xlabel="position + 1", ylabel="variance", title=f"model = {model}")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    axes.flat[len(models) - 1].legend(title="block", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("Variance shrinkage of attention outputs (slope -1 is the 1/(i+1) law)", y=1.03)
    return fig


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with readable headers, "none" for targets no layer recovered, "n/a" for reads the
    model has no site for (no ``hook_attn_scores``) and for selectivity where the control task is
    undefined, rounded numbers.

    With several training seeds (columns from :func:`~nopelens.analyses.seeds.over_seeds`) a
    first layer reads ``2 (1/1/2)``: the layer all seeds agree on, then each seed's; a number
    reads ``0.953 ± 0.012``: mean ± standard deviation across seeds.
    """
    table = summary.copy()
    for column in reads.read_columns():
        table[column] = table[column].map(_layer_text)
        if f"{column}_per_seed" in table:
            per_seed = table.pop(f"{column}_per_seed").str.replace(str(NOT_RECOVERED), "none")
            table[column] = [f"{agreed} ({seeds})" if n_seeds > 1 else agreed
                             for agreed, seeds, n_seeds in zip(table[column], per_seed, table["n_seeds"])]
    table = table.round(3)
    slope = table["variance_slope_block0"]
    table["variance_slope_block0"] = slope.map(lambda v: "n/a (variance 0)" if pd.isna(v) else f"{v:.3f}")
    # NaN selectivity: the control task is undefined (every sampled token has one id)
    if "selectivity_at_best" in table:
        table["selectivity_at_best"] = table["selectivity_at_best"].map(
            lambda v: "n/a (one token id)" if pd.isna(v) else v)
    for column in [c for c in table.columns if c.endswith("_seed_sd")]:
        spread = table.pop(column)
        name = column[: -len("_seed_sd")]
        table[name] = [value if pd.isna(sd) else f"{value} ± {sd:.3f}" for value, sd in zip(table[name], spread)]
    return table.rename(columns=summary_headers() | {"n_seeds": "training seeds"})


def _layer_text(layer) -> str:
    if layer is None or pd.isna(layer):
        return "n/a"
    return "none" if layer == NOT_RECOVERED else str(int(layer))


def summary_markdown(result: "SweepResult", settings: "SweepSettings", command: str, versions: dict[str, str],
                     ablation_sequences: int | None = None) -> str:
    """The ``summary.md`` of a sweep (``ablation_sequences``: how many sequences its sink
    ablation probed, for the text of that section)."""
    table = summary_table(result.summary).to_markdown(index=False)
    settings_text = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items())
    return "\n".join([
        "# nopelens sweep",
        "",
        "First layer whose 95 % CI lower bound clears 0.9 (layer 0 = embeddings, layer l + 1 = output of "
        "block l; an attention read of block l is reported at layer l + 1). `none`: no layer cleared it; "
        "`n/a`: the model has no site for that read.",
        *([""] + [SEEDS_NOTE] if "n_seeds" in result.summary else []),
        "",
        table,
        "",
        "Relative distance i − j is read three ways. *Pairs*: a linear probe on [h_i; h_j] from the residual "
        "stream (it inherits any absolute index). *Head scores*: a linear probe on each head's pre-softmax "
        "score of key j, content and position bias together (`hook_attn_scores`, taken relative to the "
        "query's own key, since the softmax ignores a constant per query): what the head itself can use, "
        "on the same footing for NoPE, RoPE, ALiBi and Shaw. *Content q·k*: a bilinear probe on the "
        "(rotated) q_i and k_j only; it sees RoPE but never a bias added to the score, so ALiBi and Shaw "
        "show their position there only through what earlier layers wrote.",
        "",
        "Selectivity = probe score minus the Hewitt & Liang control-task score at the same layer. "
        "MAD/chance: mean absolute distance of the regression probe over its chance value (L² - 1)/(3L) "
        "(Haviv et al. 2022), at the embeddings and at the best layer. "
        "Sink rate: fraction of (layer, head) pairs whose mean attention on token 0 exceeds 0.3 "
        "(Gu et al. 2025); uniform attention gives 0.0741 per head. Variance slope: log-log slope of "
        "block 0's attention-output variance against position + 1 (-1 is the 1/(i+1) law).",
        "",
        "![probes](probes.png)",
        "",
        *(["![sinks](sinks.png)", ""] if not result.sinks.empty else []),
        "![variance](variance.png)",
        "",
        *_sink_ablation_section(result, ablation_sequences),
        f"Command: `{command}`",
        "",
        f"Settings: {settings_text}",
        "",
        f"Versions: {version_text}",
        "",
    ])


def write_run(result: "SweepResult", settings: "SweepSettings", command: str, versions: dict[str, str],
              svg: bool = False, ablation_sequences: int | None = None) -> None:
    """Write the tables, figures (PNG; also SVG if ``svg``) and ``summary.md`` of a sweep into
    ``result.out_dir``; with several training seeds also ``summary_per_seed.csv`` and
    ``probes_over_seeds.csv`` (:mod:`~nopelens.analyses.seeds`)."""
    out = result.out_dir
    for name in ("probes", "sinks", "variance", "summary"):
        write_csv_atomic(getattr(result, name), out / f"{name}.csv")
    if "n_seeds" in result.summary:
        write_csv_atomic(result.summary_per_seed, out / "summary_per_seed.csv")
        write_csv_atomic(seeds.probes_over_seeds(result.probes), out / "probes_over_seeds.csv")
    formats = ("png", "svg") if svg else ("png",)
    save_figure(probe_figure(result.probes), out / "probes", formats)
    if not result.sinks.empty:  # no sink read applies (every block a DSA past index_topk): no figure
        save_figure(sink_figure(result.sinks), out / "sinks", formats)
    if (result.variance.get("variance", pd.Series(dtype=float)) > 0).any():  # nothing varies: no figure
        save_figure(variance_figure(result.variance), out / "variance", formats)
    if not result.sink_ablation.empty:
        write_csv_atomic(result.sink_ablation, out / "sink_ablation.csv")
        save_figure(sink_ablation_figure(result.sink_ablation), out / "sink_ablation", formats)
    write_text_atomic(out / "summary.md", summary_markdown(result, settings, command, versions, ablation_sequences))


def _sink_ablation_section(result: "SweepResult", n_sequences: int | None) -> list[str]:
    """The summary's sink-ablation table (``nopelens intervene`` has the full measurement)."""
    if result.sink_ablation.empty:
        return []
    which = "all" if n_sequences is None else f"first {n_sequences}"
    return [
        "## Sink ablation",
        "",
        "Absolute-index R² (regression probe, tokens after the first, "
        f"{which} evaluation sequences) at layer l + 1, clean → with the first "
        "token removed from the keys of every later query in block l. `n/a`: the ablation cannot be applied "
        "and checked on that model (see sink_ablation.csv).",
        "",
        sink_ablation_markdown(seeds.sink_ablation_over_seeds(result.sink_ablation)),
        "",
        "![sink ablation](sink_ablation.png)",
        "",
    ]


# ----------------------------------------------------------------------------- nopelens intervene


def intervention_figure(tables: dict[str, pd.DataFrame], name: str):
    """Three panels: sink ablation (next-layer R^2 change per block), shift carried per read
    layer, and the share of the index that moves with a patched state per layer."""
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    summary = tables["summary"]
    if "abs_r2_delta" in summary:
        sns.barplot(data=summary, x="ablated_block", y="abs_r2_delta", hue="condition", ax=axes[0], errorbar=None)
    axes[0].set(title="sink ablated in block l:\nchange in abs. index R² at layer l + 1", xlabel="ablated block",
                ylabel="Δ R² (refitted probe)", ylim=(-1.05, 0.2))
    directions = tables["directions"]
    if "read_shift" in directions:
        shifted = directions[directions["intervention"] == "shift"]
        shifted = shifted.assign(carried=shifted["read_shift"] / shifted["k"], layer=shifted["layer"].astype(str))
        sns.lineplot(data=shifted, x="read_layer", y="carried", hue="layer", marker="o", ax=axes[1])
    axes[1].set(title="index direction shifted by k at layer l:\nshift a clean probe reads / k", xlabel="read layer",
                ylabel="read shift / k")
    patching = tables["patching"]
    if "moved" in patching:
        sns.pointplot(data=patching, x="layer", y="moved", ax=axes[2], errorbar=None)
    axes[2].set(title="state patched from a shifted copy:\nshare of the index that moves (last layer)",
                xlabel="patched layer (resid_pre)", ylabel="moved (0 = recomputed, 1 = carried)")
    fig.subplots_adjust(wspace=0.4)
    fig.suptitle(f"{name}: does the model make and use the position a probe reads?", y=1.06)
    return fig


def sink_ablation_figure(table: pd.DataFrame):
    """The sweep's figure: per model and block, the drop in next-layer absolute-index R^2."""
    sns.set_theme(style="whitegrid", context="notebook")
    measured = table[table["status"] == "measured"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    if not measured.empty:
        sns.barplot(data=measured, x="block", y="drop", hue="model", ax=ax, errorbar=None)
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1))
    low = min(-0.1, float(measured["drop"].min()) - 0.05) if not measured.empty else -0.1
    ax.set(xlabel="block l whose first key is removed", ylabel="R² drop at layer l + 1", ylim=(low, 1.05),
           title="Sink ablation: how much absolute index at the next layer\ncomes from the first token")
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
