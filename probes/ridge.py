"""Ridge probes from block statistics: the penalty path and the grouped inner cross-validation.

Ridge penalties are chosen by grouped cross-validation inside the fitting side: the inner folds
are the fitting side's own blocks (whole sequences, :func:`~nopelens.probes.moments.fold_blocks`),
and each inner fit standardizes its own fitting set. One factorization of an inner fit's
standardized centered Gram matrix ``C`` gives its ridge weights ``w(alpha) = (C + alpha I)^{-1} b``
for every penalty on the grid at once (:func:`penalty_path`: a Householder reduction ``C = Q T
Q^T`` to a tridiagonal ``T`` on CPU, after which each penalty is an O(d) tridiagonal solve; an
eigendecomposition on accelerators). The validation block's second moments ``M`` and ``m`` then
give its sum of squares ``s0 - 2 m . w + w^T M w`` for every penalty. The penalty with the lowest
mean validation MSE over the inner folds wins (ties: the smallest), exactly as
``GridSearchCV(Pipeline(StandardScaler, Ridge), {"ridge__alpha": grid}, cv=inner_folds,
scoring="neg_mean_squared_error")`` on the fitting side; tests check the choice and the
predictions against scikit-learn on the same folds. The inner fit on "all blocks but k and j"
serves outer fold k and outer fold j alike, so K folds cost K (K - 1) / 2 factorizations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.linalg import lapack
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.model_selection import GroupKFold
from sklearn.utils.validation import check_is_fitted, check_X_y

from .moments import BlockMoments, FittingSide, _block_sum, _sub, target_moments

ALPHAS = tuple(float(a) for a in np.logspace(-3, 6, 28))
"""Ridge penalties tried by the grouped inner cross-validation: 1e-3 .. 1e6, 28 values (three per
decade). On standardized features the useful range runs from "no penalty" (a penalty far below
the smallest eigenvalue of the Gram matrix of thousands of samples) to "predict the mean"."""


def ridge_alphas(alphas: Sequence[float]) -> np.ndarray:
    """A ridge penalty grid, checked and sorted ascending (float64).

    Args:
        alphas: penalties; each finite and > 0 (a penalty of 0 leaves the normal equations of
            collinear or constant features singular, and its validation error round-off).

    Returns:
        ``[A]`` float64, ascending.

    Raises:
        ValueError: on an empty grid, or a penalty that is not a finite number > 0.

    Example:
        >>> ridge_alphas([10, 0.1, 1]).tolist()
        [0.1, 1.0, 10.0]
    """
    grid = np.sort(np.asarray(alphas, dtype=np.float64).reshape(-1))
    if grid.size == 0 or not np.all(np.isfinite(grid)) or grid[0] <= 0:
        raise ValueError(f"ridge penalties must be finite numbers > 0 (at least one), got {list(np.asarray(alphas))}")
    return grid


@dataclass
class RidgeFold:
    """One fold's ridge fit: ``prediction = (x - shift) @ weights + offset`` for every target."""

    weights: torch.Tensor  # [d, t] on the shifted (unscaled) features
    offset: torch.Tensor  # [t]
    alpha: np.ndarray  # [t] chosen penalty (NaN: no feature kept)
    n_signal: int

    def predict(self, Xs: torch.Tensor) -> list[np.ndarray]:
        """Predictions ``[n]`` of each target for shifted features ``Xs`` ``[n, d]``."""
        pred = Xs @ self.weights + self.offset
        return [p.cpu().numpy() for p in pred.T]


