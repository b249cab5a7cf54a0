"""Probe fitting at the speed of the linear algebra: every fold, target and ridge penalty of one site
from shared per-block statistics.

A site's probes (the main target, the control task, the shuffled labels) all see the same
features ``X`` and the same grouped folds. So the samples are cut once into *blocks* (the scored
sides of the grouped folds; every fitting side is a union of blocks), and each block contributes
its count, feature sums, Gram matrix ``X_b^T X_b`` and ``X_b^T Y_b`` once. Every fitting side's
standardization (``StandardScaler`` semantics, fitted on that side only), ridge normal equations
and pooled LDA covariance is a sum of block statistics, so the whole site costs one pass over
``X`` (about one ``X^T X``) plus d x d algebra per fold.

Ridge penalties are chosen by grouped cross-validation inside the fitting side: the inner folds
are the fitting side's own blocks (whole sequences), each inner fit standardizes its own fitting
set, and each inner fit is one eigendecomposition ``C = U diag(e) U^T`` of its standardized
centered Gram matrix, which gives the validation error of every penalty on the grid at once:
with ``p = U^T b`` and the validation block's second moments ``Q = U^T M U`` and ``r = U^T m`` in
the same basis, the weights are ``p / (e + alpha)`` and the validation sum of squares is
``s0 - 2 r . (p / (e + alpha)) + (p / (e + alpha))^T Q (p / (e + alpha))``. The penalty with
the lowest mean validation MSE over the inner folds wins (ties: the smallest), exactly as
``GridSearchCV(Pipeline(StandardScaler, Ridge), {"ridge__alpha": grid}, cv=inner_folds,
scoring="neg_mean_squared_error")`` on the fitting side; tests check the choice and the
predictions against scikit-learn on the same folds. The inner fit on "all blocks but k and j"
serves outer fold k and outer fold j alike, so K folds cost K (K - 1) / 2 eigendecompositions.

Float round-off is not signal (issue 10 §1): a feature whose whole spread on the fitting side is
at the numerical resolution of the activations' dtype and scale (:func:`roundoff_tolerance`) is
treated as constant (its standardized value is 0), in the fast path and in
:class:`RoundoffScaler` alike.

All the algebra runs in torch (float64 on CPU; float32 or float64 on an accelerator, see
``device``), so wide activations can be probed on a GPU with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin, TransformerMixin
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted, check_X_y

ALPHAS = tuple(float(a) for a in np.logspace(-3, 6, 28))
"""Ridge penalties tried by the grouped inner cross-validation: 1e-3 .. 1e6, 28 values (three per
decade). On standardized features the useful range runs from "no penalty" (a penalty far below
the smallest eigenvalue of the Gram matrix of thousands of samples) to "predict the mean"."""

STORED_ULPS = 8
"""Round-off allowance, in units of the activations' own dtype: each stored activation is rounded
to that dtype, and a few such roundings pile up through a block."""

COMPUTE_ULPS = 256
"""Round-off allowance, in units of float32 (or of the activations' dtype when finer): the
arithmetic between stored values accumulates error over sums of many terms, growing with the
context. Measured with :func:`signal_mask`'s scale on constant input (no BOS), where exact
arithmetic gives every position the same state: at most 40 float32 units on 8-layer decoders at
64 positions and 78 on 4-layer ones at 1024 positions; real position features are millions of
float32 units wide (and 60+ units of bfloat16)."""


def roundoff_tolerance(dtype) -> float:
    """Relative numerical resolution of activations computed and stored in ``dtype``.

    ``STORED_ULPS * eps(dtype) + COMPUTE_ULPS * min(eps(dtype), eps(float32))``: a feature whose
    spread (max - min) is at most this times its scale carries no signal. Works for the dtypes
    numpy lacks (``bfloat16``).

    Args:
        dtype: a torch or numpy dtype, or its name (``"float32"``, ``"bfloat16"``, ``"float16"``).

    Raises:
        ValueError: on a dtype that is not floating point.

    Example:
        >>> round(roundoff_tolerance("float32") / float(np.finfo(np.float32).eps))
        264
        >>> round(roundoff_tolerance("bfloat16"), 6)
        0.062531
    """
    eps = _eps(dtype)
    return STORED_ULPS * eps + COMPUTE_ULPS * min(eps, float(np.finfo(np.float32).eps))


def _eps(dtype) -> float:
    name = str(dtype).removeprefix("torch.")
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"activations must have a floating-point dtype, got {dtype!r}")
    return float(torch.finfo(torch_dtype).eps)


def signal_mask(high, low, dtype):
    """Features whose spread is above the round-off resolution of ``dtype`` and their scale.

    A feature's scale is the larger of its own largest magnitude and the typical (median)
    largest magnitude of all features, so a feature near zero computed from larger ones is
    judged at their scale.

    Args:
        high, low: per-feature max and min ``[d]`` (numpy or torch).
        dtype: dtype the activations were computed in (see :func:`roundoff_tolerance`).

    Returns:
        bool ``[d]``: True for features that may carry signal.
    """
    lib = torch if isinstance(high, torch.Tensor) else np
    magnitude = lib.maximum(lib.abs(high), lib.abs(low))
    if magnitude.shape[0] == 0:
        return magnitude > 0
    typical = magnitude.median() if lib is torch else np.median(magnitude)
    scale = lib.maximum(magnitude, typical)
    return (high - low) > roundoff_tolerance(dtype) * scale


class RoundoffScaler(TransformerMixin, BaseEstimator):
    """``StandardScaler`` that zeroes features whose spread is only float round-off.

    Fitted like ``StandardScaler`` (mean and population standard deviation of the fitting side);
    a feature whose fitting-side spread is within :func:`roundoff_tolerance` of ``dtype`` times
    its scale (:func:`signal_mask`) is constant for the probe: its transformed value is 0, so
    ``StandardScaler`` cannot blow 1e-7 differences up to unit variance (issue 10 §1).

    Attributes:
        mean_, scale_: as ``StandardScaler``'s (transform = (x - mean_) / scale_); ``scale_`` is
            ``inf`` for the features judged constant.
        signal_: bool ``[d]``, the features kept.

    Args:
        dtype: the dtype the activations were computed in (the model's), e.g. ``"bfloat16"``;
            ``None`` uses the dtype of the array given to ``fit``.
    """

    def __init__(self, dtype=None):
        self.dtype = dtype

    def fit(self, X, y=None):
        X = np.asarray(X)
        dtype = X.dtype if self.dtype is None else self.dtype
        scaler = StandardScaler().fit(X)
        self.signal_ = signal_mask(X.max(0).astype(np.float64), X.min(0).astype(np.float64), dtype)
        self.mean_ = scaler.mean_
        self.scale_ = np.where(self.signal_, scaler.scale_, np.inf)  # (x - mean) / inf = 0: constant
        self.n_features_in_ = X.shape[1]
        return self

    def transform(self, X):
        check_is_fitted(self)
        return (np.asarray(X, dtype=np.float64) - self.mean_) / self.scale_


# ----------------------------------------------------------------------------- block statistics


@dataclass
class _Blocks:
    """Per-block statistics of one feature matrix (features shifted by one global constant)."""

    index: list[slice]  # rows of each block (X sorted by block)
    count: torch.Tensor  # [B]
    total: torch.Tensor  # [B, d] feature sums
    gram: torch.Tensor  # [B, d, d]
    high: torch.Tensor  # [B, d] raw max
    low: torch.Tensor  # [B, d] raw min
    members: list[list[int]]  # blocks of each fitting side


def _as_tensor(X, device, dtype) -> torch.Tensor:
    X = torch.as_tensor(np.ascontiguousarray(X) if isinstance(X, np.ndarray) else X)
    return X.to(device=device, dtype=dtype)


def fold_blocks(splits: Sequence[tuple[np.ndarray, np.ndarray]], groups: np.ndarray) -> tuple[list[np.ndarray], list[list[int]]]:
    """Cut the samples into blocks such that every fitting side is a union of >= 2 whole blocks.

    Samples in the same fitting sides form one block (for GroupKFold: the scored side of each
    fold). When a fitting side holds fewer than two blocks (two folds), every block is halved
    by sequence, so the inner cross-validation always has at least two grouped folds.

    Returns:
        (sample indices of each block, block numbers of each fitting side).

    Raises:
        ValueError: if a sequence lies in two blocks (splits not grouped by sequence), or a
            fitting side cannot be cut into two groups of sequences.
    """
    n = len(groups)
    signature = np.zeros((n, len(splits)), dtype=bool)
    for k, (fit, _) in enumerate(splits):
        signature[np.asarray(fit), k] = True
    used = signature.any(1)
    packed = np.packbits(signature[used], axis=1)  # one row of bytes per sample: unique on a void view is fast
    codes = np.ascontiguousarray(packed).view(np.dtype((np.void, packed.shape[1]))).ravel()
    _, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    keys = signature[used][first]
    samples = np.flatnonzero(used)
    order = np.argsort(inverse, kind="stable")
    blocks = np.split(samples[order], np.cumsum(np.bincount(inverse))[:-1])
    members = [[b for b in range(len(keys)) if keys[b, k]] for k in range(len(splits))]
    if min(len(m) for m in members) < 2:
        halves = []
        for block in blocks:
            if len(np.unique(groups[block])) < 2:
                raise ValueError("a fitting side has too few sequences for a grouped inner cross-validation")
            halves += [block[part] for _, part in GroupKFold(2).split(block, groups=groups[block])]
        blocks = halves
        members = [[2 * b + h for b in m for h in (0, 1)] for m in members]
    owner = {}
    for b, block in enumerate(blocks):
        for g in np.unique(groups[block]):
            if owner.setdefault(g, b) != b:
                raise ValueError(f"sequence {g} lies on two fitting blocks; the splits are not grouped by sequence")
    return blocks, members


def _block_stats(X: torch.Tensor, raw, bounds, members) -> _Blocks:
    """Statistics of the blocks ``X[bounds[b]:bounds[b + 1]]`` (X sorted by block, shifted);
    ``raw`` is the same rows unshifted (numpy or torch) for the per-feature extremes."""
    d, dtype, B = X.shape[1], X.dtype, len(bounds) - 1
    count = torch.tensor(np.diff(bounds), dtype=dtype, device=X.device)
    total = torch.zeros(B, d, dtype=dtype, device=X.device)
    gram = torch.zeros(B, d, d, dtype=dtype, device=X.device)
    high = torch.zeros(B, d, dtype=dtype, device=X.device)
    low = torch.zeros(B, d, dtype=dtype, device=X.device)
    index = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    for b, rows in enumerate(index):
        Xb = X[rows]
        total[b], gram[b] = Xb.sum(0), _gram(Xb)
        extremes = (raw[rows].max(0), raw[rows].min(0))
        if isinstance(raw, torch.Tensor):
            extremes = (extremes[0].values, extremes[1].values)
        high[b], low[b] = (torch.as_tensor(np.asarray(e) if not isinstance(e, torch.Tensor) else e).to(X.device, dtype)
                           for e in extremes)
    return _Blocks(index, count, total, gram, high, low, members)


# ----------------------------------------------------------------------------- fold engine


@dataclass
class FoldFit:
    """Out-of-fold predictions of several targets, with what each fold chose."""

    index: np.ndarray  # [m] scored samples, concatenated over folds
    predictions: list[np.ndarray]  # per target [m]
    alphas: list[np.ndarray]  # per target [n_folds] chosen ridge penalty (empty for LDA; NaN: no feature kept)
    at_edge: list[bool]  # per target: some fold chose the smallest or largest penalty
    n_signal: np.ndarray  # [n_folds] features above round-off on each fitting side


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
    (module docstring). ``classification``: ``StandardScaler`` + :class:`PooledLDA`. Features at
    round-off resolution are zeroed on each fitting side (:class:`RoundoffScaler`).

    Args:
        X: features ``[n, d]`` (numpy or torch).
        targets: ``[n]`` arrays (values, or integer classes), all fitted on the same folds.
        groups: sequence id of each sample ``[n]``.
        splits: (fit, score) index pairs, grouped by sequence.
        task: ``regression`` or ``classification``.
        dtype: dtype the activations were computed in; default ``X``'s.
        alphas: ridge penalty grid (ascending).
        shrinkage: :class:`PooledLDA` shrinkage.
        device: torch device for the algebra (``"cpu"``, ``"cuda"``, ...). CUDA is optional.
        compute_dtype: float64 by default; float32 allowed on an accelerator only (the
            round-off test and the Gram sums then carry float32 error).

    Returns:
        :class:`FoldFit`.

    Raises:
        ValueError: on bad splits (empty side, not grouped), fewer than 2 classes on a fitting
            side, an unknown task, or float32 algebra on CPU.
    """
    if task not in ("regression", "classification"):
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")
    dtype = (X.dtype if dtype is None else dtype)
    compute_dtype = compute_dtype or torch.float64
    if torch.device(device).type == "cpu" and compute_dtype != torch.float64:
        raise ValueError(f"probe algebra runs in float64 on CPU; {compute_dtype} is only for accelerators")
    alphas = np.asarray(sorted(alphas), dtype=np.float64)
    for fit, score in splits:
        if len(fit) == 0 or len(score) == 0:
            raise ValueError("a split has an empty side")
    groups = np.asarray(groups)
    blocks, members = fold_blocks(splits, groups)
    # rows sorted by block (then the rows no fitting side uses), so every block is a slice
    rest = np.setdiff1d(np.arange(len(groups)), np.concatenate(blocks))
    order = np.concatenate(blocks + [rest])
    where = np.empty_like(order)
    where[order] = np.arange(len(order))
    raw = X[torch.as_tensor(order)] if isinstance(X, torch.Tensor) else np.asarray(X)[order]
    Xs = _as_tensor(raw, device, compute_dtype)
    Xs -= Xs.mean(0)  # a global shift changes nothing mathematically and keeps Gram sums precise
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
    stats = _block_stats(Xs, raw, bounds, members)
    fold = _Ridge if task == "regression" else _LDA
    engine = fold(Xs, [np.asarray(t)[order] for t in targets], stats, dtype, alphas, shrinkage)
    index, preds, chosen, n_signal = [], [[] for _ in targets], [[] for _ in targets], []
    for k, (_, score) in enumerate(splits):
        out, alpha, kept = engine.fold(k, _slice_if_contiguous(where[np.asarray(score)]))
        index.append(np.asarray(score))
        n_signal.append(kept)
        for t in range(len(targets)):
            preds[t].append(out[t])
            if alpha is not None:
                chosen[t].append(alpha[t])
    chosen = [np.asarray(c) for c in chosen]
    at_edge = [bool(len(c) and ((c == alphas[0]) | (c == alphas[-1])).any()) for c in chosen]
    return FoldFit(np.concatenate(index), [np.concatenate(p) for p in preds], chosen, at_edge, np.asarray(n_signal))


class _Side:
    """Standardization of one fitting side (a set of blocks), StandardScaler semantics."""

    def __init__(self, stats: _Blocks, blocks: list[int], dtype):
        sel = torch.as_tensor(blocks, device=stats.count.device)
        self.n = stats.count[sel].sum()
        self.total = stats.total[sel].sum(0)
        self.gram = stats.gram[sel].sum(0)
        self.mean = self.total / self.n
        high, low = stats.high[sel].max(0).values, stats.low[sel].min(0).values
        self.keep = signal_mask(high, low, dtype)
        scatter = self.gram - self.n * torch.outer(self.mean, self.mean)
        var = torch.clamp(torch.diagonal(scatter) / self.n, min=0)
        self.inv_sd = torch.where(self.keep, 1 / torch.sqrt(torch.where(var > 0, var, 1)), 0)


class _Ridge:
    """Ridge on standardized features; penalties by grouped inner CV, one eigendecomposition per
    inner fitting set. Each inner fit standardizes its own fitting set (as ``GridSearchCV`` over a
    ``Pipeline(StandardScaler, Ridge)`` does), so the inner fit "all blocks but k and j" is the same
    for outer fold k (validating on j) and outer fold j (validating on k), and is factorized once."""

    def __init__(self, X, targets, stats: _Blocks, dtype, alphas, shrinkage):
        self.X, self.stats, self.dtype = X, stats, dtype
        self.alphas = torch.as_tensor(alphas, dtype=X.dtype, device=X.device)
        Y = torch.as_tensor(np.stack(targets, 1), dtype=X.dtype, device=X.device)
        self.n_targets = Y.shape[1]
        self.xty = torch.stack([_cross(X[_rows(i, X)], Y[_rows(i, X)]) for i in stats.index])
        self.ysum = torch.stack([Y[_rows(i, X)].sum(0) for i in stats.index])
        self.yy = torch.stack([(Y[_rows(i, X)] ** 2).sum(0) for i in stats.index])
        self._factors: dict[frozenset, tuple] = {}

    def _side(self, blocks):
        """Own standardization and normal equations of a fitting set of blocks."""
        side = _Side(self.stats, blocks, self.dtype)
        sel = torch.as_tensor(blocks, device=self.X.device)
        ybar = self.ysum[sel].sum(0) / side.n
        keep, D = side.keep, side.inv_sd[side.keep]
        scatter = _sub(side.gram - side.n * torch.outer(side.mean, side.mean), keep)
        cross = self.xty[sel].sum(0) - torch.outer(side.mean, self.ysum[sel].sum(0))
        cross = cross if bool(keep.all()) else cross[keep]
        return side, ybar, D[:, None] * scatter * D[None, :], D[:, None] * cross

    def _factor(self, blocks):
        key = frozenset(blocks)
        if key not in self._factors:
            side, ybar, C, b = self._side(sorted(blocks))
            e, U = torch.linalg.eigh(C)
            self._factors[key] = (side, ybar, e, U, U.T @ b)
        return self._factors[key]

    def _validation_mse(self, fit_blocks, val: int):
        """Validation MSE of block ``val`` for every penalty ``[A, t]``, from the fit on ``fit_blocks``."""
        side, ybar, e, U, p = self._factor(fit_blocks)
        s, m, keep = self.stats, side.mean, side.keep
        nv, sv, sy = s.count[val], s.total[val], self.ysum[val]
        s0 = self.yy[val] - 2 * ybar * sy + nv * ybar**2
        if not keep.any():
            return (s0 / nv).expand(len(self.alphas), -1)
        M = s.gram[val] - torch.outer(sv, m) - torch.outer(m, sv) + nv * torch.outer(m, m)
        R = self.xty[val] - torch.outer(sv, ybar) - torch.outer(m, sy) + nv * torch.outer(m, ybar)
        UD = side.inv_sd[keep][:, None] * U
        A, t = len(self.alphas), p.shape[1]
        c = p[None] / (e[None, :, None] + self.alphas[:, None, None])  # [A, d, t] in the eigenbasis
        w = (UD @ c.permute(1, 0, 2).reshape(len(e), A * t))  # [d_kept, A*t] weights on unscaled features
        Mk, Rk = _sub(M, keep), (R if bool(keep.all()) else R[keep])
        quad = (w * (Mk @ w)).sum(0).reshape(A, t)
        lin = (w.reshape(-1, A, t) * Rk[:, None, :]).sum(0)
        sse = s0[None] - 2 * lin + quad
        return sse / nv

    def solve(self, k: int):
        """Fit fitting side ``k`` (penalty by inner CV over its blocks): (side, target means [t],
        weights [d_kept, t] on standardized features, alphas [t])."""
        inner = self.stats.members[k]
        mse = sum(self._validation_mse([b for b in inner if b != j], j) for j in inner)
        alpha = self.alphas[torch.argmin(mse, dim=0)]  # first minimum: the smallest penalty on ties
        side, ybar, C, b = self._side(inner)
        W = torch.zeros(C.shape[0], self.n_targets, dtype=C.dtype, device=C.device)
        if not side.keep.any():  # nothing to penalize: the fit is the mean, and no penalty was chosen
            return side, ybar, W, torch.full_like(alpha, float("nan"))
        eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
        for value in torch.unique(alpha):
            columns = alpha == value
            W[:, columns] = torch.linalg.solve(C + value * eye, b[:, columns])
        return side, ybar, W, alpha

    def fold(self, k: int, score: np.ndarray):
        side, ybar, W, alpha = self.solve(k)
        weights = torch.zeros(self.X.shape[1], W.shape[1], dtype=W.dtype, device=W.device)
        weights[side.keep] = side.inv_sd[side.keep][:, None] * W  # on the unscaled (shifted) features
        pred = self.X[_rows(score, self.X)] @ weights + (ybar - side.mean @ weights)
        return [p.cpu().numpy() for p in pred.T], alpha.cpu().numpy(), int(side.keep.sum())


def _gram(X: torch.Tensor) -> torch.Tensor:
    """X^T X; on CPU through numpy, whose matmul sees the transpose and runs BLAS syrk (half the flops)."""
    if X.device.type == "cpu":
        A = X.numpy()
        return torch.from_numpy(A.T @ A)
    return X.T @ X


def _cross(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """X^T Y; on CPU through numpy (BLAS sees the transpose instead of copying it)."""
    if X.device.type == "cpu":
        return torch.from_numpy(X.numpy().T @ Y.numpy())
    return X.T @ Y


def _sub(M: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return M if bool(keep.all()) else M[keep][:, keep]


def _rows(index, X: torch.Tensor):
    return index if isinstance(index, slice) else torch.as_tensor(index, device=X.device)


def _slice_if_contiguous(rows: np.ndarray):
    if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return slice(int(rows[0]), int(rows[0]) + len(rows))
    return rows


class _LDA:
    def __init__(self, X, targets, stats: _Blocks, dtype, alphas, shrinkage):
        self.X, self.stats, self.dtype, self.shrinkage = X, stats, dtype, shrinkage
        self.targets = []
        for y in targets:
            classes, label = np.unique(y, return_inverse=True)
            label = torch.as_tensor(label.reshape(-1), device=X.device)
            sums = torch.zeros(len(stats.index), len(classes), X.shape[1], dtype=X.dtype, device=X.device)
            counts = torch.zeros(len(stats.index), len(classes), dtype=X.dtype, device=X.device)
            for b, index in enumerate(stats.index):
                i = _rows(index, X)
                sums[b].index_add_(0, label[i], X[i])
                counts[b] = torch.bincount(label[i], minlength=len(classes)).to(X.dtype)
            self.targets.append((classes, sums, counts))

    def fold(self, k: int, score: np.ndarray):
        blocks = self.stats.members[k]
        side = _Side(self.stats, blocks, self.dtype)
        keep, D = side.keep, side.inv_sd[side.keep]
        d_total = self.X.shape[1]
        sel = torch.as_tensor(blocks, device=self.X.device)
        Xk = self.X[_rows(score, self.X)][:, keep]
        Z = (Xk - side.mean[keep]) * D
        out = []
        for classes, sums, counts in self.targets:
            count = counts[sel].sum(0)
            present = count > 0
            if int(present.sum()) < 2:
                raise ValueError(f"need at least 2 classes, got {int(present.sum())}")
            count, total = count[present], sums[sel].sum(0)[present]
            means = total / count[:, None]  # raw (shifted) class means
            within = side.gram - (means.T * count) @ means
            cov = (D[:, None] * within[keep][:, keep] * D[None, :]) / side.n
            trace = torch.trace(cov)
            scale = trace / d_total if trace > 0 else torch.ones((), dtype=cov.dtype, device=cov.device)
            cov = cov + self.shrinkage * scale * torch.eye(len(D), dtype=cov.dtype, device=cov.device)
            mz = (means[:, keep] - side.mean[keep]) * D
            coef = torch.linalg.solve(cov, mz.T).T if len(D) else mz
            intercept = -0.5 * (mz * coef).sum(1) + torch.log(count / side.n)
            decision = Z @ coef.T + intercept
            out.append(classes[present.cpu().numpy()][decision.argmax(1).cpu().numpy()])
        return out, None, int(keep.sum())


class GroupedRidgeCV(RegressorMixin, BaseEstimator):
    """Ridge regression whose penalty is chosen by cross-validation grouped by sequence.

    The inner folds are ``GroupKFold(n_splits)`` over ``groups``; each penalty on ``alphas`` is
    scored by the mean validation MSE over the folds (ties: the smallest penalty), and the model
    is refit on all samples with the winner, exactly as
    ``GridSearchCV(Pipeline(StandardScaler, Ridge), {"alpha": alphas}, cv=GroupKFold(n_splits),
    scoring="neg_mean_squared_error")`` would: every fit standardizes its own fitting side (a
    no-op on features that are standardized already). Each inner fold costs one
    eigendecomposition, which serves every penalty (module docstring). Features without spread
    get weight 0.

    Args:
        alphas: penalty grid.
        n_splits: inner folds, >= 2.

    Attributes:
        coef_, intercept_, alpha_, alpha_at_edge_ (the winner is the smallest or largest penalty).
    """

    def __init__(self, alphas: Sequence[float] = ALPHAS, n_splits: int = 4):
        self.alphas = alphas
        self.n_splits = n_splits

    def fit(self, X, y, groups=None):
        """Fit; ``groups`` are sequence ids ``[n]`` (default: every sample its own group)."""
        X, y = check_X_y(X, y, dtype=np.float64, y_numeric=True)
        groups = np.arange(len(y)) if groups is None else np.asarray(groups)
        n_splits = min(self.n_splits, len(np.unique(groups)))
        if n_splits < 2:
            raise ValueError("GroupedRidgeCV needs at least 2 groups for its inner cross-validation")
        blocks = [score for _, score in GroupKFold(n_splits).split(X, groups=groups)]
        order = np.concatenate(blocks)
        raw = X[order]
        Xt = torch.as_tensor(raw)
        shift = Xt.mean(0)
        bounds = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
        stats = _block_stats(Xt - shift, raw, bounds, [list(range(len(blocks)))])
        alphas = np.asarray(sorted(self.alphas), dtype=np.float64)
        side, ybar, W, alpha = _Ridge(Xt - shift, [y[order]], stats, "float64", alphas, 0.0).solve(0)
        coef = torch.zeros(X.shape[1], dtype=torch.float64)
        coef[side.keep] = side.inv_sd[side.keep] * W[:, 0]
        self.coef_ = coef.numpy()
        self.intercept_ = float(ybar[0] - (side.mean + shift) @ coef)
        self.alpha_ = float(alpha[0])
        self.alpha_at_edge_ = self.alpha_ in (alphas[0], alphas[-1])
        self.n_features_in_ = X.shape[1]
        return self

    def predict(self, X):
        check_is_fitted(self)
        return np.asarray(X, dtype=np.float64) @ self.coef_ + self.intercept_
