"""What the sweep reads: one :class:`SweepRead` per reported question, and the target functions
that measure them.

A *read* asks "from which layer on can a linear probe recover this target?" It names the probe
rows it looks at (``target``, ``task``, ``features``, ``metric``), the bar their 95 % CI must
clear (``threshold``), and how it is reported: its ``summary.csv`` column (the first layer that
clears the bar, :func:`~nopelens.probes.linear.first_recoverable_layer`), that column's header in
``summary.md``, and its panel of ``probes.png``. The summary (:func:`~nopelens.analyses.sweep.summary.summarize`),
the figure (:func:`~nopelens.analyses.figures.probe_figure`) and the tables over training seeds
(:func:`~nopelens.analyses.sweep.seeds.over_seeds`) all take their reads from :data:`SWEEP_READS`, in
its order, at call time.

A *target function* (:data:`TARGETS`) is a target's one definition: from one subject's token set,
sites and probe settings (:class:`ProbeInput`) it builds the measurement of its probe rows
(:class:`~nopelens.probes.stream_probes.Probes`: tidy rows, :data:`~nopelens.probes.linear.RESULT_COLUMNS`,
whose ``target`` column is its key). The sweep
(:func:`~nopelens.analyses.sweep.streamed.measurements`) feeds it a hooked forward pass;
:func:`measure_in_memory` feeds it activations already collected; the answers are the same.
The sweep runs the target functions its reads name, in order of first use.

Adding a sweep read is one :class:`SweepRead` appended to :data:`SWEEP_READS`, plus its target
function in :data:`TARGETS` when it reads a target the sweep does not measure yet (a read of an
existing target, such as absolute index Spearman, needs no new function). Nothing else changes:
the summary gains the column, the figure the panel, ``--seeds`` runs the agreed layer
(``tests/test_layout.py`` adds one and checks).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd

from nopelens.probes import Activations, first_recoverable_layer, site_block
from nopelens.probes.linear import clears_bar, is_target
from nopelens.probes.metrics import HIGHER_IS_BETTER, metric_names
from nopelens.probes.stream import KeepBudget, Measurement, Sequences, replay
from nopelens.probes.stream_probes import (
    MAX_POSITION_CLASSES,
    Probes,
    absolute_index_probes,
    relative_distance_probes,
    replay_probes,
)

__all__ = ["NO_LAYER_CLEARS", "ProbeInput", "SweepRead", "SweepSites", "SWEEP_READS", "TARGETS", "read_columns"]

MAX_OUTER_FEATURES = 1024
"""Use the full outer-product bilinear read while n_heads * d_head^2 stays below this; above it,
the elementwise (diagonal) read keeps the fits inside the sweep's time budget."""


METRIC_NAMES = {
    "r2": "R²",
    "accuracy": "acc",
    "balanced_accuracy": "balanced acc",
    "within_one": "acc ±1",
    "spearman": "Spearman ρ",
    "mad": "MAD",
}
"""Short names of the probe metrics, as summary headers and per-layer tables print them."""

METRIC_AXES = {
    "r2": "R²",
    "accuracy": "accuracy",
    "balanced_accuracy": "balanced accuracy",
    "within_one": "accuracy within ±1 position",
    "spearman": "Spearman ρ",
    "mad": "MAD (positions)",
}
"""Axis labels of the probe metrics in figures (with their units)."""

NO_LAYER_CLEARS = -1
"""What a summary table's first-layer column holds when no layer clears the bar (docs/schema.md;
shown ``none`` on screen). The Python API's :func:`~nopelens.probes.linear.first_recoverable_layer`
returns None instead, which no list index mistakes for a layer."""

BOUNDED_METRICS = ("r2", "accuracy", "balanced_accuracy", "within_one", "spearman")
"""Metrics that cannot exceed 1, so a bar above 1 is one no layer can clear."""

METRIC_FLOORS = {"accuracy": 0.0, "balanced_accuracy": 0.0, "within_one": 0.0, "spearman": -1.0}
"""The lowest value of the metrics bounded below: a bar at or below it is one every layer clears."""


