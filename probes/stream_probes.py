"""The probe reads of the one engine (:class:`~nopelens.probes.engine.Probes`, issue 38): the
streamed constructors :func:`absolute_index_probes`, :func:`relative_distance_probes` and
:func:`token_probes` (the one definition of a new token read), and the in-memory API
:func:`probe_absolute_index` and :func:`probe_relative_distance`, which replay cached activations
through the same measurement (:func:`replay_probes`).

Long context: with more than :data:`MAX_POSITION_CLASSES` positions, classification is over
position bins (:func:`~nopelens.probes.linear.position_classes`, target ``absolute_index//W``);
regression, MAD and Spearman stay in positions. Pairs are drawn at :data:`MAX_DISTANCES`
distances spread over the whole range (:func:`~nopelens.probes.targets.spread_distances`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from nopelens.models.progress import progress_bar

from .collect import Activations
from .engine import ProbeFamily, ProbeJob, Probes, RowLayout, pair_scores
from .linear import extrapolation_splits, position_classes, probe_labels, sequence_splits
from .moments import _check_task
from .stream import KeepBudget, Sequences, replay
from .targets import sample_distance_pairs, spread_distances

__all__ = [
    "MAX_DISTANCES",
    "MAX_POSITION_CLASSES",
    "Probes",
    "absolute_index_probes",
    "pair_scores",
    "probe_absolute_index",
    "probe_family",
    "probe_relative_distance",
    "relative_distance_probes",
    "replay_probes",
    "token_probes",
]

MAX_POSITION_CLASSES = 64
"""Absolute-index classification uses at most this many classes; beyond, position bins."""

MAX_DISTANCES = 64
"""Relative-distance pairs are drawn at at most this many distances, spread over the range."""


def absolute_index_probes(
    sequences: Sequences,
    sites: Sequence[str],
    tasks: Sequence[str] = ("classification", "regression"),
    n_splits: int = 5,
    controls: bool = True,
    extrapolate_from: int | None = None,
    max_classes: int | None = MAX_POSITION_CLASSES,
    n_boot: int = 1000,
    seed: int = 0,
    keep: KeepBudget | int | str | None = "auto",
    compute_dtype: torch.dtype | None = None,
    min_position: int = 0,
    classifier: str = "lda",
) -> Probes:
    """Streamed :func:`probe_absolute_index` (LDA and ridge probes).

    Args:
        sequences: the token set the model will be run on.
        sites: residual-like sites shaped ``[batch, pos, ...]`` (flattened per token).
        tasks, n_splits, controls, extrapolate_from, n_boot, seed: as the in-memory function.
        max_classes: classification over at most this many classes (position bins beyond it,
            :func:`~nopelens.probes.linear.position_classes`); None: every position its class.
        keep: features kept for the predictions instead of a second forward pass: a shared
            :class:`~nopelens.probes.stream.KeepBudget`, or its limit (bytes; None: all; 0: none;
            ``"auto"``: 512 MiB or a quarter of the available memory, whichever is less).
        compute_dtype: statistics' dtype (float64; float32 only on an accelerator).
        classifier: ``lda`` (from the streamed statistics), ``ridge`` or ``logistic``
            (:func:`~nopelens.probes.linear.make_probe` pipelines on the kept features: a run
            whose features do not fit ``keep`` is refused).
        min_position: probe only the tokens at position >= this (positions keep their numbers):
            1 probes the tokens after the first real one of each sequence, the queries a sink
            ablation touches, as the in-memory probe on
            :func:`~nopelens.analyses.intervene.later_tokens` does.

    Returns:
        A :class:`~nopelens.probes.engine.Probes` measurement.

    Raises:
        ValueError: with too few sequences for the folds (counting only sequences with a token at
            ``min_position`` or later), an unknown task, a negative ``min_position``, or as
            :func:`~nopelens.probes.linear.extrapolation_splits`.
    """

    def families(groups, position, token, splits):
        out = []
        for task in tasks:
            y, target = (
                position_classes(position, max_classes) if task == "classification" else (position, "absolute_index")
            )
            out.append(ProbeFamily(target, task, "grouped", probe_labels(y, token, controls, seed), splits, controls))
        if extrapolate_from is not None:
            out.append(
                ProbeFamily(
                    "absolute_index",
                    "regression",
                    "extrapolation",
                    {"linear": position},
                    extrapolation_splits(groups, position, extrapolate_from, n_splits),
                    False,
                )
            )
        return out

    return token_probes(
        sequences, sites, families, tasks, n_splits, n_boot, seed, keep, compute_dtype, min_position, classifier
    )


def token_probes(
    sequences: Sequences,
    sites: Sequence[str],
    families,
    tasks: Sequence[str] = ("classification",),
    n_splits: int = 5,
    n_boot: int = 1000,
    seed: int = 0,
    keep: KeepBudget | int | str | None = "auto",
    compute_dtype: torch.dtype | None = None,
    min_position: int = 0,
    classifier: str = "lda",
) -> Probes:
    """Probes of a per-token target at residual-like ``sites``: the one definition of a new token
    read, streamed (:func:`~nopelens.probes.stream.run`) or in memory
    (:func:`~nopelens.probes.stream.replay`).

    Args:
        sequences: the token set.
        sites: sites shaped ``[batch, pos, ...]`` (flattened per token).
        families: ``(groups, position, token, splits) -> [probe_family(...), ...]`` of the probed
            samples (sequence ids, positions and token ids ``[n]``, their GroupKFold splits); or,
            for one target, ``(target, labels)``: ``labels`` ``[n_samples]`` per sample of
            ``sequences`` (integers for classification), probed for every task of ``tasks``
            with the control task and the shuffled labels.
        tasks: the tasks of a ``(target, labels)`` target.
        n_splits, n_boot, seed, keep, compute_dtype, min_position, classifier: as
            :func:`absolute_index_probes`.

    Raises:
        ValueError: as :func:`absolute_index_probes`.
    """
    for task in tasks:
        _check_task(task)
    if isinstance(min_position, bool) or not isinstance(min_position, (int, np.integer)) or min_position < 0:
        raise ValueError(f"min_position must be an integer >= 0, got {min_position!r}")
    groups, position, token = sequences.sequence_id, sequences.position, sequences.token
    sample_rows, probed = None, slice(None)
    if min_position > 0:
        probed = position >= min_position
        sample_rows = np.where(probed, np.cumsum(probed) - 1, -1)
        groups, position, token = groups[probed], position[probed], token[probed]
    splits = sequence_splits(groups, n_splits)
    if not callable(families):
        target, labels = families
        labels = np.asarray(labels)[probed]
        made = [probe_family(target, task, labels, token, splits, seed=seed) for task in tasks]
    else:
        made = families(groups, position, token, splits)
    layout = RowLayout(groups, token, made, sample_rows)
    jobs = [ProbeJob(layout, (site,), site, "token", "rows", read=False) for site in sites]
    return Probes(sequences, jobs, None, n_boot, seed, keep, compute_dtype, classifier=classifier)


def probe_family(
    target: str,
    task: str,
    labels: np.ndarray,
    token_types: np.ndarray,
    splits,
    split: str = "grouped",
    controls: bool = True,
    seed: int = 0,
) -> ProbeFamily:
    """One probe family: ``target``'s ``labels`` ``[n]`` fitted as ``task`` on ``splits``, with the
    control task and the shuffled labels of :func:`~nopelens.probes.linear.probe_labels` (and the
    baselines) when ``controls``."""
    _check_task(task)
    if task == "classification" and not np.issubdtype(np.asarray(labels).dtype, np.integer):
        raise ValueError(f"classification targets must be integers, got dtype {np.asarray(labels).dtype}")
    return ProbeFamily(target, task, split, probe_labels(labels, token_types, controls, seed), splits, controls)


def relative_distance_probes(
    sequences: Sequences,
    sites: Sequence[str] = (),
    feature_kinds: Sequence[str] = ("concat", "difference"),
    attention: Sequence[tuple[str, str]] = (),
    scores: Sequence[str] = (),
    bilinear: str = "outer",
    tasks: Sequence[str] = ("classification", "regression"),
    max_distance: int | None = None,
    pairs_per_distance: int | None = None,
    distances: Sequence[int] | str | None = "spread",
    n_splits: int = 5,
    controls: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    keep: KeepBudget | int | str | None = "auto",
    compute_dtype: torch.dtype | None = None,
    classifier: str = "lda",
) -> Probes:
    """Streamed :func:`probe_relative_distance` (LDA and ridge probes).

    Args:
        sequences: the token set the model will be run on.
        sites: residual sites for the pair features ``feature_kinds``.
        attention: (query site, key site) pairs for the content-only bilinear q.k read.
        scores: ``hook_attn_scores`` sites for the score read.
        bilinear, tasks, max_distance, pairs_per_distance, n_splits, controls, n_boot, seed: as
            the in-memory function.
        distances: the distances to draw pairs at: ``"spread"`` (default) for at most
            :data:`MAX_DISTANCES` spread over 0..max_distance (every distance when there are no
            more), None for every distance, or an explicit ascending list.
        keep, compute_dtype, classifier: as :func:`absolute_index_probes`.

    Returns:
        A :class:`~nopelens.probes.engine.Probes` measurement.

    Raises:
        ValueError: as :func:`~nopelens.probes.targets.sample_distance_pairs` and
            :func:`~nopelens.probes.linear.sequence_splits`.
    """
    for task in tasks:
        _check_task(task)
    if distances == "spread":
        longest = int(np.diff(sequences.offsets).max())
        distances = spread_distances(longest - 1 if max_distance is None else max_distance, MAX_DISTANCES)
    pairs = sample_distance_pairs(
        sequences.sequence_id, sequences.position, max_distance, pairs_per_distance, seed, distances
    )
    pair_tokens = np.stack([sequences.token[pairs.query], sequences.token[pairs.key]], axis=1)
    splits = sequence_splits(pairs.sequence_id, n_splits)
    families = [
        ProbeFamily(
            "relative_distance",
            task,
            "grouped",
            probe_labels(pairs.distance, pair_tokens, controls, seed),
            splits,
            controls,
        )
        for task in tasks
    ]
    layout = RowLayout(pairs.sequence_id, pair_tokens, families)
    jobs = [ProbeJob(layout, (site,), site, kind, "float32", read=False) for site in sites for kind in feature_kinds]
    jobs += [ProbeJob(layout, (q, k), q, f"bilinear_{bilinear}", "float32", read=True) for q, k in attention]
    jobs += [ProbeJob(layout, (site,), site, "score", "scores", read=True) for site in scores]
    return Probes(sequences, jobs, pairs, n_boot, seed, keep, compute_dtype, classifier=classifier)


def replay_probes(
    probes: Probes, acts, device: torch.device | str = "cpu", batch_size: int = 32, progress: str | None = None
) -> pd.DataFrame:
    """The table of ``probes`` on cached activations: every job replayed and fitted in turn
    (:func:`~nopelens.probes.stream.replay`, one :meth:`~nopelens.probes.engine.Probes.subset` each,
    every batch kept), so
    no more than one job's features are copied at a time; the in-memory API is this.
    ``progress``: the label of a bar over the jobs (None: no bar).

    Raises:
        KeyError, ValueError: as :func:`~nopelens.probes.stream.replay` and the probes' fits.
    """
    for job in progress_bar(probes.jobs, desc=progress, unit="site", leave=False, disable=progress is None):
        replay(acts, [probes.subset([job], KeepBudget(None))], batch_size, device, probes.sequences)
    probes.finish()
    return probes.result()


# ----------------------------------------------------------------------------- the in-memory API


def probe_absolute_index(
    acts: Activations,
    sites: Sequence[str] | None = None,
    tasks: Sequence[str] = ("classification", "regression"),
    n_splits: int = 5,
    classifier: str = "lda",
    controls: bool = True,
    extrapolate_from: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    device: str = "cpu",
    max_classes: int | None = None,
) -> pd.DataFrame:
    """Probe the absolute index (position id) at every site, as classes and as a value.

    Args:
        acts: from :func:`~nopelens.probes.collect`.
        sites: which collected sites (default: all non-pattern sites, in collection order).
        tasks: ``classification`` and/or ``regression``.
        n_splits: GroupKFold folds over sequences.
        classifier: ``lda``, ``ridge`` or ``logistic``.
        controls: add control task, shuffled, majority and token-identity rows.
        extrapolate_from: if given, also a regression probe fitted on positions < P and scored
            on positions >= P (``split == "extrapolation"``), on held-out sequences.
        n_boot: bootstrap replicates.
        seed: seed of controls and bootstrap.
        device: torch device for the probe algebra (see :func:`~nopelens.probes.linear.probe_features`).
        max_classes: classify at most this many classes: with more positions, classes are
            position bins of equal width (:func:`position_classes`). None: every position its class.

    Returns:
        Tidy DataFrame with :data:`~nopelens.probes.linear.RESULT_COLUMNS`, ``target ==
        "absolute_index"`` (classification over bins of width W: ``"absolute_index//W"``, see
        :func:`~nopelens.probes.linear.position_classes`). Features are
        judged against the round-off of the dtype the activations were computed in
        (:meth:`~nopelens.probes.collect.Activations.dtype`).

    Raises:
        KeyError: for a site that was not collected.
        ValueError: as :func:`~nopelens.probes.linear.probe_features`.
    """
    sites = list(acts.acts) if sites is None else list(sites)
    probes = absolute_index_probes(
        Sequences.of_activations(acts),
        sites,
        tasks,
        n_splits,
        controls,
        extrapolate_from,
        max_classes,
        n_boot,
        seed,
        keep=None,
        classifier=classifier,
    )
    return replay_probes(probes, acts, device)


def probe_relative_distance(
    acts: Activations,
    sites: Sequence[str] | None = None,
    feature_kinds: Sequence[str] = ("concat", "difference"),
    attention: Sequence[tuple[str, str]] = (),
    scores: Sequence[str] = (),
    bilinear: str = "outer",
    tasks: Sequence[str] = ("classification", "regression"),
    max_distance: int | None = None,
    pairs_per_distance: int | None = None,
    n_splits: int = 5,
    classifier: str = "lda",
    controls: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    device: str = "cpu",
    distances: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Probe the relative distance i - j of distance-balanced token pairs (j <= i, same sequence).

    Residual sites get pair features ``concat`` [h_i; h_j] and ``difference`` h_i - h_j. Attention
    gets two reads, kept apart because they answer different questions:

    - ``attention`` (query site, key site): the *content-only q.k read*, a per-head bilinear read of
      q_i and k_j (:func:`~nopelens.probes.targets.bilinear_features`; features
      ``bilinear_outer``/``bilinear_elementwise``). It sees RoPE (pass the rotated q and k) but
      never a bias added to the score, so it cannot see ALiBi or Shaw.
    - ``scores`` (``blocks.{l}.attn.hook_attn_scores`` sites): the *score read*, what the head
      actually scores, content plus position bias, relative to the query's own key
      (:func:`~nopelens.probes.targets.score_features`; features ``score``). It compares NoPE,
      RoPE, ALiBi and Shaw on the same footing.

    Layer of an attention read: block ``l``'s read is reported at ``layer = l + 1``, the residual
    layer its head writes into (DESIGN.md numbering), so :func:`~nopelens.probes.linear.first_recoverable_layer` takes
    this table directly. The control task and the token-identity ceiling use the token pair
    (token_i, token_j) as the type.

    Args:
        acts: from :func:`~nopelens.probes.collect`.
        sites: residual-like sites for pair features (default: every collected site shaped
            ``[n, d]``).
        feature_kinds: subset of ``concat``, ``difference``.
        attention: pairs such as ``("blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k")``.
        scores: collected ``hook_attn_scores`` sites, e.g. ``["blocks.0.attn.hook_attn_scores"]``.
        bilinear: ``outer`` or ``elementwise``.
        tasks: as :func:`probe_absolute_index`.
        n_splits: as :func:`probe_absolute_index`.
        classifier: as :func:`probe_absolute_index`.
        controls: as :func:`probe_absolute_index`.
        n_boot: as :func:`probe_absolute_index`.
        seed: as :func:`probe_absolute_index`.
        device: as :func:`probe_absolute_index`.
        max_distance: as :func:`~nopelens.probes.targets.sample_distance_pairs`.
        pairs_per_distance: as :func:`~nopelens.probes.targets.sample_distance_pairs`.
        distances: as :func:`~nopelens.probes.targets.sample_distance_pairs` (at long context, pass
            :func:`~nopelens.probes.targets.spread_distances` rather than every distance).

    Returns:
        Tidy DataFrame with :data:`~nopelens.probes.linear.RESULT_COLUMNS`, ``target == "relative_distance"``; the
        ``site`` of a bilinear row is the query site, of a score row the scores site.

    Raises:
        KeyError: for a site that was not collected.
        ValueError: as :func:`~nopelens.probes.linear.probe_features` and
            :func:`~nopelens.probes.targets.score_features`.
    """
    if sites is None:
        sites = [site for site, array in acts.acts.items() if array.ndim == 2]
    probes = relative_distance_probes(
        Sequences.of_activations(acts),
        sites,
        feature_kinds,
        attention,
        scores,
        bilinear,
        tasks,
        max_distance,
        pairs_per_distance,
        distances,
        n_splits,
        controls,
        n_boot,
        seed,
        keep=None,
        classifier=classifier,
    )
    return replay_probes(probes, acts, device)
