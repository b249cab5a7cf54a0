"""Linear position probes with sequence-grouped cross-validation, controls and tidy results: the
probe models, splits, labels and scoring the one engine (:mod:`nopelens.probes.stream_probes`,
whose :func:`~nopelens.probes.stream_probes.probe_absolute_index` and
:func:`~nopelens.probes.stream_probes.probe_relative_distance` are the in-memory API) fits and
scores every read with, and :func:`probe_features` for a feature matrix of one's own.

A probe is a scikit-learn ``Pipeline(scaler, linear model)`` (:func:`make_probe`; the scaler is
``StandardScaler`` that zeroes round-off-only features): for
classes, pooled-covariance LDA (:class:`PooledLDA`, default), ``RidgeClassifier`` or
``LogisticRegression``; for values, ridge (:class:`~nopelens.probes.ridge.GroupedRidgeCV`).
Cross-validation is ``GroupKFold`` over sequences (:func:`sequence_splits`): no sequence is on both
sides of a split, and the whole pipeline, scaler included, is cloned and refit on the fitting side
of every fold, so nothing about the held-out sequences leaks into the scaling.

Why ridge classification by default: on standardized features the one-vs-rest least-squares
classifier has a closed form (one d x d solve per fold), which is tens of times faster than an
iterative logistic fit at 64 classes; ``benchmarks/bench_probes.py``
measures both on the same data and prints the speed ratio and the accuracy difference.
The ridge penalty is chosen by cross-validation grouped by sequence inside the fitting side only
(:class:`~nopelens.probes.ridge.GroupedRidgeCV`, over :data:`ALPHAS`, 1e-3 .. 1e6); the held-out
sequences are never seen, and a result row says when the choice sat at an edge of the grid.
:func:`probe_features` fits the main probe, the control task and the shuffled labels of one site
from shared per-fold statistics (:func:`~nopelens.probes.fitting.fit_folds`); the results equal
scikit-learn's ``StandardScaler`` + ``Ridge`` / :class:`PooledLDA` on the same folds.
Features whose spread is only float round-off of the activations' dtype carry no signal and are
zeroed (:class:`~nopelens.probes.roundoff.RoundoffScaler`, issue 10 §1).

Every result is a tidy ``pandas.DataFrame`` (:data:`RESULT_COLUMNS`), one row per site, target,
task, feature kind, probe, split and metric, with bootstrap 95 % CIs over sequences
(:mod:`~nopelens.probes.metrics`). Besides the ``linear`` probe, every site gets the Hewitt & Liang
2019 ``control`` task and a ``shuffled``-label probe on the same features, and every target gets the
``majority`` class (or mean) on the same split and the ``token_identity`` ceiling
(:func:`~nopelens.probes.targets.token_identity_predictions`). ``selectivity`` = linear score -
control score (Hewitt & Liang 2019, §2) on the linear rows, for metrics where higher is better.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
from jaxtyping import Float, Int
from scipy import linalg, sparse
from sklearn.base import BaseEstimator, clone
from sklearn.dummy import DummyClassifier, DummyRegressor
from sklearn.linear_model import LogisticRegression, RidgeClassifier
from sklearn.linear_model._base import LinearClassifierMixin
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import Pipeline
from sklearn.utils.validation import check_is_fitted, check_X_y

from .collect import site_block, site_layer
from .fitting import fit_folds
from .metrics import HIGHER_IS_BETTER, bootstrap_scores, mad_chance_of, metric_names, random_state
from .recoverable import clears_bar, first_recoverable_layer, is_target  # noqa: F401  (re-exported)
from .ridge import ALPHAS, GroupedRidgeCV
from .roundoff import RoundoffScaler, roundoff_tolerance
from .targets import control_labels, shuffled_labels, token_identity_predictions

CLASSIFIER_ALPHA = 1.0
"""Penalty of ``RidgeClassifier`` on standardized features."""

RESULT_COLUMNS = (
    "site",
    "layer",
    "block",
    "target",
    "task",
    "features",
    "probe",
    "split",
    "metric",
    "value",
    "ci_low",
    "ci_high",
    "selectivity",
    "n_samples",
    "n_sequences",
    "chance",
    "alpha",
    "alpha_at_edge",
)
"""Columns of every results table. ``layer`` is the DESIGN.md layer of residual sites, ``block + 1``
for an attention read of relative distance, else NaN.
``chance`` is the metric's chance value on the targets actually scored, where one is computed:
for ``mad``, E|X - Y| over the scored targets (:func:`~nopelens.probes.metrics.mad_chance_of`);
NaN for the other metrics. ``alpha`` is the median over folds of the ridge penalty the grouped
inner CV chose (NaN for probes without one); ``alpha_at_edge`` is True when some fold chose the
smallest or largest value of :data:`ALPHAS` (widen the grid, or read the score with care)."""

CONTROL_PROBES = ("control", "shuffled", "majority", "token_identity")


class PooledLDA(LinearClassifierMixin, BaseEstimator):
    """Linear discriminant analysis with one pooled, lightly regularized covariance.

    Gaussian classes with a shared covariance give the linear rule
    delta_k(x) = x^T S^-1 mu_k - mu_k^T S^-1 mu_k / 2 + log pi_k (Hastie, Tibshirani & Friedman,
    *The Elements of Statistical Learning*, eq. 4.10), with S the pooled within-class covariance
    plus ``shrinkage * trace(S) / d * I`` (or ``shrinkage * I`` when S is zero), in the spirit of
    Friedman's regularized discriminant analysis. It is the same model as scikit-learn's
    ``LinearDiscriminantAnalysis(solver="lsqr")``, but fits the pooled covariance with one
    ``n x d`` product instead of one shrunk covariance per class, which at 64 classes is tens of
    times faster, and it stays defined when the within-class spread is zero.

    Args:
        shrinkage: relative ridge added to the pooled covariance, >= 0.
    """

    def __init__(self, shrinkage: float = 1e-3):
        self.shrinkage = shrinkage

    def fit(self, X, y):
        X, y = check_X_y(X, y, dtype=np.float64)
        if self.shrinkage < 0:
            raise ValueError(f"shrinkage must be >= 0, got {self.shrinkage!r}")
        self.classes_, label = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(f"need at least 2 classes, got {len(self.classes_)}")
        n, d = X.shape
        one_hot = sparse.csr_matrix((np.ones(n), (label, np.arange(n))), shape=(len(self.classes_), n))
        counts = np.bincount(label)
        means = (one_hot @ X) / counts[:, None]
        centered = X - means[label]
        cov = centered.T @ centered / n
        scale = np.trace(cov) / d if np.trace(cov) > 0 else 1.0
        cov[np.diag_indices(d)] += self.shrinkage * scale
        coef = linalg.solve(cov, means.T, assume_a="pos").T
        intercept = -0.5 * np.sum(means * coef, axis=1) + np.log(counts / n)
        if len(self.classes_) == 2:  # LinearClassifierMixin's binary layout
            coef, intercept = (coef[1] - coef[0])[None], np.array([intercept[1] - intercept[0]])
        self.coef_, self.intercept_ = coef, intercept
        self.n_features_in_ = d
        return self

    def decision_function(self, X):
        check_is_fitted(self)
        return super().decision_function(np.asarray(X, dtype=np.float64))


def make_probe(
    task: str, classifier: str = "lda", alphas: Sequence[float] = ALPHAS, seed: int = 0, dtype=None, n_inner: int = 4
) -> Pipeline:
    """An unfitted ``Pipeline(RoundoffScaler, linear model)``.

    The scaler is ``StandardScaler`` that zeroes features whose spread is only round-off of
    ``dtype`` (:class:`~nopelens.probes.roundoff.RoundoffScaler`).

    Args:
        task: ``classification`` or ``regression`` (:class:`~nopelens.probes.ridge.GroupedRidgeCV`
            over ``alphas``; pass the sequence ids as ``linear__groups`` to ``fit``, as
            :func:`out_of_fold_predictions` does when given ``groups``).
        classifier: for classification, ``lda`` (:class:`PooledLDA`), ``ridge``
            (``RidgeClassifier``, alpha :data:`CLASSIFIER_ALPHA`)
            or ``logistic`` (``LogisticRegression``, lbfgs, multinomial).
        alphas: ridge penalties tried by the grouped inner cross-validation.
        seed: random state of estimators that use one.
        dtype: dtype the activations were computed in (default: that of the fitted array).
        n_inner: inner folds of the penalty's cross-validation.

    Raises:
        ValueError: on an unknown task or classifier.
    """
    if task == "regression":
        model = GroupedRidgeCV(alphas=alphas, n_splits=n_inner)
    elif task == "classification" and classifier == "lda":
        model = PooledLDA()
    elif task == "classification" and classifier == "ridge":
        model = RidgeClassifier(alpha=CLASSIFIER_ALPHA)
    elif task == "classification" and classifier == "logistic":
        model = LogisticRegression(max_iter=1000, random_state=random_state(seed))
    elif task == "classification":
        raise ValueError(f"classifier must be 'lda', 'ridge' or 'logistic', got {classifier!r}")
    else:
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
    return Pipeline([("scale", RoundoffScaler(dtype)), ("linear", model)])


def sequence_splits(groups: Int[np.ndarray, " n"], n_splits: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """GroupKFold splits by sequence: no sequence is ever on both sides of a split.

    Args:
        groups: sequence id of each sample ``[n]``.
        n_splits: folds, >= 2.

    Returns:
        ``n_splits`` (fit_index, score_index) pairs; every sample is scored exactly once.

    Raises:
        ValueError: with one sequence (no grouped split exists), or fewer sequences than folds.

    Example:
        >>> groups = np.array([0, 0, 1, 1, 2, 2])
        >>> sorted(np.unique(groups[test]).tolist() for _, test in sequence_splits(groups, n_splits=3))
        [[0], [1], [2]]
    """
    groups = np.asarray(groups)
    n_groups = len(np.unique(groups))
    if not isinstance(n_splits, (int, np.integer)) or n_splits < 2:
        raise ValueError(f"n_splits must be an integer >= 2, got {n_splits!r}")
    if n_groups < 2:
        raise ValueError(
            f"all samples come from {n_groups} sequence; grouped cross-validation needs at least 2 "
            "sequences, because no sequence may be on both sides of a split"
        )
    if n_groups < n_splits:
        raise ValueError(f"{n_splits} folds need at least {n_splits} sequences, got {n_groups}")
    return list(GroupKFold(n_splits=n_splits).split(np.zeros(len(groups)), groups=groups))


def extrapolation_splits(
    groups: Int[np.ndarray, " n"], position: Int[np.ndarray, " n"], boundary: int, n_splits: int = 5
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Grouped splits that fit on positions < ``boundary`` and score on positions >= ``boundary``.

    Within each GroupKFold fold, the fitting side keeps only its tokens before ``boundary`` and
    the scoring side only its tokens at or after it, so the question is whether the linear
    readout keeps counting past what it was fitted on, on sequences it never saw.

    Raises:
        ValueError: if no token lies on one side of ``boundary``, or as :func:`sequence_splits`.
    """
    position = np.asarray(position)
    if not (position < boundary).any() or not (position >= boundary).any():
        raise ValueError(
            f"boundary {boundary} leaves no token on one side (positions span {position.min()}..{position.max()})"
        )
    return [
        (fit[position[fit] < boundary], score[position[score] >= boundary])
        for fit, score in sequence_splits(groups, n_splits)
    ]


