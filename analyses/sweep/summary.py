"""The sweep's summary: one row per model (per training seed, then over seeds) with the first layer
each read clears and the key numbers (:func:`summarize`).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from nopelens.probes.sinks import sink_flags

from . import layers, reads, seeds


def summarize(
    probes: pd.DataFrame,
    sinks: pd.DataFrame,
    variance: pd.DataFrame,
    sweep_reads: Sequence[reads.SweepRead] | None = None,
) -> pd.DataFrame:
    """One row per model; with several training seeds, the mean over seeds (see
    :func:`summarize_per_seed` for the columns and :func:`~nopelens.analyses.sweep.seeds.over_seeds`)."""
    per_seed = summarize_per_seed(probes, sinks, variance, sweep_reads)
    if per_seed.groupby("model")["train_seed"].nunique().max() > 1:
        return seeds.over_seeds(per_seed, sweep_reads)
    return per_seed.drop(columns="train_seed")


def summarize_per_seed(
    probes: pd.DataFrame,
    sinks: pd.DataFrame,
    variance: pd.DataFrame,
    sweep_reads: Sequence[reads.SweepRead] | None = None,
) -> pd.DataFrame:
    """:func:`summarize_seed` for each training seed, with a ``train_seed`` column (0 for tables
    that have none), rows in model order."""
    probes, sinks, variance = (seeds.with_train_seed(table) for table in (probes, sinks, variance))
    frames = [
        summarize_seed(
            table, sinks[sinks["train_seed"] == seed], variance[variance["train_seed"] == seed], sweep_reads
        ).assign(train_seed=seed)
        for seed, table in probes.groupby("train_seed")
    ]
    order = {model: i for i, model in enumerate(probes["model"].unique())}
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values(
        ["model", "train_seed"], key=lambda c: c.map(order) if c.name == "model" else c, kind="stable"
    ).reset_index(drop=True)


def summarize_seed(
    probes: pd.DataFrame,
    sinks: pd.DataFrame,
    variance: pd.DataFrame,
    sweep_reads: Sequence[reads.SweepRead] | None = None,
) -> pd.DataFrame:
    """One row per model of one training seed: the first layer at which each target is recovered,
    and key numbers.

    Columns: ``model``; one column per read of :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`
    (``absolute_acc``, ``absolute_r2``, ``relative_pairs_r2``, ``relative_score_r2``,
    ``relative_content_qk_r2``), the first layer that clears its bar
    (:meth:`~nopelens.analyses.sweep.reads.SweepRead.first_layer`: -1 when no layer does, None when the
    model has no site for the read, e.g. no ``hook_attn_scores``); then
    ``best_absolute_r2`` and its ``selectivity``,
    ``mad_chance_layer0`` and ``mad_chance_best`` (regression MAD over its chance value E|X - Y|
    for X, Y drawn from the scored positions, at the embeddings and at the best residual layer;
    Haviv et al. 2022; NaN at layer 0 when ``--layers`` left block 0 out),
    ``sink_rate`` (Gu et al., as read), ``variance_slope_block0``. ``sweep_reads`` replaces the
    reads (``--metric``, ``--threshold``; default :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`).
    """
    chosen = reads.SWEEP_READS if sweep_reads is None else sweep_reads
    rows = []
    for model, table in probes.groupby("model", sort=False):
        linear = table[(table["probe"] == "linear") & (table["split"] == "grouped") & table["layer"].notna()]
        residual = linear[linear["site"].str.contains("hook_resid_")]
        absolute = residual[residual["target"] == "absolute_index"]
        best = absolute[(absolute["metric"] == "r2")].sort_values("value").iloc[-1]
        mad = absolute[(absolute["metric"] == "mad") & (absolute["task"] == "regression")].set_index("layer")
        chance = layers.chance_of_mad(mad)
        model_sinks = sinks[sinks["model"] == model]
        as_read = (
            model_sinks[model_sinks["condition"] == model_sinks["condition"].iloc[0]]
            if len(model_sinks)
            else model_sinks
        )  # no sink read (every block DSA past index_topk): sink_rate NaN
        rows.append(
            dict(
                model=model,
                **{read.column: read.first_layer(table) for read in chosen},
                best_absolute_r2=float(best["value"]),
                best_absolute_layer=int(best["layer"]),
                selectivity_at_best=float(best["selectivity"]),
                mad_chance_layer0=float(mad.loc[0, "value"] / chance.loc[0]) if 0 in mad.index else float("nan"),
                mad_chance_best=float((mad["value"] / chance).min()),
                sink_rate=float(sink_flags(as_read).mean()) if "is_sink" in as_read else float("nan"),
                variance_slope_block0=_first_block_slope(variance[variance["model"] == model]),
            )
        )
    return pd.DataFrame(rows)


def _first_block_slope(variance: pd.DataFrame) -> float:
    """The variance slope of the first block that has one (block 0, or a hybrid's first attention
    block); NaN when no block has an attention output."""
    if variance.empty:
        return float("nan")
    return float(variance[variance["block"] == variance["block"].min()]["slope"].iloc[0])
