"""Per-block sufficient statistics of a probe's features, and the blocks they are summed over.

A site's probes (the main target, the control task, the shuffled labels) all see the same
features ``X`` and the same grouped folds. So the samples are cut once into *blocks* (the scored
sides of the grouped folds; every fitting side is a union of blocks, :func:`fold_blocks`), and each
block contributes its count, feature sums, Gram matrix ``X_b^T X_b`` and ``X_b^T Y_b`` once
(:class:`BlockMoments`). Every fitting side's standardization (``StandardScaler`` semantics,
fitted on that side only, :class:`FittingSide`), ridge normal equations
(:mod:`nopelens.probes.ridge`) and pooled LDA covariance (:mod:`nopelens.probes.lda`) is a sum of
block statistics, so the whole site costs one pass over ``X`` (about one ``X^T X``) plus d x d
algebra per fold.

All the algebra runs in torch (float64 on CPU; float32 or float64 on an accelerator, see
:func:`check_compute_dtype`), so wide activations can be probed on a GPU with the same code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from sklearn.model_selection import GroupKFold

from .roundoff import roundoff_scale, roundoff_tolerance, signal_mask


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
    machines, add (:meth:`merge`), and :func:`~nopelens.probes.fitting.fit_folds` is the same statistics filled at once.

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

    def __init__(
        self,
        n_blocks: int,
        shift: torch.Tensor,
        n_values: int = 0,
        classes: Sequence[np.ndarray] = (),
        packed: bool = False,
    ):
        d, dtype, device = shift.shape[0], shift.dtype, shift.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.shift, self.packed = shift, packed
        self.count, self.total = zeros(n_blocks), zeros(n_blocks, d)
        self.gram = zeros(n_blocks, d * (d + 1) // 2) if packed else zeros(n_blocks, d, d)
        self.high = torch.full((n_blocks, d), -torch.inf, dtype=dtype, device=device)
        self.low = torch.full((n_blocks, d), torch.inf, dtype=dtype, device=device)
        self.ysum, self.yy, self.xty = (
            zeros(n_blocks, n_values),
            zeros(n_blocks, n_values),
            zeros(n_blocks, d, n_values),
        )
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

    def add(
        self, block: int, Xs: torch.Tensor, raw, values: torch.Tensor | None = None, labels: Sequence[torch.Tensor] = ()
    ) -> None:
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
        if (
            other.packed != self.packed
            or other.gram.shape != self.gram.shape
            or len(other.classes) != len(self.classes)
            or other.xty.shape != self.xty.shape
        ):
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
        outer = (
            self.total[:, :, None] * a[None, None, :]
            + a[None, :, None] * self.total[:, None, :]
            + n[:, :, None] * torch.outer(a, a)
        )
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

    def group(
        self, blocks: Sequence[Sequence[int]], values: Sequence[int] | None = None, classes: Sequence[int] | None = None
    ) -> "BlockMoments":
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


def fold_blocks(
    splits: Sequence[tuple[np.ndarray, np.ndarray]], groups: np.ndarray
) -> tuple[list[np.ndarray], list[list[int]]]:
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
        return [
            model.predict(self.Xs[_rows(_slice_if_contiguous(self.where[np.asarray(score)]), self.Xs)])
            for model, (_, score) in zip(models, splits)
        ]


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
    bit for bit those of a :func:`~nopelens.probes.fitting.fit_folds` call of its own.

    Args:
        X: features ``[n, d]`` (numpy or torch).
        groups: sequence id of each sample ``[n]``.
        splits: (fit, score) index pairs, grouped by sequence.
        values: ``[n]`` value targets (for ``regression`` models).
        classes: ``[n]`` class targets (for ``classification`` models).
        device, compute_dtype: as :func:`~nopelens.probes.fitting.fit_folds`.

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
    moments, value_rows, labels = _moments_for(
        len(blocks), shift, [np.asarray(t)[order] for t in values], [np.asarray(t)[order] for t in classes]
    )
    # the raw extremes, before the shift: rounding is monotone, so the extremes of the converted
    # features are the converted extremes, which is what the statistics hold
    for b, rows in enumerate(index):
        moments.add_extremes(b, Xs[rows])
    Xs -= shift
    for b, rows in enumerate(index):
        moments.add(
            b, Xs[rows], None, None if value_rows is None else value_rows[rows], [label[rows] for label in labels]
        )
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
        out[start : start + step] = _take(X, order[start : start + step])
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


class FittingSide:
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
