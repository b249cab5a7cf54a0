"""The per-layer curves as tables, on a screen and in Markdown: one model's table (:func:`layer_table`),
every model's with their notes (:func:`layer_tables_text`, :func:`layer_tables_markdown`), and
:func:`fit_width`, which splits any table into column groups that fit a screen. Rendering: only the
CLI and :mod:`nopelens.analyses.report` import it.
"""

from __future__ import annotations

import textwrap
from typing import Sequence

import numpy as np
import pandas as pd

from .sweep import layers
from .sweep.reads import SweepRead

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
    (:func:`~nopelens.analyses.sweep.layers.curves_of`), each cell ``value [95 % CI]``, ``*`` where the
    CI clears the read's bar, ``n/a`` where the model has no such site; sink heads as ``k/n``.
    With several training seeds a cell holds the means over seeds (value and CI bounds), ``*``
    where every seed clears the bar, and the sink column the mean fraction of sink heads."""
    rows = curves[curves["model"] == model]
    several = rows["train_seed"].nunique() > 1
    table = pd.DataFrame({"layer": sorted(rows["layer"].unique())})
    for curve in layers.curves_of(sweep_reads):
        picked = rows[rows["curve"] == curve.key]
        by_layer = picked.groupby("layer").agg(
            value=("value", "mean"),
            ci_low=("ci_low", "mean"),
            ci_high=("ci_high", "mean"),
            n_heads=("n_heads", "first"),
            clears=("clears", lambda c: bool(c.notna().all() and c.all()) if c.notna().any() else None),
        )
        if curve.key == layers.SINK_RATE:
            cells = {
                layer: (
                    "n/a"
                    if row.value != row.value
                    else f"{row.value:.2f}"
                    if several
                    else f"{round(row.value * row.n_heads)}/{row.n_heads}"
                )  # n/a: no head got a verdict
                for layer, row in by_layer.iterrows()
            }
            missing = np.where(table["layer"] == 0, "", "n/a")  # layer 0: the embeddings, no block
            table[curve.label] = table["layer"].map(cells).fillna(pd.Series(missing, index=table.index))
        else:
            cells = {
                layer: _with_ci(row.value, row.ci_low, row.ci_high, row.clears) for layer, row in by_layer.iterrows()
            }
            table[curve.label] = table["layer"].map(cells).fillna("n/a")
    return table


LAYER_NOTE = (
    "value [95 % CI over sequences] per layer (0 = embeddings, l + 1 = output of block l; an attention "
    "read of block l sits at layer l + 1); * = the CI clears the read's bar; n/a = no such site (or a "
    "block --layers left out: listed under Not applicable), or a metric undefined there (Spearman's ρ of "
    "predictions that are all equal); "
    "MAD/chance: 0 = exact, about 0.75 = predicting the mean; sink heads: heads of block l with Gu et "
    "al.'s score > 0.3, at layer l + 1 (n/a: no verdict where uniform attention alone scores > 0.3 over the "
    "queries scored, under a short window or on short sequences: gu_chance in sinks.csv; or no sink read "
    "at that block: listed under Not applicable)."
)
SEEDS_LAYER_NOTE = (
    " Several training seeds: each cell is the mean over seeds of the value and of its CI bounds; "
    "* = every seed clears the bar; sink heads: the mean fraction."
)


LAYER_HEADLINE = "Per layer: value [95 % CI over sequences], * = the CI clears the read's bar (notes below)"


def low_selectivity_lines(low: pd.DataFrame | None, model: str) -> list[str]:
    """One short line per read of ``model`` whose selectivity is low
    (:func:`~nopelens.analyses.sweep.layers.low_selectivity`): its best value, the layer, the
    selectivity and what the Hewitt & Liang control task scores there."""
    if low is None or low.empty:
        return []
    return [
        f"{row.label} {_number(row.value)} (layer {row.layer}): low selectivity {_number(row.selectivity)}, "
        f"the control task scores {_number(row.value - row.selectivity)}"
        for row in low[low["model"] == model].itertuples()
    ]


def layer_tables_text(
    curves: pd.DataFrame,
    sweep_reads: Sequence[SweepRead] | None = None,
    width: int = SCREEN_WIDTH,
    low: pd.DataFrame | None = None,
) -> str:
    """Every model's :func:`layer_table` as plain text, each part at most ``width`` characters: a
    headline, each model's table and its :func:`low_selectivity_lines` (``low``), then the notes."""
    several = curves.groupby("model")["train_seed"].nunique().max() > 1
    parts = [LAYER_HEADLINE]
    for model in curves["model"].unique():
        parts.append(f"\n{model}")
        parts.extend(fit_width(layer_table(curves, model, sweep_reads), _text, width))
        parts.extend(textwrap.fill(line, width, subsequent_indent="  ") for line in low_selectivity_lines(low, model))
    parts.append("\n" + textwrap.fill(LAYER_NOTE + (SEEDS_LAYER_NOTE if several else ""), width))
    return "\n".join(parts)


def layer_tables_markdown(
    curves: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None, low: pd.DataFrame | None = None
) -> list[str]:
    """The "Per layer" section of ``summary.md``: :func:`layer_table` of every model, each with its
    :func:`low_selectivity_lines` (``low``)."""
    several = curves.groupby("model")["train_seed"].nunique().max() > 1
    lines = ["## Per layer", "", LAYER_NOTE + (SEEDS_LAYER_NOTE if several else ""), ""]
    for model in curves["model"].unique():
        lines += [f"### {model}", ""]
        for part in fit_width(layer_table(curves, model, sweep_reads), _markdown):
            lines += [part, ""]
        lines += [line for text in low_selectivity_lines(low, model) for line in (text, "")]
    return lines
