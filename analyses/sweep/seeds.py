"""Numbers over training seeds: the mean, the across-seed spread, and the layer all seeds agree on.

A sweep with several training seeds measures each zoo model once per seed. Each seed's numbers
come with a within-run 95 % bootstrap CI (over evaluation sequences); the spread across seeds says
how much a number depends on the training run itself. Both are reported side by side: a claim
that holds for one seed but not another did not survive.
"""

from __future__ import annotations

import pandas as pd

from . import reads

PROBE_NUMBERS = ("value", "ci_low", "ci_high", "selectivity", "chance", "n_samples", "n_sequences", "train_seed")
"""Probe-table columns that are measured; every other column names the number (model, site, ...)."""


def with_train_seed(table: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """``table`` with a ``train_seed`` column (``seed`` where it had none, as in runs made before
    training seeds existed)."""
    return table if "train_seed" in table.columns else table.assign(train_seed=seed)


def agreed_layer(layers: pd.Series) -> int:
    """The first layer by which every seed has recovered a target: the latest of the per-seed
    first layers, :data:`~nopelens.analyses.sweep.reads.NO_LAYER_CLEARS` (-1) if some seed never recovers
    it, NaN if the model has no site for it.

    >>> agreed_layer(pd.Series([1, 1, 2]))
    2
    >>> agreed_layer(pd.Series([1, -1, 1]))
    -1
    """
    if layers.isna().any():
        return float("nan")
    return reads.NO_LAYER_CLEARS if (layers == reads.NO_LAYER_CLEARS).any() else int(layers.max())


def over_seeds(per_seed: pd.DataFrame, sweep_reads=None) -> pd.DataFrame:
    """One summary row per model from per-seed summary rows.

    Args:
        per_seed: rows of :func:`~nopelens.analyses.sweep.summary.summarize_per_seed` (``model``,
            ``train_seed``, the first-layer columns of ``sweep_reads`` (default
            :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`), numbers).
        sweep_reads: the reads whose columns hold first layers.

    Returns:
        Per model: ``n_seeds``; each first-layer column as the layer all seeds agree on
        (:func:`agreed_layer`) plus ``<column>_per_seed`` (e.g. ``"1/1/2"``, in seed order); each
        other number as the mean over seeds plus ``<column>_seed_sd`` (sample standard deviation
        across seeds; NaN for a model measured once; ``best_absolute_layer`` is a mean too).
    """
    first_layers = [column for column in reads.read_columns(sweep_reads) if column in per_seed.columns]
    numbers = [c for c in per_seed.columns if c not in ("model", "train_seed", *first_layers)]
    rows = []
    for model, group in per_seed.groupby("model", sort=False):
        group = group.sort_values("train_seed")
        row = {"model": model, "n_seeds": len(group)}
        for column in first_layers:
            row[column] = agreed_layer(group[column])
            row[f"{column}_per_seed"] = "/".join("n/a" if pd.isna(v) else str(int(v)) for v in group[column])
        for column in numbers:
            row[column] = float(group[column].mean())
            row[f"{column}_seed_sd"] = float(group[column].std()) if len(group) > 1 else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def probes_over_seeds(probes: pd.DataFrame) -> pd.DataFrame:
    """Each probe number as its mean over training seeds, next to the across-seed spread and the
    mean within-run bootstrap CI.

    Returns:
        One row per probe number (the columns not in :data:`PROBE_NUMBERS` name it): ``value``
        (mean over seeds), ``seed_sd``, ``seed_min``, ``seed_max``, ``ci_low`` and ``ci_high``
        (means of the per-seed 95 % bootstrap bounds), ``selectivity`` (mean), ``n_seeds``.
    """
    probes = with_train_seed(probes)
    keys = [c for c in probes.columns if c not in PROBE_NUMBERS]
    grouped = probes.groupby(keys, sort=False, dropna=False)
    table = grouped.agg(
        value=("value", "mean"),
        seed_sd=("value", "std"),
        seed_min=("value", "min"),
        seed_max=("value", "max"),
        ci_low=("ci_low", "mean"),
        ci_high=("ci_high", "mean"),
        selectivity=("selectivity", "mean"),
        n_seeds=("train_seed", "nunique"),
    )
    return table.reset_index()


def sink_ablation_over_seeds(table: pd.DataFrame) -> pd.DataFrame:
    """The sweep's sink-ablation rows averaged over training seeds, one per (model, block):
    ``r2_clean``, ``r2_ablated`` and ``drop`` are means, ``status`` is ``measured`` only where
    every seed was measured. A table of one seed per model is returned as it is."""
    if "train_seed" not in table or table.groupby("model")["train_seed"].nunique().max() <= 1:
        return table
    keys = ["model", "block"]
    grouped = table.groupby(keys, sort=False)
    status = grouped["status"].agg(lambda s: "measured" if (s == "measured").all() else s[s != "measured"].iloc[0])
    return grouped[["r2_clean", "r2_ablated", "drop"]].mean().join(status).reset_index()
