"""Run folders: tidy CSVs, seaborn figures (PNG, and SVG on request) and a Markdown summary, all written atomically."""

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

if TYPE_CHECKING:
    from .sweep import SweepResult, SweepSettings

PROBE_PANELS = (
    ("absolute index: accuracy", "absolute_index", "classification", "accuracy", "resid"),
    ("absolute index: R²", "absolute_index", "regression", "r2", "resid"),
    ("relative distance, pairs [h_i; h_j]: R²", "relative_distance", "regression", "r2", "concat"),
    ("relative distance, head scores\n(content + position bias): R²", "relative_distance", "regression", "r2", "score"),
    ("relative distance, content-only q·k\n(no position bias): R²", "relative_distance", "regression", "r2", "bilinear"),
)

SEEDS_NOTE = (
    "Several training seeds: a first layer reads `agreed (per seed)`, where agreed is the first layer by "
    "which every seed recovers the target (`none` if some seed never does); a number reads `mean ± sd` "
    "over seeds. Per-seed rows: `summary_per_seed.csv`; each probe number's mean, across-seed spread "
    "and within-run 95 % CI: `probes_over_seeds.csv`."
)

SUMMARY_HEADERS = {
    "model": "model",
    "absolute_acc": "abs. index acc ≥ 0.9",
    "absolute_r2": "abs. index R² ≥ 0.9",
    "relative_pairs_r2": "rel. dist. pairs R² ≥ 0.9",
    "relative_score_r2": "rel. dist. head scores R² ≥ 0.9",
    "relative_content_qk_r2": "rel. dist. content q·k R² ≥ 0.9",
    "best_absolute_r2": "best abs. R²",
    "best_absolute_layer": "at layer",
    "selectivity_at_best": "selectivity (R²)",
    "mad_chance_layer0": "MAD/chance, layer 0",
    "mad_chance_best": "MAD/chance, best",
    "sink_rate": "sink rate",
    "variance_slope_block0": "variance slope, block 0",
}


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


def probe_panel_rows(probes: pd.DataFrame, target: str, task: str, metric: str, features: str) -> pd.DataFrame:
    """The linear-probe rows one panel of :func:`probe_figure` plots, one per model and layer."""
    rows = probes[(probes["probe"] == "linear") & (probes["split"] == "grouped") & (probes["target"] == target)
                  & (probes["task"] == task) & (probes["metric"] == metric) & probes["layer"].notna()]
    if features == "resid":
        rows = rows[rows["site"].str.contains("hook_resid_")]
    elif features == "bilinear":
        rows = rows[rows["features"].str.startswith("bilinear")]
    elif features == "score":
        rows = rows[rows["features"] == "score"]
    else:
        rows = rows[(rows["features"] == features) & rows["site"].str.contains("hook_resid_")]
    return rows.sort_values(["model", "layer"])


def probe_figure(probes: pd.DataFrame) -> plt.Figure:
    """Per-layer probe score, one line per model, one panel per target. The band is the 95 %
    bootstrap CI with one training seed, and the range over seeds (line: their mean) with several."""
    several_seeds = "train_seed" in probes.columns and probes.groupby("model")["train_seed"].nunique().max() > 1
    sns.set_theme(style="whitegrid", context="notebook")
    fig, axes = plt.subplots(1, len(PROBE_PANELS), figsize=(4.2 * len(PROBE_PANELS), 3.8), sharey=False)
    palette = dict(zip(probes["model"].unique(), sns.color_palette("colorblind", probes["model"].nunique())))
    for ax, (title, target, task, metric, features) in zip(axes, PROBE_PANELS):
        rows = probe_panel_rows(probes, target, task, metric, features)
        for model, group in rows.groupby("model", sort=False):
            if several_seeds:  # line: mean over seeds; band: their range
                over_seeds = group.groupby("layer")["value"].agg(["mean", "min", "max"]).reset_index()
                layer, value, low, high = (over_seeds[c] for c in ("layer", "mean", "min", "max"))
            else:  # line: the value; band: its 95 % CI
                layer, value, low, high = (group[c] for c in ("layer", "value", "ci_low", "ci_high"))
            ax.plot(layer, value, marker="o", color=palette[model], label=model)
            ax.fill_between(layer, low, high, color=palette[model], alpha=0.2)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        ax.set(title=title, xlabel="layer (0 = embeddings)", ylabel=metric, ylim=(-0.1 if metric == "r2" else 0, 1.05))
    axes[-1].legend(handles=[matplotlib.lines.Line2D([], [], color=color, marker="o", label=model)
                             for model, color in palette.items()],
                    title="model", loc="upper left", bbox_to_anchor=(1.02, 1))
    band = "range over training seeds" if several_seeds else "95 % CI"
    fig.suptitle(f"Where position becomes linearly recoverable (dashed: threshold 0.9; band: {band})", y=1.04)
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
    for column in FIRST_LAYER_COLUMNS:
        table[column] = table[column].map(_layer_text)
        if f"{column}_per_seed" in table:
            per_seed = table.pop(f"{column}_per_seed").str.replace("-1", "none")
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
    return table.rename(columns=SUMMARY_HEADERS | {"n_seeds": "training seeds"})