def out_of_fold_predictions(
    estimator,
    X: np.ndarray,
    y: np.ndarray,
    splits: Iterable[tuple[np.ndarray, np.ndarray]],
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Fit a fresh clone of ``estimator`` on each fitting side and predict its scoring side.

    With ``groups`` (sequence ids ``[n]``), a :class:`~nopelens.probes.ridge.GroupedRidgeCV`
    (alone or as a pipeline's ``linear`` step) gets the fitting side's groups for its inner CV.

    Returns:
        (scored sample indices ``[m]``, predictions ``[m]``), concatenated over folds.
    """
    index, preds = [], []
    for fit, score in splits:
        if len(fit) == 0 or len(score) == 0:
            raise ValueError("a split has an empty side")
        model = clone(estimator).fit(X[fit], y[fit], **_group_params(estimator, groups, fit))
        index.append(score)
        preds.append(model.predict(X[score]))
    return np.concatenate(index), np.concatenate(preds)


def _group_params(estimator, groups, fit) -> dict:
    if groups is None:
        return {}
    if isinstance(estimator, GroupedRidgeCV):
        return {"groups": np.asarray(groups)[fit]}
    if isinstance(estimator, Pipeline) and isinstance(estimator.steps[-1][1], GroupedRidgeCV):
        return {f"{estimator.steps[-1][0]}__groups": np.asarray(groups)[fit]}
    return {}


def probe_features(
    X: Float[np.ndarray, "n d"],
    y: np.ndarray,
    groups: Int[np.ndarray, " n"],
    task: str,
    token_types: np.ndarray | None = None,
    splits: list[tuple[np.ndarray, np.ndarray]] | None = None,
    n_splits: int = 5,
    classifier: str = "lda",
    controls: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    dtype=None,
    device: str = "cpu",
    baselines: list | None = None,
) -> pd.DataFrame:
    """Probe one feature matrix for one target, with controls; tidy rows without site columns.

    Regression and LDA probes of the target, the control task and the shuffled labels are fitted
    together from shared per-fold statistics (:func:`~nopelens.probes.fitting.fit_folds`); the
    other classifiers go through :func:`make_probe` pipelines fold by fold.

    Args:
        X: features ``[n, d]``.
        y: targets ``[n]`` (int classes for classification).
        groups: sequence id of each sample ``[n]`` (CV groups and bootstrap units).
        task: ``classification`` or ``regression``.
        token_types: ``[n]`` or ``[n, k]`` token types for the control task and the
            token-identity ceiling; required when ``controls``.
        splits: explicit (fit, score) splits, grouped by sequence; default :func:`sequence_splits`.
        n_splits: folds when ``splits`` is None.
        classifier: ``lda``, ``ridge`` or ``logistic`` (see :func:`make_probe`).
        controls: also run control task, shuffled labels, majority and token identity.
        n_boot: bootstrap replicates for the CIs.
        seed: seed of the control labels, shuffling and bootstrap.
        dtype: the dtype the activations were computed in (``"bfloat16"``, ...), which sets the
            round-off resolution below which a feature counts as constant; default ``X.dtype``.
        device: torch device for the regression and LDA algebra (``"cpu"``: float64; an
            accelerator such as ``"cuda"``: float64 too, see
            :func:`~nopelens.probes.fitting.fit_folds` for float32).
        baselines: :func:`baseline_runs` of the same target, groups, splits and seed, shared by
            the feature matrices probed for it; None: computed here.

    Returns:
        DataFrame with columns ``probe, metric, value, ci_low, ci_high, selectivity, n_samples,
        n_sequences, chance, alpha, alpha_at_edge`` (see :data:`RESULT_COLUMNS`). A metric that is
        undefined on a run has no row: Spearman of constant predictions (the majority baseline,
        or a linear probe on features that carry nothing, such as a head whose W_Q is zero).
        When every sample has the same token type, the control task (one random label per type)
        is undefined: it has no row and ``selectivity`` is NaN; the other controls still run.

    Raises:
        ValueError: on mismatched shapes, non-finite features, a single sequence or too few
            sequences for the folds, a missing ``token_types`` with controls, or (ridge and LDA)
            explicit ``splits`` whose fitting sides are not made of whole sequences.
    """
    X, y, groups = np.asarray(X), np.asarray(y), np.asarray(groups)
    if X.ndim != 2 or len(X) != len(y) or len(y) != len(groups):
        raise ValueError(f"X [n, d], y [n] and groups [n] do not match: {X.shape}, {y.shape}, {groups.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError("features contain NaN or Inf")
    if task == "classification" and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"classification targets must be integers, got dtype {y.dtype}")
    if controls and token_types is None:
        raise ValueError("controls need token_types (token ids of the samples)")
    splits = sequence_splits(groups, n_splits) if splits is None else splits
    if not np.issubdtype(X.dtype, np.floating):
        X = X.astype(np.float64)
    dtype = str(X.dtype) if dtype is None else _coarser(str(dtype), str(X.dtype))
    labels = probe_labels(y, token_types, controls, seed)
    fitted = _fit_all(X, labels, groups, splits, task, classifier, seed, dtype, device)
    return score_probes(fitted, labels, groups, splits, task, token_types, controls, n_boot, seed, baselines)


def probe_labels(
    y: np.ndarray, token_types: np.ndarray | None, controls: bool = True, seed: int = 0
) -> dict[str, np.ndarray]:
    """The targets a site's probes fit: probe name -> ``[n]`` labels.

    ``linear``: ``y``; with ``controls``, ``control`` (Hewitt & Liang's control task,
    :func:`~nopelens.probes.targets.control_labels`; absent when every sample has the same token
    type) and ``shuffled`` (:func:`~nopelens.probes.targets.shuffled_labels`). All are known before
    any activation is read, so a streamed run fits them from the same statistics.
    """
    labels = {"linear": y}
    if controls:
        types = np.asarray(token_types)
        if not (types == types[:1]).all():  # one token type: the control task is undefined
            labels["control"] = control_labels(token_types, y, seed=seed)
        labels["shuffled"] = shuffled_labels(y, seed=seed)
    return labels


def fitted_probes(fit, labels: dict[str, np.ndarray]) -> dict:
    """probe name -> (scored index, out-of-fold predictions, median chosen alpha, alpha at an edge),
    from a :class:`~nopelens.probes.fitting.FoldFit` of ``labels`` (in their order)."""
    return {
        name: (fit.index, fit.predictions[t], _median(fit.alphas[t]), fit.at_edge[t]) for t, name in enumerate(labels)
    }


def score_probes(
    fitted: dict,
    labels: dict[str, np.ndarray],
    groups: np.ndarray,
    splits,
    task: str,
    token_types: np.ndarray | None,
    controls: bool = True,
    n_boot: int = 1000,
    seed: int = 0,
    baselines: list | None = None,
) -> pd.DataFrame:
    """The tidy rows of :func:`probe_features` from out-of-fold predictions.

    Scores every fitted probe with bootstrap CIs over sequences, adds the ``majority`` and
    ``token_identity`` baselines (they read no features) and selectivity.

    Args:
        fitted: from :func:`fitted_probes` (or :func:`_fit_all`).
        labels: from :func:`probe_labels`; ``labels["linear"]`` is the target.
        groups, splits, task, token_types, controls, n_boot, seed: as :func:`probe_features`.
        baselines: :func:`baseline_runs` of the same arguments, when several feature matrices
            share them (they read no features); None: computed here.
    """
    y = labels["linear"]
    metrics = metric_names(task)
    runs = []
    for name, (index, pred, alpha, edge) in fitted.items():
        # controls are scored against their own labels (control task) or the true ones (others)
        truth = labels[name][index] if name == "control" else y[index]
        runs.append((name, _scores(truth, pred, groups[index], metrics, n_boot, seed), index, truth, alpha, edge))
    if controls:
        runs += baseline_runs(y, groups, splits, task, token_types, n_boot, seed) if baselines is None else baselines

    control = {run[0]: run[1] for run in runs}.get("control")
    rows = []
    for name, scores, index, truth, alpha, edge in runs:
        n_sequences = len(np.unique(groups[index]))
        for metric, (value, low, high) in scores.items():
            selectivity = np.nan
            if name == "linear" and control is not None and metric in control and HIGHER_IS_BETTER[metric]:
                selectivity = value - control[metric][0]
            rows.append(
                dict(
                    probe=name,
                    metric=metric,
                    value=value,
                    ci_low=low,
                    ci_high=high,
                    selectivity=selectivity,
                    n_samples=len(index),
                    n_sequences=n_sequences,
                    chance=mad_chance_of(truth) if metric == "mad" else np.nan,
                    alpha=alpha,
                    alpha_at_edge=edge,
                )
            )
    return pd.DataFrame(rows)


def baseline_runs(
    y: np.ndarray, groups: np.ndarray, splits, task: str, token_types: np.ndarray, n_boot: int, seed: int
) -> list[tuple]:
    """The scored ``majority`` and ``token_identity`` baselines of :func:`score_probes` (arguments
    as there): they read no features, so every site probed for the same target shares them."""
    metrics = metric_names(task)
    dummy = DummyClassifier(strategy="most_frequent") if task == "classification" else DummyRegressor()
    index, pred = out_of_fold_predictions(dummy, np.zeros((len(y), 1)), y, splits)  # it never reads X
    runs = [("majority", _scores(y[index], pred, groups[index], metrics, n_boot, seed), index, y[index], np.nan, False)]
    index = np.concatenate([score for _, score in splits])
    pred = token_identity_predictions(np.asarray(token_types)[index], y[index], task)
    runs.append(
        (
            "token_identity",
            _scores(y[index], pred, groups[index], metrics, n_boot, seed),
            index,
            y[index],
            np.nan,
            False,
        )
    )
    return runs


def _scores(truth, pred, groups, metrics, n_boot, seed):
    return bootstrap_scores(truth, pred, groups, metrics, n_boot, seed=seed, skip_undefined=True)


def _median(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    return float(np.median(values)) if len(values) else np.nan


def _fit_all(X, labels: dict, groups, splits, task, classifier, seed, dtype, device) -> dict:
    """probe name -> (scored index, out-of-fold predictions, median chosen alpha, alpha at an edge)."""
    if task == "regression" or classifier == "lda":
        fit = fit_folds(X, list(labels.values()), groups, splits, task, dtype=dtype, device=device)
        return fitted_probes(fit, labels)
    return pipeline_fits(X, labels, groups, splits, classifier, seed, dtype)


CLASSIFIERS = ("lda", "ridge", "logistic")
"""The classifiers of a classification probe (:func:`make_probe`)."""


def check_classifier(classifier: str) -> None:
    """Raises:
    ValueError: for a classifier not in :data:`CLASSIFIERS`."""
    if classifier not in CLASSIFIERS:
        raise ValueError(f"classifier must be 'lda', 'ridge' or 'logistic', got {classifier!r}")


def pipeline_fits(X: np.ndarray, labels: dict, groups, splits, classifier: str, seed: int, dtype) -> dict:
    """Classification of every label set of ``labels`` by the :func:`make_probe` pipeline of
    ``classifier`` (``ridge``, ``logistic``: they read the features themselves, not their
    statistics), fold by fold: probe name -> (scored index, out-of-fold predictions, NaN, False)."""
    probe = make_probe("classification", classifier, seed=seed, dtype=dtype)
    return {
        name: (*out_of_fold_predictions(probe, X, target, splits, groups), np.nan, False)
        for name, target in labels.items()
    }


def position_classes(position: Int[np.ndarray, " n"], max_classes: int | None) -> tuple[np.ndarray, str]:
    """Classes of an absolute-index classification, and the target name the table gives them.

    With at most ``max_classes`` positions (or ``max_classes`` None), each position is its class
    (``"absolute_index"``). Otherwise positions are cut into bins of equal width
    W = ceil(n_positions / max_classes), class = position // W, and the target is named
    ``"absolute_index//W"``: a probe then says which W-token stretch a token sits in, and its
    ``mad`` and ``within_one`` rows count in bins (the regression rows keep positions).

    Raises:
        ValueError: if ``max_classes`` < 2.

    Example:
        >>> y, name = position_classes(np.arange(2048), 64)
        >>> name, int(y.max()), y[:3].tolist(), y[-1].item()
        ('absolute_index//32', 63, [0, 0, 0], 63)
        >>> position_classes(np.arange(64), 64)[1]
        'absolute_index'
    """
    position = np.asarray(position)
    if max_classes is not None and (not isinstance(max_classes, (int, np.integer)) or max_classes < 2):
        raise ValueError(f"max_classes must be an integer >= 2, got {max_classes!r}")
    n_positions = int(position.max()) + 1
    if max_classes is None or n_positions <= max_classes:
        return position, "absolute_index"
    width = -(-n_positions // max_classes)
    return position // width, f"absolute_index//{width}"


def _coarser(a: str, b: str) -> str:
    """The dtype with the larger round-off of two (a product is no finer than its factors)."""
    return a if roundoff_tolerance(a) >= roundoff_tolerance(b) else b


def _label(frame: pd.DataFrame, site: str, target: str, task: str, features: str, split: str) -> pd.DataFrame:
    layer = site_layer(site)
    block = site_block(site)
    return frame.assign(
        site=site,
        layer=np.nan if layer is None else layer,
        block=np.nan if block is None else block,
        target=target,
        task=task,
        features=features,
        split=split,
    )


def _tidy(frames: list[pd.DataFrame]) -> pd.DataFrame:
    if not frames:
        raise ValueError("nothing to probe: no sites or tasks given")
    table = pd.concat(frames, ignore_index=True)
    table["layer"] = table["layer"].astype("Int64")
    table["block"] = table["block"].astype("Int64")
    return table[list(RESULT_COLUMNS)]
