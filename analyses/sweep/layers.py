"""The sweep's main curves: each read's number at every layer, with its 95 % CI.

A sweep's summary gives one number per read and model, the first layer that clears the bar; the
curves are the numbers behind it, layer by layer. :func:`layer_curves` takes them out of the long
probe table (``probes.csv``: every site, target, task, feature kind, probe, split and metric) so
nobody has to decode it: one row per model, training seed, layer and curve (``layers.csv``).

The curves (:func:`curves_of`, in this order):

- one per read of :data:`~nopelens.analyses.sweep.reads.SWEEP_READS` (or the reads ``--metric`` and
  ``--threshold`` chose): the linear probe on the grouped split (GroupKFold over sequences; not
  the extrapolation split), its metric, at every layer it has (residual layers 0 .. n_layers;
  attention reads of block l at layer l + 1);
- ``mad_chance``, after the absolute-index reads: the absolute-index regression probe's MAD over
  its chance value E|X - Y| (Haviv et al. 2022), CI bounds divided by the same chance;
- ``sink_rate``: the fraction of block l's heads that are sinks (Gu et al. 2025, score > 0.3), at
  layer l + 1, as the model was read (with BOS where it has one); no CI.

:func:`load_run` reads a run folder back, curves included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from nopelens.probes import mad_chance
from nopelens.probes.sinks import sink_flags

from . import reads as reads_module
from .reads import METRIC_AXES, SweepRead

__all__ = [
    "Curve",
    "LAYER_COLUMNS",
    "LOW_SELECTIVITY",
    "MAD_CHANCE",
    "SINK_RATE",
    "Run",
    "curves_of",
    "layer_curves",
    "load_run",
    "low_selectivity",
    "mad_over_chance",
]

MAD_CHANCE = "mad_chance"
SINK_RATE = "sink_rate"

LAYER_COLUMNS = (
    "model",
    "train_seed",
    "layer",
    "curve",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "threshold",
    "clears",
    "n_heads",
)
"""Columns of :func:`layer_curves` (``layers.csv``; each is described in docs/schema.md)."""

MAD_READ = SweepRead("mad", "abs. index", "absolute index", "absolute_index", "regression", "mad", "token")
"""The probe rows behind ``mad_chance``: the absolute-index regression probe's MAD."""


@dataclass(frozen=True)
class Curve:
    """One curve of the per-layer tables and of ``probes.png``.

    Attributes:
        key: its ``curve`` value in ``layers.csv`` (a read's summary column, ``mad_chance`` or
            ``sink_rate``).
        label: its column in the printed per-layer tables.
        title: its panel title in ``probes.png`` (None: not drawn there).
        axis: the panel's y label, with units.
        read: the read it shows, if it is one (None for ``mad_chance`` and ``sink_rate``).
    """

    key: str
    label: str
    title: str | None
    axis: str
    read: SweepRead | None = None

    @property
    def threshold(self) -> float | None:
        return None if self.read is None else self.read.threshold


def curves_of(sweep_reads: Sequence[SweepRead] | None = None) -> list[Curve]:
    """The curves of ``sweep_reads`` (default :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`):
    one per read, ``mad_chance`` after the last absolute-index read, ``sink_rate`` last."""
    chosen = reads_module.SWEEP_READS if sweep_reads is None else tuple(sweep_reads)
    curves = [
        Curve(read.column, read.label, read.title, METRIC_AXES.get(read.metric, read.metric), read) for read in chosen
    ]
    absolute = [i for i, read in enumerate(chosen) if read.target == "absolute_index"]
    mad = Curve(MAD_CHANCE, "MAD/chance", "absolute index: MAD / chance", "MAD / chance")
    curves.insert(absolute[-1] + 1 if absolute else len(curves), mad)
    curves.append(Curve(SINK_RATE, "sink heads", None, "fraction of the block's heads that are sinks"))
    return curves