@dataclass(frozen=True)
class SweepRead:
    """One question the sweep answers per model: the first layer at which a probe clears a bar.

    Attributes:
        column: its ``summary.csv`` column, holding the first layer that clears the bar
            (:data:`NO_LAYER_CLEARS`, -1, when none does; empty when the
            model has no probe rows for the read, e.g. no ``hook_attn_scores``).
        name: what is read, short (``abs. index``, ``rel. dist. pairs``): with the metric it
            makes the per-layer table's column (:attr:`label`) and the summary header (:attr:`header`).
        panel: what is read, for the title of its panel in ``probes.png`` (the metric is added).
        target: the probe target (the ``target`` column of ``probes.csv``), a key of :data:`TARGETS`.
        task: ``classification`` or ``regression``.
        metric: the probe metric (``accuracy``, ``r2``, ``spearman``, ``mad``, ...).
        features: the ``features`` column of the rows read: a feature kind (``token``, ``concat``,
            ``score``), or a prefix ending in ``*`` (``bilinear_*`` matches ``bilinear_outer``
            and ``bilinear_elementwise``).
        threshold: the bar: the CI lower bound must reach it (for ``mad``, lower is better: the
            upper bound must stay at or below it).
        split: the probe split (``grouped``: GroupKFold over sequences).
        short: a shorter ``name`` for the per-layer tables' columns (default: ``name``).
    """

    column: str
    name: str
    panel: str
    target: str
    task: str
    metric: str
    features: str
    threshold: float = 0.9
    split: str = "grouped"
    short: str = ""

    @property
    def higher_is_better(self) -> bool:
        return HIGHER_IS_BETTER[self.metric]

    @property
    def label(self) -> str:
        """The read (short) and its metric (``pairs R²``): its column in the per-layer tables."""
        return f"{self.short or self.name} {METRIC_NAMES.get(self.metric, self.metric)}"

    @property
    def header(self) -> str:
        """The summary header: the read, its metric and its bar (``abs. index R² ≥ 0.9``)."""
        sign = "≥" if self.higher_is_better else "≤"
        return f"{self.name} {METRIC_NAMES.get(self.metric, self.metric)} {sign} {self.threshold:g}"

    @property
    def title(self) -> str:
        """The title of its ``probes.png`` panel: what is read, then the metric."""
        return f"{self.panel}: {METRIC_NAMES.get(self.metric, self.metric).replace('acc', 'accuracy', 1)}"

    def rows(self, probes: pd.DataFrame) -> pd.DataFrame:
        """The linear-probe rows of ``probes`` this read looks at, one per model, seed and layer.

        Only rows with a DESIGN.md ``layer`` count: residual sites, and attention reads (block
        ``l`` at layer ``l + 1``).
        """
        features = probes["features"]
        if self.features.endswith("*"):
            matches = features.str.startswith(self.features[:-1])
        else:
            matches = features == self.features
        return probes[
            (probes["probe"] == "linear")
            & (probes["split"] == self.split)
            & is_target(probes["target"], self.target)
            & (probes["task"] == self.task)
            & (probes["metric"] == self.metric)
            & matches
            & probes["layer"].notna()
        ]

    def clears(self, rows: pd.DataFrame) -> pd.Series:
        """Whether each of its probe rows clears the bar (:func:`~nopelens.probes.linear.clears_bar`)."""
        return clears_bar(rows, self.metric, self.threshold)

    def first_layer(self, probes: pd.DataFrame) -> int | None:
        """The first layer at which this read clears its bar in ``probes`` (one model, one seed).

        Returns:
            The layer, as a summary table holds it: :data:`NO_LAYER_CLEARS` (-1) when no layer
            clears it; None when ``probes`` has no row for this read (the model has no site for it).
        """
        rows = self.rows(probes)
        if rows.empty:
            return None
        layer = first_recoverable_layer(rows, self.target, self.metric, self.threshold, self.task)
        return NO_LAYER_CLEARS if layer is None else layer


SWEEP_READS: tuple[SweepRead, ...] = (
    SweepRead("absolute_acc", "abs. index", "absolute index", "absolute_index", "classification", "accuracy", "token"),
    SweepRead("absolute_r2", "abs. index", "absolute index", "absolute_index", "regression", "r2", "token"),
    SweepRead(
        "relative_pairs_r2",
        "rel. dist. pairs",
        "relative distance, pairs [h_i; h_j]",
        "relative_distance",
        "regression",
        "r2",
        "concat",
        short="pairs",
    ),
    SweepRead(
        "relative_score_r2",
        "rel. dist. head scores",
        "relative distance, head scores\n(content + position bias)",
        "relative_distance",
        "regression",
        "r2",
        "score",
        short="head scores",
    ),
    SweepRead(
        "relative_content_qk_r2",
        "rel. dist. content q·k",
        "relative distance, content-only q·k\n(no position bias)",
        "relative_distance",
        "regression",
        "r2",
        "bilinear_*",
        short="content q·k",
    ),
)
"""The sweep's reads, in summary-column and figure-panel order."""


