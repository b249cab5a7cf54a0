"""ALiBi (Press, Smith & Lewis 2022): a fixed linear recency bias -m_h (i - j) on the scores."""

from __future__ import annotations

from torch import Tensor, nn

from ..positions import alibi_bias, alibi_slopes
from .base import SCORE_BIAS, PositionMethod


class ALiBi(PositionMethod):
    """Adds -m_h (i - j) to the score of query i and key j, with the official slopes m_h.

    Buffer: ``attn.alibi_slopes [n_heads]`` (not saved). Hook: ``attn.hook_pos_bias``.

    Audit expectations: relative; the bias fitted against i - j has slope -m_h with m_h > 0 (it
    penalizes distant keys) equal to :func:`alibi_slopes`; it is finite and never blocks a key.
    """

    name = "alibi"
    label = "ALiBi"
    acts_on = frozenset({SCORE_BIAS})
    convention = "bias -m_h (i - j), m_h > 0: distant keys are penalized"
    bias_kind = "linear"
    reference_text = "-m_h (i - j) with the official slopes"

    def add_parameters(self, attn: nn.Module, cfg) -> None:
        attn.register_buffer("alibi_slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def score_bias(self, attn: nn.Module, q: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        return alibi_bias(attn.alibi_slopes, query_positions, key_positions).to(q.dtype)

    @staticmethod
    def reference_slopes(n_heads: int, device=None) -> Tensor:
        """The slopes m_h the method declares (what the audit compares the fitted slopes with)."""
        return alibi_slopes(n_heads, device=device)

    def reference_bias(self, n_heads: int, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """-m_h (i - j) with the declared slopes, ``[batch, head_index, query_pos, key_pos]``."""
        return alibi_bias(alibi_slopes(n_heads, device=query_positions.device), query_positions, key_positions)
