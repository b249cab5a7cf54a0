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
are the fitting side's own blocks (whole sequences), and each inner fit standardizes its own
fitting set. One factorization of an inner fit's standardized centered Gram matrix ``C`` gives its
ridge weights ``w(alpha) = (C + alpha I)^{-1} b`` for every penalty on the grid at once
(:func:`penalty_path`: a Householder reduction ``C = Q T Q^T`` to a tridiagonal ``T`` on CPU,
after which each penalty is an O(d) tridiagonal solve; an eigendecomposition on accelerators).
The validation block's second moments ``M`` and ``m`` then give its sum of squares
``s0 - 2 m . w + w^T M w`` for every penalty. The penalty with the lowest mean validation MSE over
the inner folds wins (ties: the smallest), exactly as ``GridSearchCV(Pipeline(StandardScaler,
Ridge), {"ridge__alpha": grid}, cv=inner_folds, scoring="neg_mean_squared_error")`` on the fitting
side; tests check the choice and the predictions against scikit-learn on the same folds. The
inner fit on "all blocks but k and j" serves outer fold k and outer fold j alike, so K folds cost
K (K - 1) / 2 factorizations.

Float round-off is not signal (issue 10 §1): a feature whose whole spread on the fitting side is
at the numerical resolution of the activations' dtype and scale (:func:`roundoff_tolerance`) is
treated as constant (its standardized value is 0), in the fast path and in
:class:`RoundoffScaler` alike.

All the algebra runs in torch (float64 on CPU; float32 or float64 on an accelerator, see
``device``), so wide activations can be probed on a GPU with the same code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.linalg import lapack
from sklearn.base import BaseEstimator, RegressorMixin, TransformerMixin
from sklearn.model_selection import GroupKFold
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted, check_X_y

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
    return (high - low) > roundoff_tolerance(dtype) * roundoff_scale(high, low)


def roundoff_scale(high, low):
    """Each feature's scale for the round-off rule (:func:`signal_mask`): the larger of its largest
    magnitude and the median largest magnitude of all features, ``[d]``."""
    lib = torch if isinstance(high, torch.Tensor) else np
    magnitude = lib.maximum(lib.abs(high), lib.abs(low))
    if magnitude.shape[0] == 0:
        return magnitude
    typical = magnitude.median() if lib is torch else np.median(magnitude)
    return lib.maximum(magnitude, typical)


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