def read_columns(sweep_reads: Sequence[SweepRead] | None = None) -> tuple[str, ...]:
    """The summary columns of ``sweep_reads`` (default :data:`SWEEP_READS`; each holds a first layer)."""
    return tuple(read.column for read in (SWEEP_READS if sweep_reads is None else sweep_reads))


def choose_reads(
    metric: str | None = None, threshold: float | str | None = None, sweep_reads: Sequence[SweepRead] | None = None
) -> tuple[SweepRead, ...]:
    """The sweep's reads with another metric or bar (``nopelens sweep --metric --threshold``).

    Args:
        metric: ``METRIC`` or a comma list of ``TASK=METRIC``. A bare metric replaces the metric
            of every read whose task reports it (``spearman``: the regression reads;
            ``within_one``: the classification read; ``mad``, which both report: the regression
            reads; ``classification=mad`` names the other). A replaced read gets the column
            ``<prefix>_<metric>`` (``absolute_spearman``), so a summary never holds a Spearman
            layer under an R² name.
        threshold: a bar for every read, or a comma list ``BAR`` / ``METRIC=BAR`` (``0.8,mad=2``:
            MAD reads at 2 positions, the others at 0.8); default: each read's own, 0.9.
        sweep_reads: the reads to change (default :data:`SWEEP_READS`).

    Returns:
        The reads, in order.

    Raises:
        ValueError: on a metric no task reports, a task that is not ``classification`` or
            ``regression``, a task or bar given twice, a ``METRIC=BAR`` for a metric no read uses,
            a MAD read without a MAD bar (MAD is in positions, not a fraction), a bar that is not a
            finite number, above 1 for a metric that cannot exceed 1, at or below the lowest value
            of its metric (:data:`METRIC_FLOORS`), or not positive for MAD.

    Example:
        >>> [read.column for read in choose_reads("spearman")][:2]
        ['absolute_acc', 'absolute_spearman']
        >>> choose_reads(threshold=0.8)[1].header
        'abs. index R² ≥ 0.8'
        >>> choose_reads("mad", "mad=2")[1].header
        'abs. index MAD ≤ 2'
    """
    chosen = list(SWEEP_READS if sweep_reads is None else sweep_reads)
    if metric is not None:
        by_task = _metric_by_task(metric)
        taken = {read.column for read in chosen if read.task not in by_task}
        renamed = []
        for read in chosen:
            new = by_task.get(read.task)
            if new is None or new == read.metric:
                renamed.append(read)
                continue
            prefix = read.column.rsplit("_", 1)[0]
            column = f"{prefix}_{new}" if f"{prefix}_{new}" not in taken else f"{prefix}_{read.task}_{new}"
            taken.add(column)
            renamed.append(dataclasses.replace(read, metric=new, column=column))
        chosen = renamed
    default, by_metric = _bars(threshold)
    unused = sorted(set(by_metric) - {read.metric for read in chosen})
    if unused:
        raise ValueError(
            f"--threshold {unused[0]}={by_metric[unused[0]]:g}: no read uses {unused[0]} "
            f"(they use {', '.join(sorted({read.metric for read in chosen}))}; choose it with --metric)"
        )
    if any(read.metric == "mad" for read in chosen) and "mad" not in by_metric and default is None:
        raise ValueError("a MAD read needs its bar in positions: add --threshold mad=2 (within 2 positions on average)")
    result = []
    for read in chosen:
        bar = by_metric.get(read.metric, default)
        if bar is None:
            result.append(read)
            continue
        if read.metric in BOUNDED_METRICS and bar > 1:
            raise ValueError(
                f"--threshold {bar:g}: {read.metric} cannot exceed 1, so no layer could clear it "
                "(give a MAD bar alone as mad=BAR)"
            )
        if read.metric in METRIC_FLOORS and bar <= METRIC_FLOORS[read.metric]:
            raise ValueError(
                f"--threshold {bar:g}: {read.metric} is never below {METRIC_FLOORS[read.metric]:g}, so "
                "every layer would clear it"
            )
        if read.metric == "mad" and bar <= 0:
            raise ValueError(f"--threshold {bar:g}: a MAD bar must be positive (positions)")
        result.append(dataclasses.replace(read, threshold=float(bar)))
    return tuple(result)


