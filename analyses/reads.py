"""What the sweep reads: one :class:`SweepRead` per reported question, and the target functions
that measure them.

A *read* asks "from which layer on can a linear probe recover this target?" It names the probe
rows it looks at (``target``, ``task``, ``features``, ``metric``), the bar their 95 % CI must
clear (``threshold``), and how it is reported: its ``summary.csv`` column (the first layer that
clears the bar, :func:`~nopelens.probes.linear.first_recoverable_layer`), that column's header in
``summary.md``, and its panel of ``probes.png``. The summary (:func:`~nopelens.analyses.sweep.summarize`),
the figure (:func:`~nopelens.analyses.report.probe_figure`) and the tables over training seeds
(:func:`~nopelens.analyses.seeds.over_seeds`) all take their reads from :data:`SWEEP_READS`, in
its order, at call time.

A *target function* (:data:`TARGETS`) measures one target on one subject: it gets the activations
the sweep collected (:class:`ProbeInput`) and returns tidy probe rows
(:data:`~nopelens.probes.linear.RESULT_COLUMNS`) whose ``target`` column is its key. The sweep
runs the target functions its reads name, in order of first use.

Adding a sweep read is one :class:`SweepRead` appended to :data:`SWEEP_READS`, plus its target
function in :data:`TARGETS` when it reads a target the sweep does not measure yet (a read of an
existing target, such as absolute index Spearman, needs no new function). Nothing else changes:
the summary gains the column, the figure the panel, ``--seeds`` runs the agreed layer
(``tests/test_layout.py`` adds one and checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from nopelens.probes import (
    Activations, first_recoverable_layer, probe_absolute_index, probe_relative_distance, site_block,
)
from nopelens.probes.linear import NOT_RECOVERED

__all__ = ["NOT_RECOVERED", "ProbeInput", "SweepRead", "SweepSites", "SWEEP_READS", "TARGETS", "read_columns"]

MAX_OUTER_FEATURES = 1024
"""Use the full outer-product bilinear read while n_heads * d_head^2 stays below this; above it,
the elementwise (diagonal) read keeps the fits inside the sweep's time budget."""


@dataclass(frozen=True)
class SweepRead:
    """One question the sweep answers per model: the first layer at which a probe clears a bar.

    Attributes:
        column: its ``summary.csv`` column, holding the first layer that clears the bar
            (:data:`~nopelens.probes.linear.NOT_RECOVERED`, -1, when none does; empty when the
            model has no probe rows for the read, e.g. no ``hook_attn_scores``).
        header: the column's header in ``summary.md`` and the printed summary.
        panel: the title of its panel in ``probes.png``.
        target: the probe target (the ``target`` column of ``probes.csv``), a key of :data:`TARGETS`.
        task: ``classification`` or ``regression``.
        metric: the probe metric (``accuracy``, ``r2``, ``spearman``, ``mad``, ...).
        features: the ``features`` column of the rows read: a feature kind (``token``, ``concat``,
            ``score``), or a prefix ending in ``*`` (``bilinear_*`` matches ``bilinear_outer``
            and ``bilinear_elementwise``).
        threshold: the bar: the CI lower bound must reach it (for ``mad``, lower is better: the
            upper bound must stay at or below it).
        split: the probe split (``grouped``: GroupKFold over sequences).
    """

    column: str
    header: str
    panel: str
    target: str
    task: str
    metric: str
    features: str
    threshold: float = 0.9
    split: str = "grouped"

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
        return probes[(probes["probe"] == "linear") & (probes["split"] == self.split)
                      & (probes["target"] == self.target) & (probes["task"] == self.task)
                      & (probes["metric"] == self.metric) & matches & probes["layer"].notna()]

    def first_layer(self, probes: pd.DataFrame) -> int | None:
        """The first layer at which this read clears its bar in ``probes`` (one model, one seed).

        Returns:
            The layer; :data:`~nopelens.probes.linear.NOT_RECOVERED` (-1) when no layer clears it;
            None when ``probes`` has no row for this read (the model has no site for it).
        """
        rows = self.rows(probes)
        if rows.empty:
            return None
        return first_recoverable_layer(rows, self.target, self.metric, self.threshold, self.task)


