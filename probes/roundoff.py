"""Float round-off is not signal (issue 10 §1): a feature whose whole spread on a probe's fitting
side is at the numerical resolution of the activations' dtype and scale (:func:`roundoff_tolerance`)
is treated as constant (its standardized value is 0), in the fast path
(:mod:`nopelens.probes.moments`) and in :class:`RoundoffScaler` alike.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.preprocessing import StandardScaler
from sklearn.utils.validation import check_is_fitted

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