def layer_curves(
    probes: pd.DataFrame, sinks: pd.DataFrame | None = None, sweep_reads: Sequence[SweepRead] | None = None
) -> pd.DataFrame:
    """Every curve of :func:`curves_of` at every layer of every model and training seed.

    Args:
        probes: a sweep's probe table (``probes.csv``).
        sinks: its sink table (``sinks.csv``); None leaves out ``sink_rate``.
        sweep_reads: the reads (default :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`).

    Returns:
        Tidy :data:`LAYER_COLUMNS` rows in model order, then curve order, then layer: ``value``
        with ``ci_low``/``ci_high`` (the 95 % bootstrap CI over sequences), ``threshold`` and
        ``clears`` (whether the CI clears the read's bar; empty for ``mad_chance`` and
        ``sink_rate``), ``n_heads`` (heads of the block, ``sink_rate`` only).
    """
    probes = _with_seed(probes)
    frames = []
    for curve in curves_of(sweep_reads):
        if curve.read is not None:
            rows = curve.read.rows(probes)
            frames.append(
                _rows(rows, curve.key, curve.read.metric).assign(
                    threshold=curve.read.threshold, clears=curve.read.clears(rows).to_numpy()
                )
            )
        elif curve.key == MAD_CHANCE:
            frames.append(mad_over_chance(probes))
        elif sinks is not None and not sinks.empty and "is_sink" in sinks:
            frames.append(_sink_rates(_with_seed(sinks)))
    table = pd.concat([frame for frame in frames if not frame.empty], ignore_index=True)
    table = table.reindex(columns=list(LAYER_COLUMNS))
    order = {model: i for i, model in enumerate(probes["model"].unique())}
    curve_order = {curve.key: i for i, curve in enumerate(curves_of(sweep_reads))}
    table = table.sort_values(
        ["model", "train_seed", "curve", "layer"],
        kind="stable",
        key=lambda c: c.map(order) if c.name == "model" else c.map(curve_order) if c.name == "curve" else c,
    )
    table["layer"] = table["layer"].astype(int)
    table["train_seed"] = table["train_seed"].astype(int)
    table["n_heads"] = table["n_heads"].astype("Int64")
    table["clears"] = table["clears"].astype("boolean")
    return table.reset_index(drop=True)


def _with_seed(table: pd.DataFrame) -> pd.DataFrame:
    return table if "train_seed" in table.columns else table.assign(train_seed=0)


def _rows(rows: pd.DataFrame, key: str, metric: str) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "model": rows["model"].to_numpy(),
            "train_seed": rows["train_seed"].to_numpy(),
            "layer": rows["layer"].astype(int).to_numpy(),
            "curve": key,
            "metric": metric,
            "value": rows["value"].to_numpy(),
            "ci_low": rows["ci_low"].to_numpy(),
            "ci_high": rows["ci_high"].to_numpy(),
        }
    )


def mad_over_chance(probes: pd.DataFrame) -> pd.DataFrame:
    """The ``mad_chance`` curve: absolute-index regression MAD / chance at every residual layer."""
    rows = MAD_READ.rows(_with_seed(probes))
    chance = chance_of_mad(rows)
    table = _rows(rows, MAD_CHANCE, "mad")
    for column in ("value", "ci_low", "ci_high"):
        table[column] = table[column] / chance.to_numpy()
    return table


def chance_of_mad(mad: pd.DataFrame) -> pd.Series:
    """Each MAD row's chance value: E|X - Y| over its scored positions (``chance`` column), or, for
    tables written before that column existed, the uniform value at the mean sequence length."""
    if "chance" in mad and mad["chance"].notna().all():
        return mad["chance"]
    if mad.empty:
        return pd.Series(dtype=float)
    return pd.Series(mad_chance(int(round(mad["n_samples"].iloc[0] / mad["n_sequences"].iloc[0]))), index=mad.index)


