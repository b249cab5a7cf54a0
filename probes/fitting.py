"""Probe fitting at the speed of the linear algebra: every fold, target and ridge penalty of one site
from shared per-block statistics (:mod:`nopelens.probes.moments`), ridge by grouped inner CV
(:mod:`nopelens.probes.ridge`), pooled LDA (:mod:`nopelens.probes.lda`), features at round-off
zeroed (:mod:`nopelens.probes.roundoff`). This module assembles them into every fold's fit and
out-of-fold predictions (:func:`fit_folds`), and keeps the names users import from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from nopelens.models.compat import moved_names

from .lda import _LDA, LDAFold
from .moments import (
    BlockMoments,
    FoldStatistics,
    _check_task,
    check_compute_dtype,
    fold_blocks,
    fold_statistics,
    target_moments,
)
from .ridge import ALPHAS, GroupedRidgeCV, RidgeFold, _Ridge, penalty_path, ridge_alphas, spd_solve
from .roundoff import COMPUTE_ULPS, STORED_ULPS, RoundoffScaler, roundoff_scale, roundoff_tolerance, signal_mask

__all__ = [
    "ALPHAS",
    "COMPUTE_ULPS",
    "STORED_ULPS",
    "BlockMoments",
    "FoldChoice",
    "FoldFit",
    "FoldStatistics",
    "GroupedRidgeCV",
    "LDAFold",
    "RidgeFold",
    "RoundoffScaler",
    "check_compute_dtype",
    "fit_folds",
    "fold_blocks",
    "fold_models",
    "fold_statistics",
    "penalty_path",
    "ridge_alphas",
    "roundoff_scale",
    "roundoff_tolerance",
    "signal_mask",
    "spd_solve",
    "target_moments",
]


@dataclass
class FoldFit:
    """Out-of-fold predictions of several targets, with what each fold chose."""

    index: np.ndarray  # [m] scored samples, concatenated over folds
    predictions: list[np.ndarray]  # per target [m]
    alphas: list[np.ndarray]  # per target [n_folds] chosen ridge penalty (empty for LDA; NaN: no feature kept)
    at_edge: list[bool]  # per target: some fold chose the smallest or largest penalty
    n_signal: np.ndarray  # [n_folds] features above round-off on each fitting side

    @classmethod
    def assemble(
        cls,
        splits,
        models: Sequence["RidgeFold | LDAFold"],
        predictions: Sequence[Sequence[np.ndarray]],
        alphas: np.ndarray,
    ) -> "FoldFit":
        """From each fold's model and its predictions of its scoring side (``predictions[k][t]``)."""
        n_targets = len(predictions[0]) if len(predictions) else 0
        chosen = [np.asarray([m.alpha[t] for m in models if m.alpha is not None]) for t in range(n_targets)]
        at_edge = [bool(len(c) and ((c == alphas[0]) | (c == alphas[-1])).any()) for c in chosen]
        return cls(
            np.concatenate([np.asarray(score) for _, score in splits]),
            [np.concatenate([p[t] for p in predictions]) for t in range(n_targets)],
            chosen,
            at_edge,
            np.asarray([m.n_signal for m in models]),
        )


@dataclass
class FoldChoice:
    """What one fold's fit chose, kept once its predictions are made and its weights dropped: the
    ridge penalty per target (None for LDA) and the features above round-off (:meth:`FoldFit.assemble`)."""

    alpha: np.ndarray | None
    n_signal: int


def fit_folds(
    X,
    targets: Sequence[np.ndarray],
    groups: np.ndarray,
    splits: Sequence[tuple[np.ndarray, np.ndarray]],
    task: str,
    dtype=None,
    alphas: Sequence[float] = ALPHAS,
    shrinkage: float = 1e-3,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype | None = None,
) -> FoldFit:
    """Fit and predict every fold for several targets of the same features.

    ``regression``: ``StandardScaler`` + ridge, penalty by grouped inner CV over ``alphas``
    (module docstring). ``classification``: ``StandardScaler`` + :class:`~nopelens.probes.linear.PooledLDA`. Features at
    round-off resolution are zeroed on each fitting side (:class:`RoundoffScaler`), and a pooled
    within-class covariance whose trace is at most what the kept features' round-off could give
    (each at :func:`roundoff_tolerance` times its scale) is zero, so LDA is then the nearest class
    mean (ties: the first class) instead of a read of round-off (``nopelens validate --seed 3``
    failed its BOS-and-constant-content row on that). This is
    :class:`BlockMoments` filled with every block at once, then :func:`fold_models`.

    Args:
        X: features ``[n, d]`` (numpy or torch).
        targets: ``[n]`` arrays (values, or integer classes), all fitted on the same folds.
        groups: sequence id of each sample ``[n]``.
        splits: (fit, score) index pairs, grouped by sequence.
        task: ``regression`` or ``classification``.
        dtype: dtype the activations were computed in; default ``X``'s.
        alphas: ridge penalty grid (ascending).
        shrinkage: :class:`~nopelens.probes.linear.PooledLDA` shrinkage.
        device: torch device for the algebra (``"cpu"``, ``"cuda"``, ...). CUDA is optional.
        compute_dtype: float64 by default; float32 allowed on an accelerator only (the
            round-off test and the Gram sums then carry float32 error).

    Returns:
        :class:`FoldFit`.

    Raises:
        ValueError: on bad splits (empty side, not grouped), fewer than 2 classes on a fitting
            side, an unknown task, or float32 algebra on CPU.
    """
    _check_task(task)
    dtype = X.dtype if dtype is None else dtype
    alphas = ridge_alphas(alphas)
    regression = task == "regression"
    stats = fold_statistics(
        X, groups, splits, targets if regression else (), () if regression else targets, device, compute_dtype
    )
    models = fold_models(stats.moments, stats.members, task, dtype, alphas, shrinkage)
    return FoldFit.assemble(splits, models, stats.predict(models, splits), alphas)


def fold_models(
    moments: BlockMoments,
    members: Sequence[Sequence[int]],
    task: str,
    dtype,
    alphas: Sequence[float] = ALPHAS,
    shrinkage: float = 1e-3,
) -> list["RidgeFold | LDAFold"]:
    """Fit every fold from its blocks' statistics: fold ``k`` fits on blocks ``members[k]``.

    Args:
        moments: per-block statistics (value targets for ``regression``, class targets for
            ``classification``).
        members: the blocks of each fitting side (from :func:`fold_blocks`).
        task: ``regression`` (ridge, penalty by grouped inner CV over the fitting side's blocks)
            or ``classification`` (:class:`~nopelens.probes.linear.PooledLDA`).
        dtype: dtype the activations were computed in (the round-off rule).
        alphas: ridge penalty grid.
        shrinkage: LDA shrinkage.

    Returns:
        One :class:`RidgeFold` or :class:`LDAFold` per fold.

    Raises:
        ValueError: on an unknown task, or fewer than 2 classes on a fitting side.
    """
    _check_task(task)
    alphas = ridge_alphas(alphas)
    engine = (
        _Ridge(moments, members, dtype, alphas) if task == "regression" else _LDA(moments, members, dtype, shrinkage)
    )
    return [engine.model(k) for k in range(len(members))]


__getattr__ = moved_names(__name__, moved={"GATHER_ELEMENTS": "nopelens.probes.moments"})
