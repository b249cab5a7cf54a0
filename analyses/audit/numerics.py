"""Numerics the audit's checks share: tolerances, errors, agreement checks, reference rotations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models.positions import apply_rope

from .report import Check


@dataclass(frozen=True)
class Tolerance:
    """Agreement means max |a - b| <= atol + rtol * max |b| (float32 models by default).

    Example:
        >>> round(Tolerance(atol=1e-5, rtol=1e-4).of(torch.tensor([-3.0, 2.0])), 8)
        0.00031
    """

    atol: float = 1e-5
    rtol: float = 1e-4

    def of(self, reference: Tensor) -> float:
        scale = float(reference.abs().max()) if reference.numel() else 0.0
        return self.atol + self.rtol * scale


def max_err(a: Tensor, b: Tensor, where: Tensor | None = None) -> float:
    diff = (a.double() - b.double()).abs()
    if where is not None:
        diff = diff[where.expand_as(diff)]
    return float(diff.max()) if diff.numel() else 0.0


def agree(name: str, observed: Tensor, reference: Tensor, tol: Tolerance, detail: str,
           where: Tensor | None = None) -> Check:
    ref = reference if where is None else reference[where.expand_as(reference)]
    err, bound = max_err(observed, reference, where), tol.of(ref)
    return Check(name, err <= bound, f"{detail}; max |error| {err:.3g}", err, bound)


def rotate(x: Tensor, ids: Tensor, rotary_dim: int, base: float, pairing: str, direction: int = 1) -> Tensor:
    """``apply_rope`` (direction +1) or the opposite rotation R(-p theta) (direction -1).

    Seed 002: with R(-p theta) the rotated dot product depends on m - n instead of n - m, a sign
    bug that keeps every shape. R(-p theta) undoes R(p theta):

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).view(1, 1, 1, 4)
        >>> ids = torch.tensor([[5]])
        >>> back = rotate(rotate(x, ids, 4, 10000.0, "half"), ids, 4, 10000.0, "half", direction=-1)
        >>> [round(v, 6) for v in back.flatten().tolist()]
        [1.0, 2.0, 3.0, 4.0]
    """
    if direction == 1:
        return apply_rope(x, ids, rotary_dim, base, pairing)
    # R(-t)(a, b) = C R(t) C (a, b) with C (a, b) = (a, -b): negate each pair's second element
    second = slice(rotary_dim // 2, rotary_dim) if pairing == "half" else slice(1, rotary_dim, 2)
    sign = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    sign[second] = -1
    return apply_rope(x * sign, ids, rotary_dim, base, pairing) * sign


def dot_scores(q: Tensor, k: Tensor, scale: float) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    if k.shape[2] != q.shape[2]:  # grouped-query attention: repeat key heads
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bqhe,bkhe->bhqk", q.double(), k.double()) * scale




def as_ids(values: Tensor) -> Tensor:
    """Round float positions to int64; -1 marks values that are not integers.

    Example:
        >>> as_ids(torch.tensor([0.0, 2.9999999, 1.5])).tolist()
        [0, 3, -1]
    """
    rounded = values.round()
    ids = rounded.long()
    return ids.masked_fill((values - rounded).abs() > 1e-3, -1)