class BlockMoments:
    """Additive sufficient statistics of one feature matrix and its targets, per block.

    For each block ``b`` (a set of whole sequences, :func:`fold_blocks`) and the features shifted
    by one constant vector ``shift`` (any value; it only keeps the sums precise, ideally near the
    mean): the count, ``total = sum (x - shift)``, ``gram = sum (x - shift)(x - shift)^T``, the raw
    per-feature extremes (before the shift: the round-off rule, :func:`signal_mask`, judges them),
    and per target either ``sum y``, ``sum y^2`` and ``sum (x - shift) y`` (values, for ridge) or
    per class the count and ``sum (x - shift)`` (class labels, for LDA). Every fitting side's
    standardization, ridge normal equations, inner-CV errors and pooled LDA covariance are sums of
    these (module docstring), so statistics of batches, or of shards measured on different
    machines, add (:meth:`merge`), and :func:`fit_folds` is the same statistics filled at once.

    With ``packed=True`` each block's Gram matrix is held as its upper triangle, row by row
    (``[B, d (d + 1) / 2]``: half the memory of the statistics that grow with the width, which is
    what a streamed run holds for every site at once); :meth:`group` gives full matrices, which is
    what the fits read.

    Attributes:
        shift: ``[d]``.
        count ``[B]``, total ``[B, d]``, gram ``[B, d, d]`` (``[B, d (d + 1) / 2]`` when packed),
            high ``[B, d]``, low ``[B, d]``.
        ysum, yy ``[B, t]`` and xty ``[B, d, t]`` for ``t`` value targets.
        classes: per class target, its class values (sorted); class_sums ``[B, C, d]`` and
            class_counts ``[B, C]`` per class target.
    """

    def __init__(self, n_blocks: int, shift: torch.Tensor, n_values: int = 0, classes: Sequence[np.ndarray] = (),
                 packed: bool = False):
        d, dtype, device = shift.shape[0], shift.dtype, shift.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.shift, self.packed = shift, packed
        self.count, self.total = zeros(n_blocks), zeros(n_blocks, d)
        self.gram = zeros(n_blocks, d * (d + 1) // 2) if packed else zeros(n_blocks, d, d)
        self.high = torch.full((n_blocks, d), -torch.inf, dtype=dtype, device=device)
        self.low = torch.full((n_blocks, d), torch.inf, dtype=dtype, device=device)
        self.ysum, self.yy, self.xty = zeros(n_blocks, n_values), zeros(n_blocks, n_values), zeros(n_blocks, d, n_values)
        self.classes = [np.asarray(c) for c in classes]
        self.class_sums = [zeros(n_blocks, len(c), d) for c in self.classes]
        self.class_counts = [zeros(n_blocks, len(c)) for c in self.classes]

    @property
    def n_blocks(self) -> int:
        return len(self.count)

    @property
    def nbytes(self) -> int:
        """Bytes held by the statistics."""
        tensors = [self.total, self.gram, self.high, self.low, self.ysum, self.yy, self.xty, *self.class_sums]
        return sum(t.element_size() * t.nelement() for t in tensors)

    def add(self, block: int, Xs: torch.Tensor, raw, values: torch.Tensor | None = None,
            labels: Sequence[torch.Tensor] = ()) -> None:
        """Add rows to ``block``.

        Args:
            block: block number.
            Xs: ``[n, d]`` features minus ``shift``, in the statistics' dtype and device.
            raw: the same rows before the shift (numpy or torch, any float dtype), for the
                extremes; None when :meth:`add_extremes` was given them.
            values: ``[n, t]`` value targets (statistics' dtype and device).
            labels: per class target, int64 ``[n]`` indices into its ``classes``.
        """
        self.count[block] += len(Xs)
        self.total[block] += Xs.sum(0)
        gram = _gram(Xs)
        self.gram[block] += gram.reshape(-1)[_upper(len(self.shift), gram.device)] if self.packed else gram
        if raw is not None:
            self.add_extremes(block, raw)
        if values is not None and values.shape[1]:
            self.xty[block] += _cross(Xs, values)
            self.ysum[block] += values.sum(0)
            self.yy[block] += (values**2).sum(0)
        for sums, counts, label, classes in zip(self.class_sums, self.class_counts, labels, self.classes):
            sums[block].index_add_(0, label, Xs)
            counts[block] += torch.bincount(label, minlength=len(classes)).to(Xs.dtype)

    def add_extremes(self, block: int, raw) -> None:
        """Widen ``block``'s per-feature extremes to those of ``raw`` ``[n, d]`` (rows before the
        shift; numpy or torch, any float dtype)."""
        if isinstance(raw, torch.Tensor) and raw.device.type == "cpu" and raw.dtype in (torch.float32, torch.float64):
            raw = raw.numpy()  # numpy reduces over rows 15x faster than torch on one CPU thread; a maximum is exact
        high, low = raw.max(0), raw.min(0)
        if isinstance(raw, torch.Tensor):
            high, low = high.values, low.values
        for target, extreme, pick in ((self.high, high, torch.maximum), (self.low, low, torch.minimum)):
            extreme = torch.as_tensor(np.asarray(extreme) if not isinstance(extreme, torch.Tensor) else extreme)
            target[block] = pick(target[block], extreme.to(self.shift.device, self.shift.dtype))

    def merge(self, other: "BlockMoments") -> "BlockMoments":
        """Add ``other`` (same blocks and targets, any shift) into these statistics, in place."""
        if other.packed != self.packed or other.gram.shape != self.gram.shape or len(other.classes) != len(self.classes) \
                or other.xty.shape != self.xty.shape:
            raise ValueError("statistics of different blocks, features or targets cannot be merged")
        other = other.reshifted(self.shift)
        for name in ("count", "total", "gram", "ysum", "yy", "xty"):
            getattr(self, name).add_(getattr(other, name).to(self.shift.device))
        self.high = torch.maximum(self.high, other.high.to(self.shift.device))
        self.low = torch.minimum(self.low, other.low.to(self.shift.device))
        for mine, theirs in zip(self.class_sums + self.class_counts, other.class_sums + other.class_counts):
            mine.add_(theirs.to(self.shift.device))
        return self

    def reshifted(self, shift: torch.Tensor) -> "BlockMoments":
        """The same statistics about another ``shift`` (self when it is the same): with
        a = old - new shift, x - new = (x - old) + a, so total += n a, gram += total a^T + a total^T
        + n a a^T, xty += a ysum^T, class sums += counts a."""
        shift = shift.to(self.shift.device, self.shift.dtype)
        if torch.equal(shift, self.shift):
            return self
        a = self.shift - shift
        out = BlockMoments(0, shift, packed=self.packed)
        n = self.count[:, None]
        out.count, out.ysum, out.yy, out.high, out.low = self.count, self.ysum, self.yy, self.high, self.low
        out.total = self.total + n * a
        outer = self.total[:, :, None] * a[None, None, :] + a[None, :, None] * self.total[:, None, :] \
            + n[:, :, None] * torch.outer(a, a)
        if self.packed:
            outer = outer.reshape(len(outer), -1)[:, _upper(len(a), a.device)]
        out.gram = self.gram + outer
        out.xty = self.xty + a[None, :, None] * self.ysum[:, None, :]
        out.classes = self.classes
        out.class_sums = [s + c[:, :, None] * a for s, c in zip(self.class_sums, self.class_counts)]
        out.class_counts = self.class_counts
        return out

    def select(self, values: Sequence[int] = (), classes: Sequence[int] = ()) -> "BlockMoments":
        """The same statistics restricted to some value and class targets; the feature sums are
        shared, not copied (a view for fitting one probe family of several)."""
        out = object.__new__(BlockMoments)
        out.__dict__.update(self.__dict__)
        cols = torch.as_tensor(list(values), dtype=torch.long, device=self.shift.device)
        out.ysum, out.yy, out.xty = self.ysum[:, cols], self.yy[:, cols], self.xty[:, :, cols]
        out.classes = [self.classes[c] for c in classes]
        out.class_sums = [self.class_sums[c] for c in classes]
        out.class_counts = [self.class_counts[c] for c in classes]
        return out

    def group(self, blocks: Sequence[Sequence[int]], values: Sequence[int] | None = None,
              classes: Sequence[int] | None = None) -> "BlockMoments":
        """Statistics of unions of blocks (``blocks[g]``: the blocks of new block ``g``), keeping the
        value targets ``values`` and the class targets ``classes`` (default: all)."""
        values = range(self.xty.shape[2]) if values is None else list(values)
        classes = range(len(self.classes)) if classes is None else list(classes)
        out = BlockMoments(0, self.shift)
        cols = torch.as_tensor(list(values), dtype=torch.long, device=self.shift.device)
        parts = [torch.as_tensor(list(b), dtype=torch.long, device=self.shift.device) for b in blocks]

        def combine(array, how="sum"):
            if how == "sum":
                return torch.stack([_block_sum(array, p) for p in parts])
            return torch.stack([getattr(array[p], how)(0).values for p in parts])

        out.count, out.total, out.gram = combine(self.count), combine(self.total), combine(self.gram)
        if self.packed:
            out.gram = _unpack(out.gram, len(self.shift))
        out.high, out.low = combine(self.high, "max"), combine(self.low, "min")
        out.ysum, out.yy = combine(self.ysum[:, cols]), combine(self.yy[:, cols])
        out.xty = combine(self.xty[:, :, cols])
        out.classes = [self.classes[c] for c in classes]
        out.class_sums = [combine(self.class_sums[c]) for c in classes]
        out.class_counts = [combine(self.class_counts[c]) for c in classes]
        return out


@functools.lru_cache(maxsize=8)
def _upper(d: int, device: torch.device) -> torch.Tensor:
    """Flat indices of the upper triangle of a ``[d, d]`` matrix, row by row (``torch.triu_indices``)."""
    i, j = torch.triu_indices(d, d, device=device)
    return i * d + j


def _unpack(packed: torch.Tensor, d: int) -> torch.Tensor:
    """``[B, d, d]`` symmetric matrices from their upper triangles ``[B, d (d + 1) / 2]``."""
    full = torch.zeros(len(packed), d * d, dtype=packed.dtype, device=packed.device)
    upper = _upper(d, packed.device)
    full[:, upper] = packed
    lower = upper // d + upper % d * d  # the same entries transposed
    full[:, lower] = packed
    return full.reshape(len(packed), d, d)


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


# ----------------------------------------------------------------------------- fold engine


@dataclass
class FoldFit:
    """Out-of-fold predictions of several targets, with what each fold chose."""

    index: np.ndarray  # [m] scored samples, concatenated over folds
    predictions: list[np.ndarray]  # per target [m]
    alphas: list[np.ndarray]  # per target [n_folds] chosen ridge penalty (empty for LDA; NaN: no feature kept)
    at_edge: list[bool]  # per target: some fold chose the smallest or largest penalty
    n_signal: np.ndarray  # [n_folds] features above round-off on each fitting side

    @classmethod
    def assemble(cls, splits, models: Sequence["RidgeFold | LDAFold"], predictions: Sequence[Sequence[np.ndarray]],
                 alphas: np.ndarray) -> "FoldFit":
        """From each fold's model and its predictions of its scoring side (``predictions[k][t]``)."""
        n_targets = len(predictions[0]) if len(predictions) else 0
        chosen = [np.asarray([m.alpha[t] for m in models if m.alpha is not None]) for t in range(n_targets)]
        at_edge = [bool(len(c) and ((c == alphas[0]) | (c == alphas[-1])).any()) for c in chosen]
        return cls(np.concatenate([np.asarray(score) for _, score in splits]),
                   [np.concatenate([p[t] for p in predictions]) for t in range(n_targets)], chosen, at_edge,
                   np.asarray([m.n_signal for m in models]))


@dataclass
class FoldChoice:
    """What one fold's fit chose, kept once its predictions are made and its weights dropped: the
    ridge penalty per target (None for LDA) and the features above round-off (:meth:`FoldFit.assemble`)."""

    alpha: np.ndarray | None
    n_signal: int


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


@dataclass
class LDAFold:
    """One fold's pooled LDA: per target, the class of the largest decision
    ``((x - mean) * inv_sd) @ coef.T + intercept``, held with the standardization folded into the
    weights, so every target's classes are scored by one product of the features (3x faster than
    standardizing them first, at d = 512 and 3 x 64 classes on one CPU thread)."""

    weights: torch.Tensor  # [d, sum C] on the shifted features; 0 where a feature is not kept
    bias: torch.Tensor  # [sum C]
    classes: list[np.ndarray]  # per target its classes [C], in the order of the columns
    n_signal: int
    alpha = None

    def predict(self, Xs: torch.Tensor) -> list[np.ndarray]:
        """Predicted class ``[n]`` of each target for shifted features ``Xs`` ``[n, d]``."""
        if Xs.device.type == "cpu":
            scores = Xs.numpy() @ self.weights.numpy()
            scores += self.bias.numpy()
        else:
            scores = torch.addmm(self.bias, Xs, self.weights).cpu().numpy()
        out, first = [], 0
        for classes in self.classes:
            out.append(classes[scores[:, first:first + len(classes)].argmax(1)])
            first += len(classes)
        return out


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
    _check_task(task)
    dtype = (X.dtype if dtype is None else dtype)
    alphas = ridge_alphas(alphas)
    regression = task == "regression"
    stats = fold_statistics(X, groups, splits, targets if regression else (), () if regression else targets, device,
                            compute_dtype)
    models = fold_models(stats.moments, stats.members, task, dtype, alphas, shrinkage)
    return FoldFit.assemble(splits, models, stats.predict(models, splits), alphas)


@dataclass
class FoldStatistics:
    """A feature matrix's per-block statistics, filled at once, and its rows for predicting.

    Attributes:
        moments: :class:`BlockMoments` of the blocks of :func:`fold_blocks`.
        members: the blocks of each fitting side.
        Xs: the features minus their mean, in block order (then the rows no fitting side uses),
            in the compute dtype.
        where: ``[n]``, each row's place in ``Xs``.
    """

    moments: BlockMoments
    members: list[list[int]]
    Xs: torch.Tensor
    where: np.ndarray

    def predict(self, models, splits) -> list[list[np.ndarray]]:
        """Each fold's predictions of its scoring side, ``[fold][target] -> [m]``, in ``score`` order."""
        return [model.predict(self.Xs[_rows(_slice_if_contiguous(self.where[np.asarray(score)]), self.Xs)])
                for model, (_, score) in zip(models, splits)]


def fold_statistics(
    X,
    groups: np.ndarray,
    splits: Sequence[tuple[np.ndarray, np.ndarray]],
    values: Sequence[np.ndarray] = (),
    classes: Sequence[np.ndarray] = (),
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype | None = None,
) -> FoldStatistics:
    """The per-block statistics of ``X`` for value targets (ridge) and class targets (LDA) at once.

    Every block's Gram matrix is computed once, whichever targets read it, so a site's
    classification and regression probes on the same splits share it; each target's numbers are
    bit for bit those of a :func:`fit_folds` call of its own.

    Args:
        X: features ``[n, d]`` (numpy or torch).
        groups: sequence id of each sample ``[n]``.
        splits: (fit, score) index pairs, grouped by sequence.
        values: ``[n]`` value targets (for ``regression`` models).
        classes: ``[n]`` class targets (for ``classification`` models).
        device, compute_dtype: as :func:`fit_folds`.

    Raises:
        ValueError: on a split with an empty side or not grouped by sequence, or float32 algebra on CPU.
    """
    compute_dtype = check_compute_dtype(device, compute_dtype)
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
    Xs = _gathered(X, order, device, compute_dtype)
    shift = Xs.mean(0)  # a global shift changes nothing mathematically and keeps Gram sums precise
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
    index = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    moments, value_rows, labels = _moments_for(len(blocks), shift, [np.asarray(t)[order] for t in values],
                                               [np.asarray(t)[order] for t in classes])
    # the raw extremes, before the shift: rounding is monotone, so the extremes of the converted
    # features are the converted extremes, which is what the statistics hold
    for b, rows in enumerate(index):
        moments.add_extremes(b, Xs[rows])
    Xs -= shift
    for b, rows in enumerate(index):
        moments.add(b, Xs[rows], None, None if value_rows is None else value_rows[rows],
                    [label[rows] for label in labels])
    return FoldStatistics(moments, members, Xs, where)


GATHER_ELEMENTS = 1 << 20
"""Elements (rows x features) :func:`_gathered` reorders at a time (4 MB of float32)."""


def _gathered(X, order: np.ndarray, device, dtype) -> torch.Tensor:
    """``X[order]`` ``[n, d]`` in ``dtype`` on ``device``, a new tensor filled a few MB of rows at a
    time (not a reordered copy and then a converted one: two fewer passes over the features, and
    no memory of their size but the result)."""
    X = X if isinstance(X, torch.Tensor) else np.asarray(X)
    out = torch.empty((len(order), *X.shape[1:]), dtype=dtype, device=device)
    step = max(1, GATHER_ELEMENTS // max(int(np.prod(X.shape[1:])), 1))
    for start in range(0, len(order), step):
        out[start:start + step] = _take(X, order[start:start + step])
    return out


def _take(X: torch.Tensor | np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """``X[rows]`` as a tensor (on ``X``'s device when it is one)."""
    if isinstance(X, torch.Tensor):
        return X[torch.as_tensor(rows, device=X.device)]
    return torch.from_numpy(np.ascontiguousarray(X[rows]))


def target_moments(n_blocks: int, shift: torch.Tensor, task: str, targets: Sequence[np.ndarray]):
    """Empty :class:`BlockMoments` for ``targets`` (values for regression, classes for classification),
    with the targets as the statistics take them: (moments, values ``[n, t]`` tensor or None, per
    class target its int64 label tensor ``[n]``)."""
    _check_task(task)
    if task == "regression":
        return _moments_for(n_blocks, shift, targets, ())
    return _moments_for(n_blocks, shift, (), targets)


def _moments_for(n_blocks: int, shift: torch.Tensor, values: Sequence[np.ndarray], classes: Sequence[np.ndarray]):
    """(empty moments, values ``[n, t]`` tensor or None, per class target its label tensor)."""
    value_rows = None
    if len(values):
        value_rows = torch.as_tensor(np.stack(values, 1), dtype=shift.dtype, device=shift.device)
    kinds, labels = [], []
    for y in classes:
        kind, label = np.unique(y, return_inverse=True)
        kinds.append(kind)
        labels.append(torch.as_tensor(label.reshape(-1), device=shift.device))
    return BlockMoments(n_blocks, shift, n_values=len(values), classes=kinds), value_rows, labels


def fold_models(moments: BlockMoments, members: Sequence[Sequence[int]], task: str, dtype,
                alphas: Sequence[float] = ALPHAS, shrinkage: float = 1e-3) -> list["RidgeFold | LDAFold"]:
    """Fit every fold from its blocks' statistics: fold ``k`` fits on blocks ``members[k]``.

    Args:
        moments: per-block statistics (value targets for ``regression``, class targets for
            ``classification``).
        members: the blocks of each fitting side (from :func:`fold_blocks`).
        task: ``regression`` (ridge, penalty by grouped inner CV over the fitting side's blocks)
            or ``classification`` (:class:`PooledLDA`).
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
    engine = _Ridge(moments, members, dtype, alphas) if task == "regression" else _LDA(moments, members, dtype, shrinkage)
    return [engine.model(k) for k in range(len(members))]


def check_compute_dtype(device, compute_dtype: torch.dtype | None) -> torch.dtype:
    """float64 by default; float32 only on an accelerator.

    Raises:
        ValueError: for float32 algebra on CPU.
    """
    compute_dtype = compute_dtype or torch.float64
    if torch.device(device).type == "cpu" and compute_dtype != torch.float64:
        raise ValueError(f"probe algebra runs in float64 on CPU; {compute_dtype} is only for accelerators")
    return compute_dtype


def _check_task(task: str) -> None:
    if task not in ("regression", "classification"):
        raise ValueError(f"task must be 'classification' or 'regression', got {task!r}")


class _Side:
    """Standardization of one fitting side (a set of blocks), StandardScaler semantics."""

    def __init__(self, stats: BlockMoments, blocks: list[int], dtype):
        sel = torch.as_tensor(blocks, device=stats.count.device)
        self.n = stats.count[sel].sum()
        self.total = _block_sum(stats.total, blocks)
        self.gram = _block_sum(stats.gram, blocks)
        self.mean = self.total / self.n
        high, low = stats.high[sel].max(0).values, stats.low[sel].min(0).values
        self.keep = signal_mask(high, low, dtype)
        # the diagonal of gram - n mean mean^T, entry by entry as the full matrix would give it
        var = torch.clamp((torch.diagonal(self.gram) - self.n * (self.mean * self.mean)) / self.n, min=0)
        self.inv_sd = torch.where(self.keep, 1 / torch.sqrt(torch.where(var > 0, var, 1)), 0)
        # the variance a standardized kept feature can have from its dtype's round-off alone, summed
        resolution = roundoff_tolerance(dtype) * roundoff_scale(high, low)[self.keep] * self.inv_sd[self.keep]
        self.roundoff_variance = (resolution * resolution).sum()


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
    reflectors, diagonal, off, tau, _ = lapack.dsytrd(A, lower=1, lwork=_sytrd_lwork(d)) if d > 1 else \
        (A, np.diagonal(A).copy(), np.zeros(0), np.zeros(0), 0)
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
        side = _Side(self.stats, blocks, self.dtype)
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


def _block_sum(array: torch.Tensor, blocks) -> torch.Tensor:
    """``array[blocks].sum(0)`` by adding one block after another: the same bits (torch sums a
    leading dimension in order), without copying the selected blocks first (16x faster for three
    ``[512, 512]`` Gram matrices on one CPU thread)."""
    blocks = [int(b) for b in blocks]
    if not blocks:
        return array.new_zeros(array.shape[1:])
    out = array[blocks[0]].clone()
    for b in blocks[1:]:
        out += array[b]
    return out


def _sub(M: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return M if bool(keep.all()) else M[keep][:, keep]


def _rows(index, X: torch.Tensor):
    return index if isinstance(index, slice) else torch.as_tensor(index, device=X.device)


def _slice_if_contiguous(rows: np.ndarray):
    if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return slice(int(rows[0]), int(rows[0]) + len(rows))
    return rows


class _LDA:
    def __init__(self, stats: BlockMoments, members, dtype, shrinkage):
        self.stats, self.members, self.dtype, self.shrinkage = stats, [list(m) for m in members], dtype, shrinkage

    def model(self, k: int) -> LDAFold:
        blocks = self.members[k]
        side = _Side(self.stats, blocks, self.dtype)
        keep, D = side.keep, side.inv_sd[side.keep]
        d_total = self.stats.gram.shape[1]
        rules = []
        for classes, sums, counts in zip(self.stats.classes, self.stats.class_sums, self.stats.class_counts):
            count = _block_sum(counts, blocks)
            present = count > 0
            if int(present.sum()) < 2:
                raise ValueError(f"need at least 2 classes, got {int(present.sum())}")
            count, total = count[present], _block_sum(sums, blocks)[present]
            means = total / count[:, None]  # raw (shifted) class means
            # D (gram - sum_c n_c mean_c mean_c^T) D / n + shrinkage I, in place: each entry's operations as written
            between = (means.T * count) @ means
            cov = _sub(torch.sub(side.gram, between, out=between), keep).mul_(D[:, None]).mul_(D[None, :]).div_(side.n)
            trace = torch.trace(cov)
            if trace <= side.roundoff_variance:  # no spread within a class beyond round-off: it is none
                cov.zero_()
                trace = torch.zeros_like(trace)
            scale = trace / d_total if trace > 0 else torch.ones((), dtype=cov.dtype, device=cov.device)
            cov.diagonal().add_(self.shrinkage * scale)
            mz = (means[:, keep] - side.mean[keep]) * D
            coef = spd_solve(cov, mz.T).T if len(D) else mz
            intercept = -0.5 * (mz * coef).sum(1) + torch.log(count / side.n)
            scaled = coef * D  # the decision on the shifted features: x @ (D coef^T) + intercept - (mean D) @ coef^T
            rules.append((scaled, intercept - scaled @ side.mean[keep], classes[present.cpu().numpy()]))
        weights = torch.zeros(d_total, sum(len(c) for _, _, c in rules), dtype=D.dtype, device=D.device)
        weights[keep] = torch.cat([scaled for scaled, _, _ in rules]).T
        return LDAFold(weights, torch.cat([bias for _, bias, _ in rules]), [c for _, _, c in rules], int(keep.sum()))


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
