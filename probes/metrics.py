"""Probe metrics with bootstrap confidence intervals over sequences.

Every metric here is computed from per-sample weights, so one code path gives the point estimate
(all weights 1) and each bootstrap replicate (weights = how many times each sample's sequence was
drawn). Resampling whole sequences, not tokens, keeps the interval honest about the dependence
between tokens of one sequence. Each weighted metric equals its scikit-learn / SciPy counterpart on
the data with every sample repeated ``weight`` times (tests check this); the vectorized form makes
1000 replicates over 20 000 samples cost tens of milliseconds instead of seconds.

Metrics (higher is better except ``mad``):

- ``accuracy``, ``balanced_accuracy`` (mean recall over the classes present in ``y``),
  ``within_one`` (|prediction - target| <= 1, the "±1 accuracy");
- ``mad``: mean absolute distance |prediction - target| in positions (Haviv et al. 2022, "Transformer
  language models without positional encodings still learn positional information", §4), with
  chance value :func:`mad_chance_of` (E|X - Y| over the positions actually scored; :func:`mad_chance`
  is its special case for L equally likely positions);
- ``r2`` (coefficient of determination), ``spearman`` (Spearman's rho, average ranks for ties).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int

CLASSIFICATION_METRICS = ("accuracy", "balanced_accuracy", "within_one", "mad")
REGRESSION_METRICS = ("r2", "spearman", "mad")
HIGHER_IS_BETTER = {
    "accuracy": True,
    "balanced_accuracy": True,
    "within_one": True,
    "r2": True,
    "spearman": True,
    "mad": False,
}


def random_state(seed: int) -> int | np.random.Generator:
    """The ``random_state`` to give SciPy and scikit-learn for a nopelens seed (``0..2^63 - 1``):
    the seed itself where their ``RandomState`` takes it (below ``2^32``: the numbers nopelens has
    always drawn), else a numpy ``Generator`` seeded with it.

    Raises:
        ValueError: on a negative seed.

    >>> random_state(7), type(random_state(2**40)).__name__
    (7, 'Generator')
    """
    if seed < 0:
        raise ValueError(f"a seed is an integer >= 0, got {seed}")
    return seed if seed < 2**32 else np.random.default_rng(seed)


def mad_chance(n_positions: int) -> float:
    """Expected |X - Y| for X, Y independent and uniform on {0, ..., L - 1}: (L^2 - 1) / (3 L).

    The chance level of the mean absolute distance (MAD) of a position probe whose predictions
    carry no information, when positions are uniform (Haviv et al. 2022 report MAD against it).
    Derivation: E|X - Y| = (2 / L^2) * sum_{d=1}^{L-1} d (L - d) = (L^2 - 1) / (3 L).

    Args:
        n_positions: L, the number of equally likely positions, >= 1.

    Returns:
        The chance MAD, in positions.

    Raises:
        ValueError: if ``n_positions`` < 1.

    Example:
        >>> mad_chance(64)
        21.328125
        >>> mad_chance(1), round(mad_chance(4), 6)
        (0.0, 1.25)
    """
    if not isinstance(n_positions, (int, np.integer)) or n_positions < 1:
        raise ValueError(f"n_positions must be an integer >= 1, got {n_positions!r}")
    return (n_positions**2 - 1) / (3 * n_positions)


def mad_chance_of(targets: np.ndarray) -> float:
    """Expected |X - Y| for X, Y drawn independently from the empirical distribution of ``targets``.

    The chance level of the mean absolute distance (MAD) of a probe whose predictions carry no
    information about the scored samples: a prediction drawn from the same distribution as the
    targets, independently of them. It uses the positions (or distances) actually scored, so
    with variable sequence lengths late positions count as rarely as they occur; on sequences of
    one length L it equals :func:`mad_chance` (L). With the values sorted, x_(0) <= ... <= x_(n-1),
    sum_{i,j} |x_i - x_j| = 2 sum_k (2k - n + 1) x_(k) (each sorted value is larger than the k
    before it and smaller than the n - 1 - k after it).

    Args:
        targets: scored targets ``[n]`` (positions or distances), finite, n >= 1.

    Returns:
        E|X - Y|, in the targets' unit (positions).

    Raises:
        ValueError: on empty, non-1-D or non-finite input.

    Example:
        Half of the sequences of length 10, half of length 20 (issue 10 §4): the uniform
        formula at the mean length, mad_chance(15), would say 4.977778.

        >>> positions = np.concatenate([np.arange(10), np.arange(20)])
        >>> round(mad_chance_of(positions), 6)
        6.277778
        >>> mad_chance_of(np.tile(np.arange(64), 3)) == mad_chance(64)
        True
    """
    x = np.sort(np.asarray(targets, dtype=np.float64))
    if x.ndim != 1 or len(x) == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"targets must be a non-empty 1-D array of finite numbers, got shape {x.shape}")
    n = len(x)
    return float(2 * np.dot(2 * np.arange(n) - n + 1, x) / n**2)


def metric_names(task: str) -> tuple[str, ...]:
    """The metrics reported for a ``classification`` or ``regression`` probe."""
    if task == "classification":
        return CLASSIFICATION_METRICS
    if task == "regression":
        return REGRESSION_METRICS
    raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")


def score(y: np.ndarray, pred: np.ndarray, metric: str) -> float:
    """One metric on unweighted data.

    Args:
        y: targets ``[n]`` (class labels that are positions or distances, or real values).
        pred: predictions ``[n]``.
        metric: one of ``accuracy``, ``balanced_accuracy``, ``within_one``, ``mad``, ``r2``,
            ``spearman``.

    Raises:
        ValueError: on an unknown metric, mismatched or empty inputs, or an undefined value
            (``r2``/``spearman`` of a constant target).

    Example:
        >>> score(np.array([0, 1, 2, 3]), np.array([0, 2, 2, 0]), "mad")
        1.0
        >>> score(np.array([0, 1, 2, 3]), np.array([0, 2, 2, 0]), "within_one")
        0.75
    """
    y, pred = _check_pair(y, pred)
    groups = np.arange(len(y))
    value = _metric_values(metric, y, pred, groups, np.ones((1, len(y))))[0]
    if not np.isfinite(value):
        raise ValueError(f"{metric} is undefined here (constant targets or predictions)")
    return float(value)


def bootstrap_scores(
    y: Float[np.ndarray, " n"] | Int[np.ndarray, " n"],
    pred: Float[np.ndarray, " n"] | Int[np.ndarray, " n"],
    groups: Int[np.ndarray, " n"],
    metrics: tuple[str, ...] | list[str],
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    skip_undefined: bool = False,
) -> dict[str, tuple[float, float, float]]:
    """Point estimates and percentile bootstrap CIs, resampling sequences with replacement.

    Each replicate draws ``n_groups`` sequences with replacement (Efron's percentile bootstrap,
    with sequences as the resampled unit) and recomputes every metric on the samples of the drawn
    sequences, counted with multiplicity.

    Args:
        y: targets ``[n]``.
        pred: predictions ``[n]`` (out-of-fold).
        groups: sequence id of each sample ``[n]``.
        metrics: metric names (see the module docstring).
        n_boot: bootstrap replicates, >= 1.
        confidence: coverage of the interval, in (0, 1).
        seed: seed of the resampling.
        skip_undefined: leave out a metric that is undefined here (e.g. Spearman of the
            constant predictions of a majority baseline) instead of raising.

    Returns:
        metric -> (value, ci_low, ci_high).

    Raises:
        ValueError: on mismatched shapes, bad ``n_boot``/``confidence``, an unknown metric, an
            undefined point estimate, or when more than half of the replicates are undefined.
    """
    y, pred = _check_pair(y, pred)
    groups = np.asarray(groups)
    if groups.shape != y.shape:
        raise ValueError(f"groups shape {groups.shape} != y shape {y.shape}")
    if not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    _, group_index = np.unique(groups, return_inverse=True)
    n_groups = int(group_index.max()) + 1
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=n_boot).astype(np.float64)
    alpha = (1 - confidence) / 2
    out = {}
    weights = np.vstack([np.ones((1, n_groups)), draws])  # row 0: the point estimate; one pass serves all
    for metric in metrics:
        values = _metric_values(metric, y, pred, group_index, weights)
        value, replicates = values[0], values[1:]
        if not np.isfinite(value):
            if skip_undefined:
                continue
            raise ValueError(f"{metric} is undefined on these targets (constant targets or predictions)")
        finite = replicates[np.isfinite(replicates)]
        if len(finite) < max(1, n_boot // 2):
            if skip_undefined:
                continue
            raise ValueError(f"{metric}: {n_boot - len(finite)} of {n_boot} bootstrap replicates are undefined")
        low, high = np.quantile(finite, [alpha, 1 - alpha])
        out[metric] = (float(value), float(low), float(high))
    return out


def _check_pair(y, pred) -> tuple[np.ndarray, np.ndarray]:
    y, pred = np.asarray(y), np.asarray(pred)
    if y.ndim != 1 or y.shape != pred.shape:
        raise ValueError(f"y and pred must be 1-D of equal length, got {y.shape} and {pred.shape}")
    if len(y) == 0:
        raise ValueError("no samples to score")
    for name, array in (("y", y), ("pred", pred)):
        if not np.issubdtype(array.dtype, np.number) or not np.all(np.isfinite(array)):
            raise ValueError(f"{name} must be finite numbers")
    return y, pred


def _metric_values(metric: str, y, pred, group_index, weights) -> np.ndarray:
    """Metric under each row of group weights ``[B, n_groups]`` -> ``[B]``."""
    counts = np.bincount(group_index, minlength=weights.shape[1]).astype(np.float64)
    n = weights @ counts

    def weighted_mean(per_sample):
        return (weights @ np.bincount(group_index, per_sample, minlength=weights.shape[1])) / n

    if metric == "accuracy":
        return weighted_mean((y == pred).astype(np.float64))
    if metric == "within_one":
        return weighted_mean((np.abs(pred - y) <= 1).astype(np.float64))
    if metric == "mad":
        return weighted_mean(np.abs(pred - y).astype(np.float64))
    if metric == "r2":
        return _r2(y.astype(np.float64), pred.astype(np.float64), group_index, weights, n)
    if metric == "balanced_accuracy":
        return _balanced_accuracy(y, pred, group_index, weights)
    if metric == "spearman":
        return _spearman(y, pred, group_index, weights)
    raise ValueError(f"unknown metric {metric!r}; known: {sorted(HIGHER_IS_BETTER)}")


def _r2(y, pred, group_index, weights, n) -> np.ndarray:
    size = weights.shape[1]
    sum_y = weights @ np.bincount(group_index, y, minlength=size)
    sum_y2 = weights @ np.bincount(group_index, y * y, minlength=size)
    sse = weights @ np.bincount(group_index, (y - pred) ** 2, minlength=size)
    sst = sum_y2 - sum_y**2 / n
    with np.errstate(divide="ignore", invalid="ignore"):
        # sst is exactly 0 only for a constant target; tiny float residue counts as constant too
        return np.where(sst > 1e-12 * np.maximum(sum_y2, 1.0), 1 - sse / sst, np.nan)


def _balanced_accuracy(y, pred, group_index, weights) -> np.ndarray:
    classes, y_index = np.unique(y, return_inverse=True)
    size = weights.shape[1]
    flat = group_index * len(classes) + y_index
    totals = np.bincount(flat, minlength=size * len(classes)).reshape(size, len(classes))
    correct = np.bincount(flat, (y == pred).astype(np.float64), minlength=size * len(classes))
    correct = correct.reshape(size, len(classes))
    class_totals = weights @ totals
    with np.errstate(divide="ignore", invalid="ignore"):
        recall = (weights @ correct) / class_totals
    present = class_totals > 0
    return np.where(present, recall, 0.0).sum(1) / present.sum(1)


def _spearman(y, pred, group_index, weights, chunk: int | None = None) -> np.ndarray:
    """Spearman's rho under each weight row: Pearson's r between average ranks (ties share the mean
    of their ranks), where sample i counts ``weights[b, group_index[i]]`` times, which is
    ``scipy.stats.spearmanr`` on the repeated samples.

    Samples are taken in the order of ``pred``, so its ranks are a running sum of the weights. The
    mean rank is (N + 1) / 2 whatever the weights (N their total), so the centered sums need only
    sum(w a b), sum(w a^2) and sum(w b^2). With integer weights every term is a multiple of 1/4,
    so the sums are exact below 2^51 and a constant variable gives a variance of exactly 0.

    Predictions within :data:`PREDICTION_TIES` of their largest magnitude are tied: float round-off
    is not signal. A linear probe gives identical feature rows (a BOS token, a repeated token's
    embedding, the pairs of a position-only circuit) predictions that differ in the last bit,
    depending on where each row sits in a matrix product; ranked as distinct, that noise would move
    rho by up to 1e-4, and differently for the same probe fitted in memory or streamed.

    Replicates are taken ``chunk`` at a time (default: :func:`_replicate_chunk`); each replicate's
    numbers are the same whatever the chunk.
    """
    chunk = chunk or _replicate_chunk(len(pred))
    order = np.argsort(pred, kind="stable")
    n_groups = weights.shape[1]
    y_ranks = _TieRanks(y[order], group_index[order], n_groups)
    scale = float(np.abs(pred).max()) if len(pred) else 0.0
    pred_ranks = _TieRanks(pred[order], group_index[order], n_groups, tolerance=PREDICTION_TIES * scale)
    sample_group = group_index[order]
    group_sizes = np.bincount(group_index, minlength=n_groups).astype(np.float64)
    out = np.empty(len(weights))
    for start in range(0, len(weights), chunk):
        rows = weights[start : start + chunk]
        w = rows[:, sample_group]  # [b, n] multiplicity of each sample, in pred order
        total = rows @ group_sizes  # = w.sum(1): integer weights, so exact
        a, a_square = y_ranks(rows, w)
        b, b_square = pred_ranks(rows, w)
        offset = total * ((total + 1) / 2) ** 2  # N m^2 with m = (N + 1) / 2, the mean rank
        cov = np.einsum("ij,ij,ij->i", w, a, b) - offset
        var = (a_square - offset) * (b_square - offset)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[start : start + chunk] = np.where(var > 0, cov / np.sqrt(var), np.nan)
    return out


REPLICATE_CHUNK_ELEMENTS = 1 << 18
"""Samples x replicates :func:`_spearman` works on at once (2 MiB per float64 array): its half
dozen passes over them then stay in cache. At 16k to 100k samples and 200 replicates this is 1.4x
to 2.4x faster on one CPU thread than 64 replicates at a time."""


def _replicate_chunk(n_samples: int) -> int:
    """Replicates per chunk for ``n_samples``: :data:`REPLICATE_CHUNK_ELEMENTS` of them, between 8
    (fewer rows lose more to per-call overhead than they gain in cache) and 64."""
    return max(8, min(64, REPLICATE_CHUNK_ELEMENTS // max(n_samples, 1)))


class _TieRanks:
    """Average ranks of ``x`` when sample i is repeated ``w_i`` times, for many weight rows at once.

    A tie group (equal values) of total weight T that starts after cumulative weight C gets rank
    C + (T + 1) / 2, which is ``scipy.stats.rankdata(method="average")`` on the repeated data. With
    few tie groups (positions, distances, class labels) their weights are one small product of the
    sequence weights with a [n_groups, n_ties] count table; otherwise the sample weights are
    summed per tie group in sorted order (no reordering when ``x`` comes sorted).
    """

    def __init__(self, x: np.ndarray, group_index: np.ndarray, n_groups: int, tolerance: float = 0.0):
        if tolerance > 0:  # x sorted: a tie group is a run of neighbours at most ``tolerance`` apart
            self.tie = np.cumsum(np.r_[0, np.diff(x) > tolerance])
            n_values = int(self.tie[-1]) + 1 if len(x) else 0
        else:
            values, tie = np.unique(x, return_inverse=True)
            self.tie, n_values = tie.reshape(-1), len(values)
        self.counts = self.perm = None
        if n_values * n_groups <= COUNT_TABLE_MAX and 4 * n_values <= len(x):
            self.counts = np.zeros((n_groups, n_values))
            np.add.at(self.counts, (group_index, self.tie), 1.0)
            return
        if np.any(self.tie[1:] < self.tie[:-1]):
            self.perm = np.argsort(self.tie, kind="stable")
            self.inverse = np.argsort(self.perm)
        self.sorted_tie = self.tie if self.perm is None else self.tie[self.perm]
        self.starts = np.flatnonzero(np.r_[True, self.sorted_tie[1:] != self.sorted_tie[:-1]])
        self.distinct = len(self.starts) == len(x)
        sizes = np.diff(np.r_[self.starts, len(x)])
        tied = sizes > 1
        self.few_ties = not self.distinct and int(sizes[tied].sum()) * FEW_TIES <= len(x)
        if self.few_ties:  # the tied samples (in sorted order), and the first and last of their groups
            self.members = np.flatnonzero(np.repeat(tied, sizes))
            self.first = self.starts[tied]
            self.last = self.first + sizes[tied] - 1
            self.member_group = np.repeat(np.arange(int(tied.sum())), sizes[tied])

    def __call__(self, rows: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ranks of every sample ``[b, n]`` and the sum of weight x rank^2 ``[b]``, for sequence
        weights ``rows`` ``[b, n_groups]`` whose per-sample weights are ``w`` ``[b, n]``."""
        if self.counts is not None:
            tie_weight = rows @ self.counts
            ranks = _average_ranks(tie_weight)
            return ranks[:, self.tie], (tie_weight * ranks**2).sum(1)
        ordered = w if self.perm is None else w[:, self.perm]
        if self.few_ties:
            ranks, square = self._few_ties(ordered)
            return (ranks if self.perm is None else ranks[:, self.inverse]), square
        tie_weight = ordered if self.distinct else np.add.reduceat(ordered, self.starts, axis=1)
        ranks = _average_ranks(tie_weight)
        square = np.einsum("ij,ij,ij->i", tie_weight, ranks, ranks)
        if not self.distinct:
            ranks = ranks[:, self.sorted_tie]
        return (ranks if self.perm is None else ranks[:, self.inverse]), square

    def _few_ties(self, ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`__call__` when few samples are tied (a BOS token's predictions): every sample
        ranked as if distinct, then each tied group's members given the group's rank C + (T + 1) / 2.
        The same numbers as summing the weights per tie group (every term a multiple of 1/2, so
        exact), without a pass per group over all samples."""
        through = np.cumsum(ordered, axis=1)  # weight up to and including each sample
        last = through[:, self.last]
        weight = last - np.where(self.first > 0, through[:, self.first - 1], 0.0)
        ranks = _mid_ranks(through, ordered)
        ranks[:, self.members] = _mid_ranks(last, weight)[:, self.member_group]
        return ranks, np.einsum("ij,ij,ij->i", ordered, ranks, ranks)


FEW_TIES = 8
""":class:`_TieRanks` ranks samples one by one and then fixes their tie groups when at most one
sample in ``FEW_TIES`` is tied."""

PREDICTION_TIES = 1e-9
"""Predictions closer than this times their largest magnitude share a rank in Spearman's rho. It
is far above the float64 round-off of a prediction (a dot product of at most a few thousand terms,
~1e-13 relative) and far below the spacing of real position or distance predictions."""

COUNT_TABLE_MAX = 1 << 20
"""Largest [n_groups, n_ties] count table :class:`_TieRanks` builds (8 MiB of float64)."""


def _average_ranks(tie_weight: np.ndarray) -> np.ndarray:
    """Rank C + (T + 1) / 2 of tie groups of weights T ``[b, k]`` (ascending), C the weight before."""
    return _mid_ranks(np.cumsum(tie_weight, axis=1), tie_weight)


def _mid_ranks(through: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Rank C + (T + 1) / 2 = ``through`` - T / 2 + 1 / 2 of groups of weight T whose cumulative
    weight ends at ``through``."""
    ranks = through - 0.5 * weight
    ranks += 0.5
    return ranks
