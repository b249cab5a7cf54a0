"""Rendering of the sweep's results: readable summary and per-layer tables (on a screen and in
Markdown) and a run folder's ``summary.md`` and figures (:func:`write_run`, which the CLI calls
after :func:`~nopelens.analyses.sweep.driver.sweep`); every file is written atomically. The figures
themselves are drawn in :mod:`nopelens.analyses.figures`.

The sweep's columns, headers and probe panels come from its reads
(:data:`~nopelens.analyses.sweep.reads.SWEEP_READS`); this module formats what the analyses measured,
and no analysis imports it (the analyses return tables; the CLI renders them).
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Mapping, Sequence

import pandas as pd

from nopelens.models.compat import moved_names
from nopelens.models.io import write_text_atomic

from .figures import (
    probe_figure,
    save_figure,
    sink_ablation_figure,
    sink_figure,
    site_figure,
    site_rows,
    variance_figure,
)
from .layer_tables import (  # noqa: F401  (the per-layer tables' names, re-exported)
    LAYER_HEADLINE,
    LAYER_NOTE,
    SCREEN_WIDTH,
    SEEDS_LAYER_NOTE,
    _markdown,
    _text,
    fit_width,
    layer_table,
    layer_tables_markdown,
    layer_tables_text,
    low_selectivity_lines,
)
from .sweep import layers, reads, seeds
from .sweep.reads import NO_LAYER_CLEARS, SweepRead

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
    :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`), then the numbers."""
    chosen = reads.SWEEP_READS if sweep_reads is None else sweep_reads
    return {"model": "model", **{read.column: read.header for read in chosen}, **NUMBER_HEADERS}


def summary_text(
    summary: pd.DataFrame,
    sweep_reads: Sequence[SweepRead] | None = None,
    width: int = SCREEN_WIDTH,
    not_applicable: Mapping[str, Mapping[str, str]] | None = None,
) -> str:
    """The summary table (:func:`summary_table`) as plain text in column groups of at most ``width``,
    then the reads each model left out and why (``not_applicable``, :func:`not_applicable_reads`)."""
    tables = fit_width(summary_table(summary, sweep_reads, not_applicable), _text, width)
    return "\n\n".join(tables + [not_applicable_text(not_applicable, width=width)] if not_applicable else tables)


NOT_READ = "n/a (see below)"
"""A summary number whose read the model made impossible (the reason is listed under the summary)."""


def not_applicable_reads(subjects: Mapping[str, dict]) -> dict[str, dict[str, str]]:
    """Model -> {read: why it was not applicable} from each measured subject's info
    (:attr:`SweepResult.subjects <nopelens.analyses.sweep.driver.SweepResult>`, as ``done.json`` holds it),
    merged over training seeds; models that left nothing out are absent."""
    reasons: dict[str, dict[str, str]] = {}
    for label, info in subjects.items():
        if info.get("not_applicable"):
            reasons.setdefault(info.get("name", label), {}).update(info["not_applicable"])
    return reasons


def not_applicable_text(
    not_applicable: Mapping[str, Mapping[str, str]], bullet: str = "", width: int | None = None
) -> str:
    """``not_applicable`` (:func:`not_applicable_reads`) as lines ``model, read: why``, each wrapped at
    ``width`` characters when given (on screen; Markdown keeps one line per read)."""
    lines = [
        f"{bullet}{model}, {read}: {why}"
        for model, notes in not_applicable.items()
        for read, why in sorted(notes.items())
    ]
    if width is not None:
        lines = [textwrap.fill(line, width, subsequent_indent="  ") for line in lines]
    return "\n".join(["Not applicable:"] + lines)