def _sink_rates(sinks: pd.DataFrame) -> pd.DataFrame:
    """Per model, seed and block, as read (the model's first condition): the share of sink heads."""
    frames = []
    for (model, seed), table in sinks.groupby(["model", "train_seed"], sort=False):
        as_read = table[table["condition"] == table["condition"].iloc[0]]
        per_block = (
            as_read.assign(is_sink=sink_flags(as_read)).groupby("block")["is_sink"].agg(["mean", "size"]).reset_index()
        )
        frames.append(
            pd.DataFrame(
                {
                    "model": model,
                    "train_seed": seed,
                    "layer": per_block["block"] + 1,
                    "curve": SINK_RATE,
                    "metric": "sink_rate",
                    "value": per_block["mean"],
                    "ci_low": np.nan,
                    "ci_high": np.nan,
                    "n_heads": per_block["size"],
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


LOW_SELECTIVITY = 0.5
"""A read's selectivity is low where the Hewitt & Liang (2019) control task scores more than this
share of the probe's own score (selectivity < ``LOW_SELECTIVITY`` x value): most of what the probe
reads, a probe of the same size also fits to labels that follow token identity only."""


def low_selectivity(probes: pd.DataFrame, sweep_reads: Sequence[SweepRead] | None = None) -> pd.DataFrame:
    """The reads whose selectivity is low (:data:`LOW_SELECTIVITY`) at their best layer.

    Args:
        probes: a sweep's probe table (``probes.csv``; its ``selectivity`` column).
        sweep_reads: the reads (default :data:`~nopelens.analyses.sweep.reads.SWEEP_READS`); only those
            whose higher values are better and whose rows carry a selectivity are judged.

    Returns:
        One row per model and flagged read: ``model``, ``curve`` (the read's column), ``label``,
        ``layer`` (where the value, the mean over training seeds, is highest), ``value`` and
        ``selectivity`` there (means over seeds); empty when none is low. A value under half the
        read's bar (little recovered to mislead anyone) or an undefined selectivity (one token id:
        no control task) is not judged.
    """
    probes = _with_seed(probes)
    chosen = reads_module.SWEEP_READS if sweep_reads is None else tuple(sweep_reads)
    flagged = []
    for read in (read for read in chosen if read.higher_is_better):
        rows = read.rows(probes)
        for model, per_model in rows.groupby("model", sort=False):
            by_layer = per_model.groupby("layer")[["value", "selectivity"]].mean()
            if by_layer["value"].isna().all():
                continue
            layer = by_layer["value"].idxmax()
            value, selectivity = by_layer.loc[layer]
            if value >= read.threshold / 2 and selectivity == selectivity and selectivity < LOW_SELECTIVITY * value:
                flagged.append(
                    dict(
                        model=model,
                        curve=read.column,
                        label=read.label,
                        layer=int(layer),
                        value=float(value),
                        selectivity=float(selectivity),
                    )
                )
    return pd.DataFrame(flagged, columns=["model", "curve", "label", "layer", "value", "selectivity"])


# ----------------------------------------------------------------------------- reading a run folder


RUN_TABLES = (
    "probes",
    "sinks",
    "variance",
    "sink_ablation",
    "summary",
    "summary_per_seed",
    "probes_over_seeds",
    "layers",
)
"""The tables a sweep (or ``nopelens probe``) run folder may hold, as ``<name>.csv``."""


@dataclass
class Run:
    """A sweep's run folder, read back (:func:`load_run`).

    Attributes:
        folder: the run folder.
        curves: the main curves (:func:`layer_curves`; ``layers.csv``), one row per model,
            training seed, layer and curve.
        tables: every table the folder holds, by name (``probes``, ``sinks``, ``variance``,
            ``sink_ablation``, ``summary``, ...); docs/schema.md describes each column.
    """

    folder: Path
    curves: pd.DataFrame
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def summary(self) -> pd.DataFrame:
        return self.tables["summary"]

    def curve(self, curve: str, model: str | None = None) -> pd.DataFrame:
        """One curve as a wide table: a row per layer, ``value``/``ci_low``/``ci_high`` (one model),
        or a column of values per model (``model=None``).

        Raises:
            KeyError: if the run has no such curve or model (the message lists what it has).
        """
        rows = self.curves[self.curves["curve"] == curve]
        if rows.empty:
            raise KeyError(f"no curve {curve!r} in {self.folder}; curves: {', '.join(self.curves['curve'].unique())}")
        if model is None:
            return rows.pivot_table(index="layer", columns="model", values="value", sort=False)
        picked = rows[rows["model"] == model]
        if picked.empty:
            raise KeyError(f"no model {model!r} in {self.folder}; models: {', '.join(rows['model'].unique())}")
        return picked.set_index("layer")[["value", "ci_low", "ci_high", "train_seed"]]


def load_run(folder: str | Path) -> Run:
    """Read a sweep's (or ``nopelens probe``'s) run folder: its tables and its main curves.

    The curves come from ``layers.csv`` when the folder has it, else they are computed from
    ``probes.csv`` and ``sinks.csv`` with the default reads (a folder made before ``layers.csv``).

    Example::

        run = load_run("runs/sweep")
        run.curve("absolute_r2", "text-rope-4l").loc[3]   # value, ci_low, ci_high at layer 3
        run.curve("absolute_r2")                          # layer x model

    Raises:
        FileNotFoundError: if ``folder`` holds no ``probes.csv`` (not a sweep run folder).
    """
    folder = Path(folder)
    if not (folder / "probes.csv").is_file():
        raise FileNotFoundError(f"{folder} holds no probes.csv: not a run folder of nopelens sweep or probe")
    tables = {name: pd.read_csv(folder / f"{name}.csv") for name in RUN_TABLES if (folder / f"{name}.csv").is_file()}
    curves = tables.get("layers")
    if curves is None:
        curves = layer_curves(tables["probes"], tables.get("sinks"))
    else:  # the dtypes layer_curves gives (CSV reads a column with empty cells as floats or objects)
        curves = curves.astype({"clears": "boolean", "n_heads": "Int64"})
        tables["layers"] = curves
    return Run(folder, curves, tables)