def _bars(threshold: float | str | None) -> tuple[float | None, dict[str, float]]:
    """``"0.8,mad=2"`` -> (0.8, {mad: 2}); a number -> (it, {})."""
    if threshold is None:
        return None, {}
    default, by_metric = None, {}
    for part in str(threshold).split(",") if isinstance(threshold, str) else [threshold]:
        name, _, text = str(part).strip().rpartition("=")
        try:
            bar = float(text)
        except ValueError:
            raise ValueError(f"--threshold takes BAR or METRIC=BAR (e.g. 0.8 or mad=2), got {part!r}") from None
        if not math.isfinite(bar):
            raise ValueError(f"--threshold must be a finite number, got {part!r}")
        if name and name not in HIGHER_IS_BETTER:
            raise ValueError(f"--threshold {part!r}: unknown metric {name!r} (known: {', '.join(HIGHER_IS_BETTER)})")
        if (name in by_metric) if name else (default is not None):
            raise ValueError(f"--threshold {threshold!r} gives {'the bar of ' + name if name else 'a bare bar'} twice")
        if name:
            by_metric[name] = bar
        else:
            default = bar
    return default, by_metric


def _metric_by_task(text: str) -> dict[str, str]:
    """``"spearman"`` -> {regression: spearman}; ``"classification=mad,regression=r2"`` -> both."""
    by_task: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        task, _, metric = part.rpartition("=")
        tasks = [task.strip()] if task else [t for t in ("regression", "classification") if part in metric_names(t)][:1]
        if task and task.strip() not in ("regression", "classification"):
            raise ValueError(f"--metric {text!r}: the task before '=' is regression or classification, got {task!r}")
        metric = metric.strip()
        if not tasks or metric not in metric_names(tasks[0]):
            known = ", ".join(sorted(set(metric_names("regression")) | set(metric_names("classification"))))
            raise ValueError(f"--metric {text!r}: unknown metric {metric!r} (known: {known})")
        if tasks[0] in by_task:
            raise ValueError(f"--metric {text!r} names the {tasks[0]} metric twice")
        by_task[tasks[0]] = metric
    if not by_task:
        raise ValueError("--metric names no metric")
    return by_task


# ----------------------------------------------------------------------------- target functions


@dataclass(frozen=True)
class SweepSites:
    """The hook sites the sweep collects of one subject.

    Attributes:
        residual: the residual stream at every layer 0 .. n_layers (``resid_sites``).
        inner: each block's ``hook_attn_out`` and ``hook_mlp_out`` where they fire.
        qk: per block, the (query, key) sites of the content q.k read (rotated where the model
            rotates and the hooks fire).
        scores: the ``hook_attn_scores`` sites that hold the scores behind the pattern and whose
            block sees every causal pair (:func:`readable_score_sites`; may be empty).
        patterns: every block's ``hook_pattern`` that fires.
        outputs: every block's ``hook_attn_out`` where it fires, for the variance measurement
            (collected whether or not ``inner`` probes it).
    """

    residual: list[str]
    inner: list[str]
    qk: list[tuple[str, str]]
    scores: list[str]
    patterns: list[str]
    outputs: list[str] = dataclasses.field(default_factory=list)

    def all(self) -> list[str]:
        """Every site, in collection order, each once."""
        sites = self.residual + self.inner + [s for pair in self.qk for s in pair] + self.patterns + self.scores
        return list(dict.fromkeys(sites + self.outputs))


@dataclass(frozen=True)
class ProbeInput:
    """What a target function gets: one subject's token set, its sites and the sweep's probe settings.

    Attributes:
        sequences: the evaluation batch (:class:`~nopelens.probes.stream.Sequences`).
        sites: the sites.
        seq_len: tokens per evaluation sequence (the batch's width, padding included).
        n_sequences: evaluation sequences.
        n_splits, n_boot, seed: GroupKFold folds, bootstrap replicates and seed of every probe.
        bilinear: the content q.k read's features (:func:`bilinear_mode_of`).
        keep: the keep budget the measurements share (None: every batch kept, one pass).
        max_classes: absolute-index classes before position bins (None: every position its class).
        distances: the distances pairs are drawn at (``"spread"``, or None: every distance).
    """

    sequences: Sequences
    sites: SweepSites
    seq_len: int
    n_sequences: int
    n_splits: int
    n_boot: int
    seed: int
    bilinear: str = "outer"
    keep: KeepBudget | None = None
    max_classes: int | None = MAX_POSITION_CLASSES
    distances: str | None = "spread"

    @property
    def common(self) -> dict:
        """The keyword arguments every probe measurement shares."""
        return dict(n_splits=self.n_splits, n_boot=self.n_boot, seed=self.seed, keep=self.keep)


def absolute_index(inp: ProbeInput) -> Probes:
    """Absolute index at every residual layer and block output, as classes and as a value, with
    controls, plus an extrapolation probe (fit on positions < L/2, score on >= L/2; half the batch
    width, since synthetic tasks take their lengths from training, not from ``seq_len``)."""
    return absolute_index_probes(
        inp.sequences,
        inp.sites.residual + inp.sites.inner,
        extrapolate_from=inp.seq_len // 2,
        max_classes=inp.max_classes,
        **inp.common,
    )