def summary_table(
    summary: pd.DataFrame,
    sweep_reads: Sequence[SweepRead] | None = None,
    not_applicable: Mapping[str, Mapping[str, str]] | None = None,
) -> pd.DataFrame:
    """The summary with readable headers, "none" for targets no layer recovered, "n/a" for reads the
    model has no site for (no ``hook_attn_scores``) and for selectivity where the control task is
    undefined, rounded numbers; ``sweep_reads`` are the reads whose first layers it holds (default
    :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`). A sink rate or variance slope whose read a model
    left out (``not_applicable``: model -> {read: why}, :func:`not_applicable_reads`; e.g. every
    block a DSA past ``index_topk``) reads :data:`NOT_READ`; a variance slope otherwise missing is
    an output that never varies.

    With several training seeds (columns from :func:`~nopelens.analyses.sweep.seeds.over_seeds`) a
    first layer reads ``2 (1/1/2)``: the layer all seeds agree on, then each seed's; a number
    reads ``0.953 ± 0.012``: mean ± standard deviation across seeds.
    """
    table = summary.copy()
    for column in reads.read_columns(sweep_reads):
        table[column] = table[column].map(_layer_text)
        if f"{column}_per_seed" in table:
            per_seed = table.pop(f"{column}_per_seed").str.replace(str(NO_LAYER_CLEARS), "none")
            table[column] = [
                f"{agreed} ({seeds})" if n_seeds > 1 else agreed
                for agreed, seeds, n_seeds in zip(table[column], per_seed, table["n_seeds"])
            ]
    table = table.round(3)
    skipped = not_applicable or {}

    def missing(model, read: str, otherwise: str) -> str:
        return NOT_READ if read in skipped.get(model, {}) else otherwise

    table["variance_slope_block0"] = [
        missing(model, "variance read", "n/a (variance 0)") if pd.isna(v) else f"{v:.3f}"
        for model, v in zip(table["model"], table["variance_slope_block0"])
    ]
    if "sink_rate" in table:
        table["sink_rate"] = [
            missing(model, "sink read", "n/a") if pd.isna(v) else v
            for model, v in zip(table["model"], table["sink_rate"])
        ]
    # NaN selectivity: the control task is undefined (every sampled token has one id)
    if "selectivity_at_best" in table:
        table["selectivity_at_best"] = table["selectivity_at_best"].map(
            lambda v: "n/a (one token id)" if pd.isna(v) else v
        )
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
        rule = (
            "whose 95 % CI clears the bar in its column's header (≥: the lower bound reaches it; ≤: the upper "
            "bound stays at or below it)"
        )
    return (
        f"First layer {rule} (layer 0 = embeddings, layer l + 1 = output of block l; an attention read of "
        "block l is reported at layer l + 1). `none`: no layer cleared it; `n/a`: the model has no site for "
        "that read, or its metric is undefined there (Spearman's ρ of predictions that are all equal). "
        "The numbers behind each first layer are in the per-layer tables above."
    )


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

FIGURE_TITLES = {
    "probes": "per-layer probe curves",
    "sites": "absolute index inside each block",
    "sinks": "attention-sink scores",
    "variance": "attention-output variance",
    "sink_ablation": "sink ablation",
}

_STYLE_KEY = (
    "Colour: the model's position method, the same in every figure of every run; line: solid for a "
    "trained model, dashed for the circuit (positive control), dotted for the untrained model and "
    "dash-dot for constant input (negative controls)."
)

FIGURE_CAPTIONS = {
    "probes": "A point is one model's score of one read at one layer (layer 0 = the embeddings, layer l + 1 = the "
    "output of block l), from the linear probe on held-out sequences; band: 95 % bootstrap CI over "
    "sequences (several training seeds: their range); grey line: the read's threshold. " + _STYLE_KEY,
    "sites": "A point is the absolute-index R² of the linear probe at one site of one model: the residual stream at "
    "layer l (0 = embeddings), and block l's attention output, the residual after its attention and its "
    "MLP output between layer l and l + 1; band and bars: 95 % CI over sequences. Panel titles are in the "
    "colour of the model's position method.",
    "sinks": "A cell is one head (block l, head h) of one model: its sink score, the mean attention on the first "
    "token; outlined: a sink. Panel titles are in the colour of the model's position method.",
    "variance": "A point is the variance across sequences of block l's attention output at one position of one "
    "model; dashed: slope −1, the 1/(i + 1) law of uniform causal attention. Panel titles are in the "
    "colour of the model's position method.",
    "sink_ablation": "A pair of bars is the absolute-index R² at layer l + 1 (the output of block l), clean and with "
    "the first token removed from block l's keys, with 95 % CIs. Panel titles are in the colour "
    "of the model's position method.",
}
"""What a point is in each figure of a sweep's run folder: the caption under it in ``summary.md``."""


def caption(stem: str) -> str:
    """The Markdown caption of figure ``stem``: :data:`FIGURE_CAPTIONS` in italics, in lines of at most 100 columns."""
    return textwrap.fill(f"*{FIGURE_CAPTIONS[stem]}*", 100)


