"""Reading a table of probe results: the first layer whose CI clears a bar.

:func:`first_recoverable_layer` is the sweep's headline read ("the first layer where X is
recoverable"), :func:`clears_bar` its rule per row, and :func:`is_target` the rows of one target,
its position-bin form included. They read the tidy tables of
:func:`~nopelens.probes.stream_probes.probe_absolute_index` and
:func:`~nopelens.probes.stream_probes.probe_relative_distance` (:data:`~nopelens.probes.linear.RESULT_COLUMNS`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .metrics import HIGHER_IS_BETTER


def is_target(targets: pd.Series, target: str) -> pd.Series:
    """Rows of ``target``, its position-bin form included (``absolute_index//16`` is a read of
    ``absolute_index``: classification over bins of 16 positions when there are too many to class).

    Example:
        >>> is_target(pd.Series(["absolute_index", "absolute_index//16", "relative_distance"]),
        ...           "absolute_index").tolist()
        [True, True, False]
    """
    return (targets == target) | targets.astype(str).str.startswith(f"{target}//")


def first_recoverable_layer(
    results: pd.DataFrame,
    target: str = "absolute_index",
    metric: str | None = None,
    threshold: float = 0.9,
    task: str | None = None,
    features: str | None = None,
) -> int | None:
    """The first layer whose CI lower bound clears ``threshold`` for ``target`` and ``metric``.

    Only ``linear`` probes on the grouped split at rows with a ``layer`` count: residual sites,
    and the attention reads of :func:`probe_relative_distance` (block ``l`` at layer ``l + 1``).
    "Clears" means ``ci_low >= threshold`` for higher-is-better metrics and ``ci_high <= threshold``
    for ``mad``. Defaults: R^2 >= 0.9 for regression, accuracy >= 0.9 for classification.

    Args:
        results: from :func:`probe_absolute_index` or :func:`probe_relative_distance`.
        target: ``absolute_index`` or ``relative_distance``.
        metric: e.g. ``r2``, ``accuracy``, ``spearman``, ``mad``; default ``r2`` for regression
            and ``accuracy`` for classification.
        threshold: the bar.
        task: ``regression`` or ``classification``; default: regression unless ``metric`` only
            exists for classification. Needed for ``mad``, which both tasks report.
        features: feature kind (``token``, ``concat``, ``score``, ``bilinear_outer``, ...) when
            the table has several.

    Returns:
        The DESIGN.md layer number, or None when no layer clears the bar (a summary table writes
        that as -1: :data:`nopelens.analyses.sweep.reads.NO_LAYER_CLEARS`).

    Raises:
        ValueError: if ``threshold`` is not finite, no row matches, or several tasks or feature
            kinds match.
    """
    if not np.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    if metric is None:
        task = task or "regression"
        metric = {"regression": "r2", "classification": "accuracy"}[task]
    if metric not in HIGHER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; known: {sorted(HIGHER_IS_BETTER)}")
    rows = results[
        (results["probe"] == "linear")
        & (results["split"] == "grouped")
        & is_target(results["target"], target)
        & (results["metric"] == metric)
        & results["layer"].notna()
    ]
    if task is not None:
        rows = rows[rows["task"] == task]
    if features is not None:
        rows = rows[rows["features"] == features]
    if rows.empty:
        raise ValueError(f"no linear probe rows for target {target!r}, metric {metric!r} at a layer")
    for column, argument in (("task", "task"), ("features", "features")):
        kinds = rows[column].unique()
        if len(kinds) > 1:
            raise ValueError(f"several {column} values {sorted(kinds)} match {target!r}/{metric!r}; pass {argument}=")
    layers = rows.loc[clears_bar(rows, metric, threshold), "layer"]
    return int(layers.min()) if len(layers) else None


def clears_bar(rows: pd.DataFrame, metric: str, threshold: float) -> pd.Series:
    """Whether each result row clears ``threshold``: ``ci_low >= threshold`` for higher-is-better
    metrics, ``ci_high <= threshold`` for ``mad`` (the rule of :func:`first_recoverable_layer`)."""
    if HIGHER_IS_BETTER[metric]:
        return rows["ci_low"] >= threshold
    return rows["ci_high"] <= threshold