def relative_distance(inp: ProbeInput) -> Probes | None:
    """Relative distance i - j over distance-balanced pairs: pair features [h_i; h_j] at residual
    layers, the score read of each block's ``hook_attn_scores`` and the content-only q.k read
    (None: the subject has none of these sites)."""
    sites = inp.sites
    if not (sites.residual or sites.qk or sites.scores):
        return None
    return relative_distance_probes(
        inp.sequences,
        sites=sites.residual,
        feature_kinds=("concat",),
        attention=sites.qk,
        scores=sites.scores,
        bilinear=inp.bilinear,
        tasks=("regression",),
        pairs_per_distance=min(64, inp.n_sequences),
        distances=inp.distances,
        **inp.common,
    )


def readable_score_sites(sites: list[str], windows: dict, length: int) -> tuple[list[str], str | None]:
    """The score sites whose block sees every pair j <= i of sequences of ``length`` tokens.

    A sliding window or chunk shorter than the sequences blocks the pairs further apart (their
    score is -inf: the head gives them no weight and there is no score to read), so that block's
    score read is not applicable; every other read of the block still runs.

    Args:
        sites: ``blocks.{l}.attn.hook_attn_scores`` sites.
        windows: block -> its :class:`~nopelens.models.masks.KeyWindow` (blocks without one are causal).
        length: tokens in the longest evaluation sequence.

    Returns:
        ``(kept, reason)``: the readable sites, and why the others are not (None when none is left out).
    """
    kept, skipped = [], []
    for site in sites:
        keys = windows.get(site_block(site))
        (skipped if keys is not None and keys.bites(length) else kept).append(site)
    if not skipped:
        return kept, None
    blocks = [site_block(site) for site in skipped]
    reasons = sorted({windows[b].describe() for b in blocks})
    return kept, (
        f"blocks {blocks}: {', '.join(reasons)} shorter than the {length}-token sequences blocks the pairs "
        "further apart, whose scores are -inf (no score to read)"
    )


def bilinear_mode(acts: Activations, q_site: str) -> str:
    """:func:`bilinear_mode_of` the collected ``q_site``."""
    return bilinear_mode_of(acts.acts[q_site].shape[1:])


def bilinear_mode_of(q_shape: Sequence[int]) -> str:
    """``outer`` while n_heads * d_head^2 <= :data:`MAX_OUTER_FEATURES`, else ``elementwise``
    (``q_shape``: a query site's per-token ``[head_index, d_head]``)."""
    n_heads, d_head = q_shape[-2:]
    return "outer" if n_heads * d_head * d_head <= MAX_OUTER_FEATURES else "elementwise"


TARGETS: dict[str, Callable[[ProbeInput], Measurement | None]] = {
    "absolute_index": absolute_index,
    "relative_distance": relative_distance,
}
"""Target name -> its one definition: the measurement of its probe rows (tidy rows with that
``target``), fed streamed by :func:`~nopelens.probes.stream.run` or in memory by
:func:`measure_in_memory`; None when the subject has no site for it."""


def measure_targets(inp: ProbeInput) -> list[Measurement]:
    """The measurements of every target :data:`SWEEP_READS` names, in order of first use.

    Raises:
        KeyError: if a read names a target :data:`TARGETS` has no function for.
    """
    names = list(dict.fromkeys(read.target for read in SWEEP_READS))
    missing = [name for name in names if name not in TARGETS]
    if missing:
        raise KeyError(f"sweep reads name targets without a target function: {missing}; add them to TARGETS")
    return [m for m in (TARGETS[name](inp) for name in names) if m is not None]


def measure_in_memory(measurements: Sequence[Measurement], acts: Activations, label: str | None = None) -> pd.DataFrame:
    """The probe rows of ``measurements`` on cached activations (:func:`~nopelens.probes.stream.replay`;
    probes one job at a time, :func:`~nopelens.probes.stream_probes.replay_probes`), one table;
    ``label``: show a bar over the probes' jobs, ``<label>: probing <target>``."""
    frames = [
        replay_probes(m, acts, progress=label and f"{label}: probing {_target_name(m)}")
        if isinstance(m, Probes)
        else replay(acts, [m])[0]
        for m in measurements
    ]
    return pd.concat(frames, ignore_index=True)


def _target_name(probes: Probes) -> str:
    """``absolute index``: the target of a probe measurement's first family, in words."""
    return probes.jobs[0].layout.families[0].target.split("//")[0].replace("_", " ") if probes.jobs else "nothing"