def summary_markdown(
    result, settings, command: str, versions: dict[str, str], figures: Sequence[str] = (), name: str = "sweep"
) -> str:
    """The ``summary.md`` of a sweep or ``nopelens probe`` (``name``): the per-layer tables (with a
    line under a model's table for each read whose selectivity is low) and their figure first,
    then the first layer at a bar and the summary's numbers, the other figures in ``figures`` (the
    stems written; only those are linked), the sink ablation, command, settings and versions.

    ``result`` and ``settings`` are the sweep's :class:`~nopelens.analyses.sweep.driver.SweepResult` and
    :class:`~nopelens.analyses.sweep.settings.SweepSettings` (duck-typed: this module imports no analysis)."""
    sweep_reads = result.reads
    skipped = not_applicable_reads(result.subjects)
    tables = fit_width(summary_table(result.summary, sweep_reads, skipped), _markdown)
    if skipped:
        tables.append(not_applicable_text(skipped, bullet="- "))
    settings_text = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items())
    pictures = [
        f"![{FIGURE_TITLES.get(stem.split('-')[0], stem)}]({stem}.png)\n\n{caption(stem.split('-')[0])}"
        for stem in figures
        if stem != "sink_ablation"
    ]
    # the curves' figure (probes.png, or probes-<variant>.png) right after their tables
    curves_first = pictures[:1] if figures and figures[0].startswith("probes") else []
    low = layers.low_selectivity(result.probes, sweep_reads)
    return "\n".join(
        [
            f"# nopelens {name}",
            "",
            *(layer_tables_markdown(result.curves, sweep_reads, low) if result.curves is not None else []),
            *[line for picture in curves_first for line in (picture, "")],
            "## First layer at a bar",
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
            *[line for picture in pictures[len(curves_first) :] for line in (picture, "")],
            *_sink_ablation_section(result, "sink_ablation" in figures),
            *measured_markdown(result.subjects),
            f"Command: `{command}`",
            "",
            f"Settings: {settings_text} (seq_len is the length asked for; each model's own is in the table above)",
            "",
            f"Versions: {version_text}",
            "",
        ]
    )


SWEEP_FIGURES = ("probes", "sites", "sinks", "variance", "sink_ablation")
"""The stems of every figure :func:`write_run` may draw."""


def write_run(
    result, settings, command: str, versions: dict[str, str], svg: bool = False, name: str = "sweep", draw: bool = True
) -> list[str]:
    """Draw a sweep's figures (PNG; also SVG if ``svg``; none unless ``draw``) and write its
    ``summary.md`` into ``result.out_dir``, whose tables :func:`~nopelens.analyses.sweep.driver.sweep`
    wrote. ``result`` and ``settings``: as :func:`summary_markdown`. Reads other than the default
    (``result.variant``, ``--metric``/``--threshold``) get ``summary-<variant>.md`` and
    ``probes-<variant>.png`` beside the original's, which are left as they are (the other
    figures do not depend on the reads: the summary links those the folder holds).

    A figure this run does not draw (``--no-figures``, no SVG asked, nothing to show) is removed if
    an earlier run in the folder left one, so the folder describes this run only.

    Returns:
        The stems of the figures written (a figure with nothing to show is not written: no
        ``variance`` when no attention output varies, no ``sites`` without finer sites).
    """
    out = result.out_dir
    formats = ("png", "svg") if svg else ("png",)
    variant = getattr(result, "variant", "")
    if variant:  # other reads: their curves' figure and summary beside the original's, which stay as they are
        stem, others = f"probes-{variant}", [stem for stem in SWEEP_FIGURES[1:] if (out / f"{stem}.png").is_file()]
        for ext in ("png", "svg"):
            (out / f"{stem}.{ext}").unlink(missing_ok=True)
        if draw:
            save_figure(probe_figure(result.curves, result.reads, result.subjects), out / stem, formats)
        drawn = [stem] if draw else []
        write_text_atomic(
            out / f"summary-{variant}.md", summary_markdown(result, settings, command, versions, drawn + others, name)
        )
        return drawn
    figures = {"probes": lambda: probe_figure(result.curves, result.reads, result.subjects)}
    if not site_rows(result.probes).query("kind != 'residual'").empty:
        figures["sites"] = lambda: site_figure(result.probes, result.subjects)
    if not result.sinks.empty:  # no sink read applies (every block a DSA past index_topk): no figure
        figures["sinks"] = lambda: sink_figure(result.sinks, subjects=result.subjects)
    if (result.variance.get("variance", pd.Series(dtype=float)) > 0).any():  # nothing varies: no figure
        figures["variance"] = lambda: variance_figure(result.variance, result.subjects)
    if not result.sink_ablation.empty and (result.sink_ablation["status"] == "measured").any():
        figures["sink_ablation"] = lambda: sink_ablation_figure(result.sink_ablation, result.subjects)
    if not draw:
        figures = {}
    for stem, figure in figures.items():
        save_figure(figure(), out / stem, formats)
    for stem in SWEEP_FIGURES:  # an earlier run's figures would show what this run did not draw
        for ext in ("png", "svg"):
            if stem not in figures or ext not in formats:
                (out / f"{stem}.{ext}").unlink(missing_ok=True)
    write_text_atomic(out / "summary.md", summary_markdown(result, settings, command, versions, list(figures), name))
    return list(figures)


