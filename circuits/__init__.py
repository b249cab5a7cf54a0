"""Hand-set NoPE circuits with known answers (Kazemnejad et al. 2023, NeurIPS, App. C).

- :func:`counter`: Theorem 1. One layer; the residual after it holds 1/(i+1) and i.
- :func:`distance`: Theorem 2. A second layer whose head equals an ALiBi head of slope m.
- :func:`previous_token`: a second-layer head that attends to j = i - 1 via an i^2 feature.

Each returns a ready :class:`~nopelens.models.Decoder` with ``model.circuit``, a
:class:`CircuitInfo` that names the residual dimensions (``counter_dim``, ``position_dim``) and the
heads. :mod:`nopelens.circuits.demos` holds the seed demonstrations (causal table, permutation
equivariance, blocking versus a zero score).
"""

from .counter import check_counter, circuit_tokens, counter, counter_trace
from .distance import (
    alibi_head_for_slope,
    alibi_reference_pattern,
    check_distance,
    check_previous_token,
    distance,
    head_pattern,
    previous_token,
    previous_token_mass,
)
from .layout import DIMENSIONS, CircuitInfo

__all__ = [
    "DIMENSIONS",
    "CircuitInfo",
    "alibi_head_for_slope",
    "alibi_reference_pattern",
    "check_counter",
    "check_distance",
    "check_previous_token",
    "circuit_tokens",
    "counter",
    "counter_trace",
    "distance",
    "head_pattern",
    "previous_token",
    "previous_token_mass",
]