FIRST_LAYER_COLUMNS = ("absolute_acc", "absolute_r2", "relative_pairs_r2", "relative_score_r2", "relative_content_qk_r2")


def _layer_text(layer) -> str:
    if layer is None or pd.isna(layer):
        return "n/a"
    return "none" if layer < 0 else str(int(layer))


def summary_markdown(result: "SweepResult", settings: "SweepSettings", command: str, versions: dict[str, str]) -> str:
    """The ``summary.md`` of a sweep."""
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
        "![sinks](sinks.png)",
        "",
        "![variance](variance.png)",
        "",
        *_sink_ablation_section(result, settings),
        f"Command: `{command}`",
        "",
        f"Settings: {settings_text}",
        "",
        f"Versions: {version_text}",
        "",
    ])


def write_run(result: "SweepResult", settings: "SweepSettings", command: str, versions: dict[str, str],
              svg: bool = False) -> None:
    """Write the tables, figures (PNG; also SVG if ``svg``) and ``summary.md`` of a sweep into
    ``result.out_dir``; with several training seeds also ``summary_per_seed.csv`` and
    ``probes_over_seeds.csv`` (:mod:`~nopelens.analyses.seeds`)."""
    from .seeds import probes_over_seeds

    out = result.out_dir
    for name in ("probes", "sinks", "variance", "summary"):
        write_csv_atomic(getattr(result, name), out / f"{name}.csv")
    if "n_seeds" in result.summary:
        write_csv_atomic(result.summary_per_seed, out / "summary_per_seed.csv")
        write_csv_atomic(probes_over_seeds(result.probes), out / "probes_over_seeds.csv")
    formats = ("png", "svg") if svg else ("png",)
    save_figure(probe_figure(result.probes), out / "probes", formats)
    save_figure(sink_figure(result.sinks), out / "sinks", formats)
    if (result.variance.get("variance", pd.Series(dtype=float)) > 0).any():  # nothing varies: no figure
        save_figure(variance_figure(result.variance), out / "variance", formats)
    if not result.sink_ablation.empty:
        from .intervene_cmd import sink_ablation_figure

        write_csv_atomic(result.sink_ablation, out / "sink_ablation.csv")
        save_figure(sink_ablation_figure(result.sink_ablation), out / "sink_ablation", formats)
    write_text_atomic(out / "summary.md", summary_markdown(result, settings, command, versions))


def _sink_ablation_section(result: "SweepResult", settings: "SweepSettings") -> list[str]:
    """The summary's sink-ablation table (``nopelens intervene`` has the full measurement)."""
    if result.sink_ablation.empty:
        return []
    from .intervene_cmd import sink_ablation_markdown
    from .seeds import sink_ablation_over_seeds

    return [
        "## Sink ablation",
        "",
        "Absolute-index R² (regression probe, tokens after the first, all "
        f"{settings.n_sequences} evaluation sequences) at layer l + 1, clean → with the first "
        "token removed from the keys of every later query in block l: with the same settings, the same numbers "
        "as the `remove_key` rows of `nopelens intervene MODEL`. `n/a`: the ablation cannot be applied "
        "and checked on that model (see sink_ablation.csv).",
        "",
        sink_ablation_markdown(sink_ablation_over_seeds(result.sink_ablation)),
        "",
        "![sink ablation](sink_ablation.png)",
        "",
    ]