NOT_RECORDED = "not recorded"
"""What a part measured before nopelens recorded the sequences it read shows in their place."""


def measured_table(subjects: Mapping[str, dict]) -> pd.DataFrame:
    """What each (model, training seed) was read on, from its ``done.json`` (``read``): the
    evaluation sequences, the tokens per sequence (BOS included; ``min–max`` where sequences of
    mixed lengths are padded, as a synthetic task's are) and whether they start with BOS."""

    def tokens(read: dict) -> str:
        low, high = read["tokens"]
        return str(low) if low == high else f"{low}–{high}"

    rows = [
        {
            "model": label,
            "sequences": info["read"]["sequences"] if "read" in info else NOT_RECORDED,
            "tokens per sequence": tokens(info["read"]) if "read" in info else NOT_RECORDED,
            "BOS": "yes" if info.get("has_bos") else "no",
        }
        for label, info in subjects.items()
    ]
    return pd.DataFrame(rows, columns=["model", "sequences", "tokens per sequence", "BOS"])


def measured_markdown(subjects: Mapping[str, dict]) -> list[str]:
    """The "What was measured" section of ``summary.md`` (:func:`measured_table`)."""
    if not subjects:
        return []
    return [
        "## What was measured",
        "",
        "The evaluation sequences each model was read on, as read (synthetic-task models are read at their "
        "longest training length, whatever --seq-len says).",
        "",
        measured_table(subjects).to_markdown(index=False),
        "",
    ]


def _sink_ablation_section(result, figure: bool = True) -> list[str]:
    """The summary's sink-ablation table (``nopelens intervene`` has the full measurement)."""
    if result.sink_ablation.empty:
        return []
    return [
        "## Sink ablation",
        "",
        "Absolute-index R² (regression probe, tokens after the first, "
        "all evaluation sequences) at layer l + 1, clean → with the first "
        "token removed from the keys of every later query in block l: on the same sequences and settings, the "
        "numbers of the `remove_key` rows of `nopelens intervene MODEL`. `n/a`: the ablation cannot be applied "
        "and checked on that model (see sink_ablation.csv).",
        "",
        sink_ablation_markdown(seeds.sink_ablation_over_seeds(result.sink_ablation)),
        "",
        *(["![sink ablation](sink_ablation.png)", "", caption("sink_ablation"), ""] if figure else []),
    ]


def sink_ablation_markdown(table: pd.DataFrame) -> str:
    """The sweep's compact table: one row per model, one column per block (R² clean → ablated)."""

    def cell(row) -> str:
        if row["status"] != "measured":
            return "n/a"
        return f"{row['r2_clean']:.2f} → {row['r2_ablated']:.2f}"

    grid = table.assign(cell=table.apply(cell, axis=1)).pivot(index="model", columns="block", values="cell")
    grid.columns = [f"block {int(b)}" for b in grid.columns]
    return grid.reset_index().fillna("").to_markdown(index=False)


__getattr__ = moved_names(
    __name__,
    moved={
        **dict.fromkeys(
            (
                "REPRODUCIBLE",
                "NO_STAMPS",
                "LAYER_AXIS",
                "TOL_BRIGHT",
                "SITE_KIND_NAMES",
                "CONDITION_COLORS",
                "CONDITION_NAMES",
            ),
            "nopelens.analyses.figures",
        ),
        "intervention_figure": "nopelens.analyses.command_figures",
        **dict.fromkeys(("Style", "model_styles", "MARKERS"), "nopelens.analyses.palette"),
    },
    gone={"TOL_MUTED": "nopelens.analyses.palette.METHOD_COLORS (a fixed colour per position method)"},
)