SWEEP_READS: tuple[SweepRead, ...] = (
    SweepRead("absolute_acc", "abs. index acc ≥ 0.9", "absolute index: accuracy",
              "absolute_index", "classification", "accuracy", "token"),
    SweepRead("absolute_r2", "abs. index R² ≥ 0.9", "absolute index: R²",
              "absolute_index", "regression", "r2", "token"),
    SweepRead("relative_pairs_r2", "rel. dist. pairs R² ≥ 0.9", "relative distance, pairs [h_i; h_j]: R²",
              "relative_distance", "regression", "r2", "concat"),
    SweepRead("relative_score_r2", "rel. dist. head scores R² ≥ 0.9",
              "relative distance, head scores\n(content + position bias): R²",
              "relative_distance", "regression", "r2", "score"),
    SweepRead("relative_content_qk_r2", "rel. dist. content q·k R² ≥ 0.9",
              "relative distance, content-only q·k\n(no position bias): R²",
              "relative_distance", "regression", "r2", "bilinear_*"),
)
"""The sweep's reads, in summary-column and figure-panel order."""


def read_columns() -> tuple[str, ...]:
    """The summary columns of :data:`SWEEP_READS` (each holds a first layer)."""
    return tuple(read.column for read in SWEEP_READS)


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
    """

    residual: list[str]
    inner: list[str]
    qk: list[tuple[str, str]]
    scores: list[str]
    patterns: list[str]

    def all(self) -> list[str]:
        """Every site, in collection order."""
        return self.residual + self.inner + [s for pair in self.qk for s in pair] + self.patterns + self.scores


@dataclass(frozen=True)
class ProbeInput:
    """What a target function gets: one subject's activations and the sweep's probe settings.

    Attributes:
        acts: activations of every :class:`SweepSites` site on the subject's evaluation batch.
        sites: the sites.
        seq_len: tokens per evaluation sequence (the batch's width, padding included).
        n_sequences: evaluation sequences.
        n_splits, n_boot, seed: GroupKFold folds, bootstrap replicates and seed of every probe.
    """

    acts: Activations
    sites: SweepSites
    seq_len: int
    n_sequences: int
    n_splits: int
    n_boot: int
    seed: int

    @property
    def common(self) -> dict:
        """The keyword arguments every probe call shares."""
        return dict(n_splits=self.n_splits, n_boot=self.n_boot, seed=self.seed)


def absolute_index(inp: ProbeInput) -> pd.DataFrame:
    """Absolute index at every residual layer and block output, as classes and as a value, with
    controls, plus an extrapolation probe (fit on positions < L/2, score on >= L/2; half the batch
    width, since synthetic tasks take their lengths from training, not from ``seq_len``)."""
    return probe_absolute_index(inp.acts, sites=inp.sites.residual + inp.sites.inner,
                                extrapolate_from=inp.seq_len // 2, **inp.common)


def relative_distance(inp: ProbeInput) -> pd.DataFrame:
    """Relative distance i - j over distance-balanced pairs: pair features [h_i; h_j] at residual
    layers, the score read of each block's ``hook_attn_scores`` and the content-only q.k read."""
    qk = inp.sites.qk  # empty for a model hooked without the bridge (no q or k to read)
    return probe_relative_distance(
        inp.acts, sites=inp.sites.residual, feature_kinds=("concat",), attention=qk, scores=inp.sites.scores,
        bilinear=bilinear_mode(inp.acts, qk[0][0]) if qk else "outer", tasks=("regression",),
        pairs_per_distance=min(64, inp.n_sequences), **inp.common,
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
    return kept, (f"blocks {blocks}: {', '.join(reasons)} shorter than the {length}-token sequences blocks the pairs "
                  "further apart, whose scores are -inf (no score to read)")


def bilinear_mode(acts: Activations, q_site: str) -> str:
    """``outer`` while n_heads * d_head^2 <= :data:`MAX_OUTER_FEATURES`, else ``elementwise``."""
    _, n_heads, d_head = acts.acts[q_site].shape
    return "outer" if n_heads * d_head * d_head <= MAX_OUTER_FEATURES else "elementwise"


TARGETS: dict[str, Callable[[ProbeInput], pd.DataFrame]] = {
    "absolute_index": absolute_index,
    "relative_distance": relative_distance,
}
"""Target name -> the function measuring it (tidy probe rows with that ``target``)."""


def measure_targets(inp: ProbeInput) -> pd.DataFrame:
    """The probe rows of every target :data:`SWEEP_READS` names, in order of first use.

    Raises:
        KeyError: if a read names a target :data:`TARGETS` has no function for.
    """
    names = list(dict.fromkeys(read.target for read in SWEEP_READS))
    missing = [name for name in names if name not in TARGETS]
    if missing:
        raise KeyError(f"sweep reads name targets without a target function: {missing}; add them to TARGETS")
    return pd.concat([TARGETS[name](inp) for name in names], ignore_index=True)