def penalty_path(C: torch.Tensor, b: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """Ridge weights ``(C + alpha I)^{-1} b`` for every penalty of a grid, from one factorization.

    On CPU, ``C`` is reduced to tridiagonal form by Householder reflections, ``C = Q T Q^T``
    (LAPACK ``dsytrd``; Golub & Van Loan, *Matrix Computations*, 4th ed., Alg. 8.3.1). Then each
    penalty is one O(d) solve of the positive definite tridiagonal system ``(T + alpha I) z =
    Q^T b`` (LAPACK ``dptsv``) and its weights are ``Q z``: about 4/3 d^3 flops for the whole grid,
    a quarter of an eigendecomposition's time at d = 512 and 1024 on one CPU thread, and as
    backward stable (an eigendecomposition starts with the same reduction). On an accelerator,
    where torch offers no tridiagonal reduction, ``C = U diag(e) U^T`` and ``w = U (U^T b / (e +
    alpha))``.

    Args:
        C: ``[d, d]`` symmetric positive semi-definite (a standardized, centered Gram matrix);
            float64 on CPU.
        b: ``[d, t]`` right-hand sides.
        alphas: ``[A]`` penalties, each finite and > 0 (a tensor or a sequence).

    Returns:
        ``[A, d, t]`` weights, in ``C``'s dtype and device.

    Raises:
        ValueError: on a penalty that is not finite and > 0; on CPU, on ``C`` or ``b`` not in
            float64, or if round-off leaves ``C + alpha I`` singular.

    Example:
        >>> C = torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> b = torch.tensor([[2.0], [4.0]], dtype=torch.float64)
        >>> [round(v, 12) for v in penalty_path(C, b, [2.0])[0, :, 0].tolist()]  # b_i / (c_ii + 2)
        [0.5, 0.666666666667]
        >>> C = torch.tensor([[4.0, 2.0, 1.0], [2.0, 3.0, 0.5], [1.0, 0.5, 2.0]], dtype=torch.float64)
        >>> b = torch.tensor([[7.0], [5.5], [3.5]], dtype=torch.float64)
        >>> w = penalty_path(C, b, [1e-3, 1.0])
        >>> bool(torch.allclose(w[1], torch.linalg.solve(C + torch.eye(3, dtype=C.dtype), b)))
        True
    """
    alphas = torch.as_tensor(alphas, dtype=C.dtype, device=C.device)
    if not bool(torch.isfinite(alphas).all()) or bool((alphas <= 0).any()):
        raise ValueError(f"ridge penalties must be finite numbers > 0, got {alphas.tolist()}")
    d, t = b.shape
    if d == 0:
        return torch.zeros(len(alphas), 0, t, dtype=C.dtype, device=C.device)
    if C.device.type != "cpu":
        return _eigen_penalty_path(C, b, alphas)
    if C.dtype != torch.float64 or b.dtype != torch.float64:
        raise ValueError(f"penalty_path runs in float64 on CPU, got C {C.dtype} and b {b.dtype}")
    A = C.numpy().T  # C is symmetric: its transpose is C in the column-major order LAPACK takes, uncopied
    reflectors, diagonal, off, tau, _ = (
        lapack.dsytrd(A, lower=1, lwork=_sytrd_lwork(d))
        if d > 1
        else (A, np.diagonal(A).copy(), np.zeros(0), np.zeros(0), 0)
    )
    # Q = diag(1, Q') with Q' the product of the reflectors stored below the subdiagonal, in
    # geqrf's layout for the trailing (d - 1) x (d - 1) block, so torch.ormqr applies it
    below, tau = torch.from_numpy(reflectors)[1:, :-1], torch.from_numpy(tau)

    def apply_q(X: torch.Tensor, transpose: bool) -> torch.Tensor:
        if d > 1:
            X = X.clone()
            X[1:] = torch.ormqr(below, tau, X[1:], left=True, transpose=transpose)
        return X

    p = apply_q(b, transpose=True).numpy()
    Z = np.empty((len(alphas), d, t))
    for i, alpha in enumerate(alphas.tolist()):
        Z[i] = _tridiagonal_solve(diagonal + alpha, off, p, alpha)
    Z = torch.from_numpy(Z).permute(1, 0, 2).reshape(d, -1)
    return apply_q(Z, transpose=False).reshape(d, len(alphas), t).permute(1, 0, 2)


def _eigen_penalty_path(C: torch.Tensor, b: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """:func:`penalty_path` by one eigendecomposition ``C = U diag(e) U^T``: ``w = U (U^T b / (e + alpha))``."""
    e, U = torch.linalg.eigh(C)
    p = U.T @ b
    return torch.stack([U @ (p / (e + alpha)[:, None]) for alpha in alphas])


def _tridiagonal_solve(diagonal: np.ndarray, off: np.ndarray, p: np.ndarray, alpha: float) -> np.ndarray:
    """Solve the symmetric tridiagonal system (``diagonal``, ``off``) ``z = p``: LAPACK ``dptsv``
    when it is positive definite, else LU with pivoting (``dgtsv``)."""
    if len(diagonal) == 1:
        info = int(diagonal[0] == 0)
        z = p / diagonal[0] if not info else p
    else:
        _, _, z, info = lapack.dptsv(diagonal, off, p)
        if info != 0:  # not positive definite (a penalty <= 0 on a singular C)
            _, _, _, z, info = lapack.dgtsv(off, diagonal, off, p)
    if info != 0:
        raise ValueError(f"ridge normal equations are singular at penalty {alpha:g} (round-off); use a larger penalty")
    return z


def _sytrd_lwork(d: int) -> int:
    return int(lapack.dsytrd_lwork(d, lower=1)[0])


class _Ridge:
    """Ridge on standardized features; penalties by grouped inner CV, one factorization
    (:func:`penalty_path`) per inner fitting set. Each inner fit standardizes its own fitting set
    (as ``GridSearchCV`` over a ``Pipeline(StandardScaler, Ridge)`` does), so the inner fit "all
    blocks but k and j" is the same for outer fold k (validating on j) and outer fold j (validating
    on k), and is factorized once."""

    def __init__(self, stats: BlockMoments, members, dtype, alphas):
        self.stats, self.members, self.dtype = stats, [list(m) for m in members], dtype
        self.alphas = torch.as_tensor(alphas, dtype=stats.gram.dtype, device=stats.gram.device)
        self.n_targets = stats.xty.shape[2]
        self.xty, self.ysum, self.yy = stats.xty, stats.ysum, stats.yy
        self._factors: dict[frozenset, tuple] = {}

    def _side(self, blocks):
        """Own standardization and normal equations of a fitting set of blocks."""
        side = FittingSide(self.stats, blocks, self.dtype)
        ysum = _block_sum(self.ysum, blocks)
        ybar = ysum / side.n
        keep, D = side.keep, side.inv_sd[side.keep]
        # D (gram - n mean mean^T) D, in place: each entry's operations and their order as written
        scatter = torch.outer(side.mean, side.mean).mul_(side.n)
        scatter = _sub(torch.sub(side.gram, scatter, out=scatter), keep)
        C = scatter.mul_(D[:, None]).mul_(D[None, :])
        cross = _block_sum(self.xty, blocks) - torch.outer(side.mean, ysum)
        cross = cross if bool(keep.all()) else cross[keep]
        return side, ybar, C, D[:, None] * cross

    def _factor(self, blocks):
        """(side, target means, weights ``[d_kept, A*t]`` on the unscaled features for every penalty
        and target) of the fit on a set of blocks, computed once."""
        key = frozenset(blocks)
        if key not in self._factors:
            side, ybar, C, b = self._side(sorted(blocks))
            W = penalty_path(C, b, self.alphas).permute(1, 0, 2)  # [d_kept, A, t] on standardized features
            d_kept, A, t = W.shape
            self._factors[key] = (side, ybar, (side.inv_sd[side.keep][:, None, None] * W).reshape(d_kept, A * t))
        return self._factors[key]

    def _validation_mse(self, fit_blocks, val: int):
        """Validation MSE of block ``val`` for every penalty ``[A, t]``, from the fit on ``fit_blocks``."""
        side, ybar, w = self._factor(fit_blocks)
        s, m, keep = self.stats, side.mean, side.keep
        nv, sv, sy = s.count[val], s.total[val], self.ysum[val]
        s0 = self.yy[val] - 2 * ybar * sy + nv * ybar**2
        if not keep.any():
            return (s0 / nv).expand(len(self.alphas), -1)
        R = self.xty[val] - torch.outer(sv, ybar) - torch.outer(m, sy) + nv * torch.outer(m, ybar)
        A, t = len(self.alphas), self.n_targets
        all_kept = bool(keep.all())
        Rk, mk, sk = (R, m, sv) if all_kept else (R[keep], m[keep], sv[keep])
        # M w for the validation block's second moments about the fitting mean,
        # M = G - sv m^T - m sv^T + nv m m^T, without forming M
        mw, sw = mk @ w, sk @ w
        Mw = _sub(s.gram[val], keep) @ w - sk[:, None] * mw - mk[:, None] * (sw - nv * mw)
        quad = (w * Mw).sum(0).reshape(A, t)
        lin = (w.reshape(-1, A, t) * Rk[:, None, :]).sum(0)
        sse = s0[None] - 2 * lin + quad
        return sse / nv

    def solve(self, k: int):
        """Fit fitting side ``k`` (penalty by inner CV over its blocks): (side, target means [t],
        weights [d_kept, t] on standardized features, alphas [t])."""
        inner = self.members[k]
        mse = sum(self._validation_mse([b for b in inner if b != j], j) for j in inner)
        alpha = self.alphas[torch.argmin(mse, dim=0)]  # first minimum: the smallest penalty on ties
        side, ybar, C, b = self._side(inner)
        W = torch.zeros(C.shape[0], self.n_targets, dtype=C.dtype, device=C.device)
        if not side.keep.any():  # nothing to penalize: the fit is the mean, and no penalty was chosen
            return side, ybar, W, torch.full_like(alpha, float("nan"))
        eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
        for value in torch.unique(alpha):  # one solve per chosen penalty costs less than a factorization
            columns = alpha == value
            W[:, columns] = spd_solve(C + value * eye, b[:, columns])
        return side, ybar, W, alpha

    def model(self, k: int) -> RidgeFold:
        side, ybar, W, alpha = self.solve(k)
        weights = torch.zeros(self.stats.gram.shape[1], W.shape[1], dtype=W.dtype, device=W.device)
        weights[side.keep] = side.inv_sd[side.keep][:, None] * W  # on the unscaled (shifted) features
        return RidgeFold(weights, ybar - side.mean @ weights, alpha.cpu().numpy(), int(side.keep.sum()))


def spd_solve(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A^-1 B`` for a symmetric positive definite ``A`` (a penalized or shrunk covariance).

    By Cholesky, half the flops of LU (on CPU LAPACK's potrf/potrs through scipy, 2.4x faster than
    torch's at d = 512 on one thread); by LU where round-off leaves ``A`` not numerically positive
    definite (Golub & Van Loan, *Matrix Computations*, 4th ed., Alg. 4.2.2 and 3.4.1).

    Args:
        A: ``[d, d]`` symmetric positive definite; on CPU a contiguous float64 tensor.
        B: ``[d, k]`` right-hand sides, ``A``'s dtype and device.

    Returns:
        ``[d, k]`` solution, ``A``'s dtype and device.

    Raises:
        ValueError: if LAPACK's triangular solve fails after a successful factorization.
        torch.linalg.LinAlgError: if ``A`` is singular (the LU fallback).

    Example:
        >>> A = torch.tensor([[4.0, 2.0], [2.0, 3.0]], dtype=torch.float64)
        >>> B = torch.tensor([[6.0], [5.0]], dtype=torch.float64)
        >>> [round(v, 12) for v in spd_solve(A, B).flatten().tolist()]  # 4 + 2 = 6, 2 + 3 = 5
        [1.0, 1.0]
    """
    if A.device.type != "cpu":
        factor, info = torch.linalg.cholesky_ex(A)
        return torch.cholesky_solve(B, factor) if int(info) == 0 else torch.linalg.solve(A, B)
    a, b = A.numpy(), B.numpy()
    potrf, potrs = lapack.get_lapack_funcs(("potrf", "potrs"), (a, b))
    factor, info = potrf(a, lower=1, clean=0)
    if info != 0:
        return torch.linalg.solve(A, B)
    x, info = potrs(factor, b, lower=1)
    if info != 0:
        raise ValueError(f"LAPACK potrs failed (info {info}) on a {tuple(A.shape)} system")
    return torch.from_numpy(x)


class GroupedRidgeCV(RegressorMixin, BaseEstimator):
    """Ridge regression whose penalty is chosen by cross-validation grouped by sequence.

    The inner folds are ``GroupKFold(n_splits)`` over ``groups``; each penalty on ``alphas`` is
    scored by the mean validation MSE over the folds (ties: the smallest penalty), and the model
    is refit on all samples with the winner, exactly as
    ``GridSearchCV(Pipeline(StandardScaler, Ridge), {"alpha": alphas}, cv=GroupKFold(n_splits),
    scoring="neg_mean_squared_error")`` would: every fit standardizes its own fitting side (a
    no-op on features that are standardized already). Each inner fold costs one
    factorization, which serves every penalty (module docstring). Features without spread
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
        Xs = Xt - shift
        bounds = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
        moments, values, _ = target_moments(len(blocks), shift, "regression", [y[order]])
        for b, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            moments.add(b, Xs[start:stop], raw[start:stop], values[start:stop])
        alphas = ridge_alphas(self.alphas)
        side, ybar, W, alpha = _Ridge(moments, [list(range(len(blocks)))], "float64", alphas).solve(0)
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
