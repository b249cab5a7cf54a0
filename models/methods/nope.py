"""NoPE: no position method; only the causal mask carries order (Kazemnejad et al. 2023)."""

from __future__ import annotations

from .base import PositionMethod


class NoPE(PositionMethod):
    """No positional information anywhere; a query's visible prefix is all it has (seed 000).

    Audit expectations: nothing to check in steps 2, 4 and 5; no intervention on position ids
    changes the output.
    """

    name = "nope"
    label = "NoPE"
    convention = "none: the causal mask (key j visible to query i exactly when j <= i) is the only order"
