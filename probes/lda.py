"""Pooled-covariance LDA probes from block statistics (``StandardScaler`` + :class:`~nopelens.probes.linear.PooledLDA`
on every fitting side, from its blocks' Gram matrices and class sums)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .moments import BlockMoments, FittingSide, _block_sum, _sub
from .ridge import spd_solve


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
            out.append(classes[scores[:, first : first + len(classes)].argmax(1)])
            first += len(classes)
        return out


class _LDA:
    def __init__(self, stats: BlockMoments, members, dtype, shrinkage):
        self.stats, self.members, self.dtype, self.shrinkage = stats, [list(m) for m in members], dtype, shrinkage

    def model(self, k: int) -> LDAFold:
        blocks = self.members[k]
        side = FittingSide(self.stats, blocks, self.dtype)
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
