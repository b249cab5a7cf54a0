"""Numerics the audit's checks share: tolerances, errors, agreement checks, reference rotations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models.positions import apply_rope

from .report import Check

HALF_ULPS = 4
"""Tolerance of a half-precision model, in units of its dtype's eps (both atol and rtol)."""
FLOAT32 = (1e-5, 1e-4)
"""(atol, rtol) of a float32 (or float64) model."""


@dataclass(frozen=True)
class Tolerance:
    """Agreement means max |a - b| <= atol + rtol * max |b|, at the model's compute dtype.

    Float32 models get atol 1e-5, rtol 1e-4 (about 840 eps). A half-precision model stores every
    hooked activation rounded to its own eps (bfloat16 2^-7, float16 2^-10) and rounds again at
    each operation, so its references (recomputed in float64 from the hooked, rounded tensors)
    agree only to a few eps: :meth:`for_dtype` gives bfloat16 and float16 atol = rtol =
    ``HALF_ULPS * eps`` (0.031 and 0.0039). A rotation of the wrong sense, a wrong RoPE base or a
    doubled ALiBi slope changes scores by O(1) of their scale, far above either tolerance.

    Attributes:
        atol, rtol: see above.
        dtype: name of the compute dtype the tolerance is for.

    Example:
        >>> round(Tolerance(atol=1e-5, rtol=1e-4).of(torch.tensor([-3.0, 2.0])), 8)
        0.00031
        >>> Tolerance.for_dtype(torch.bfloat16).rtol, Tolerance.for_dtype("float16").atol
        (0.03125, 0.00390625)
    """

    atol: float = FLOAT32[0]
    rtol: float = FLOAT32[1]
    dtype: str = "float32"

    @classmethod
    def for_dtype(cls, dtype, atol: float | None = None, rtol: float | None = None) -> "Tolerance":
        """The tolerance of a model computing in ``dtype``; ``atol``/``rtol`` override it.

        Raises:
            ValueError: if ``dtype`` is not a floating-point dtype.
        """
        torch_dtype = _torch_dtype(dtype)
        if torch_dtype in (torch.float32, torch.float64):
            base = FLOAT32
        else:
            eps = float(torch.finfo(torch_dtype).eps)
            base = (HALF_ULPS * eps, HALF_ULPS * eps)
        return cls(
            base[0] if atol is None else atol,
            base[1] if rtol is None else rtol,
            str(torch_dtype).removeprefix("torch."),
        )

    @property
    def half_precision(self) -> bool:
        """The compute dtype is bfloat16 or float16 (not float32 or float64)."""
        return self.dtype not in ("float32", "float64")

    def of(self, reference: Tensor) -> float:
        scale = float(reference.abs().max()) if reference.numel() else 0.0
        return self.atol + self.rtol * scale

    def through(self, n_layers: int) -> "Tolerance":
        """The tolerance of a whole forward pass's output (logits) through ``n_layers`` blocks.

        A half-precision model rounds afresh in every block, and independent round-off adds up like
        a random walk: sqrt(n_layers) times the per-block tolerance. Float32's tolerance (about 840
        eps) covers any depth already.

        Example:
            >>> Tolerance.for_dtype("bfloat16").through(16).rtol, Tolerance().through(16).rtol
            (0.125, 0.0001)
        """
        if not self.half_precision:
            return self
        factor = math.sqrt(max(1, n_layers))
        return Tolerance(self.atol * factor, self.rtol * factor, self.dtype)

    @property
    def masked_score(self) -> float:
        """A blocked score is at most this: -inf, or transformers' ``torch.finfo(dtype).min`` mask
        (-65504 in float16, about -3.4e38 in bfloat16 and float32): -1e30, or half the dtype's
        lowest value where that is above -1e30 (float16). No real score comes near either."""
        return max(-1e30, 0.5 * float(torch.finfo(_torch_dtype(self.dtype)).min))


def _torch_dtype(dtype) -> torch.dtype:
    name = str(dtype).removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"a model's compute dtype must be floating point, got {dtype!r}")
    return value


def max_err(a: Tensor, b: Tensor, where: Tensor | None = None) -> float:
    diff = (a.double() - b.double()).abs()
    if where is not None:
        diff = diff[where.expand_as(diff)]
    return float(diff.max()) if diff.numel() else 0.0


def agree(
    name: str, observed: Tensor, reference: Tensor, tol: Tolerance, detail: str, where: Tensor | None = None
) -> Check:
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
