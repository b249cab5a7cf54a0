"""Shaw relative positions (Shaw, Uszkoreit & Vaswani 2018): learned embeddings of clipped offsets."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..positions import shaw_relative_ids
from .base import SCORE_BIAS, VALUE, LookupBias


class Shaw(LookupBias):
    """Adds q_i . a^K_{clip(j - i, -k, k)} times ``cfg.content_scale`` (1 / sqrt(d_head) by default) to the
    scores (eq. 4), and with ``shaw_values`` the pattern-weighted a^V_{clip(j - i)} to the output (eq. 3).

    Parameters: ``attn.W_rel_K [2k + 1, d_head]`` and, with ``shaw_values``, ``attn.W_rel_V``.
    Config fields: ``shaw_clip`` (k), ``shaw_values``. Hook: ``attn.hook_pos_bias``.

    Audit expectations: relative; ``hook_pos_bias`` equals q . a^K at the declared offset
    clip(j - i) (not the mirrored clip(i - j)); ``hook_z`` adds A a^V when values are on.
    """

    name = "shaw"
    label = "Shaw"
    acts_on = frozenset({SCORE_BIAS, VALUE})
    convention = "offset clip(j - i, -k, k) indexes a^K (and a^V); row index clip(j - i) + k"
    config_fields = ("shaw_clip", "shaw_values")
    table_name, declared_offset, mirrored_offset = "a^K", "clip(j - i)", "clip(i - j)"
    ids_evidence_name = "offsets_used"
    value_table_name, value_formula = "a^V", "hook_z = A v + A a^V[clip(j - i)]"

    @classmethod
    def validate_config(cls, cfg, used: bool) -> None:
        if not isinstance(cfg.shaw_clip, int) or cfg.shaw_clip < 0:
            raise ValueError(f"shaw_clip must be a non-negative integer, got {cfg.shaw_clip!r}")

    def add_parameters(self, attn: nn.Module, cfg) -> None:
        attn.W_rel_K = nn.Parameter(torch.empty(2 * cfg.shaw_clip + 1, cfg.d_head))
        if cfg.shaw_values:
            attn.W_rel_V = nn.Parameter(torch.empty(2 * cfg.shaw_clip + 1, cfg.d_head))

    def relative_ids(self, cfg, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """Row of the relative tables for each (i, j): clip(j - i, -k, k) + k."""
        return shaw_relative_ids(query_positions, key_positions, cfg.shaw_clip)

    def score_bias(self, attn: nn.Module, q: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        rel = attn.W_rel_K[self.relative_ids(attn.cfg, query_positions, key_positions)]  # [b, q, k, e]
        return torch.einsum("bqhe,bqke->bhqk", q, rel) * attn.cfg.content_scale

    def describe(self, cfg) -> dict:
        return {"shaw_clip": cfg.shaw_clip}

    def reference_bias(self, attn: nn.Module, q: Tensor, ids: Tensor) -> Tensor:
        table = attn.W_rel_K.to(q.dtype)
        return torch.einsum("bqhe,bqke->bhqk", q, table[ids]) * attn.cfg.content_scale

    def reference_value_term(self, attn: nn.Module, pattern: Tensor, ids: Tensor) -> Tensor | None:
        if not attn.cfg.shaw_values:
            return None
        return torch.einsum("bhqk,bqke->bqhe", pattern, attn.W_rel_V.to(pattern.dtype)[ids])

    def lookup_formula(self, cfg) -> str:
        k = cfg.shaw_clip
        return f"q_i . a^K[clip(j - i, -{k}, {k})] / sqrt(d_head)"

    def ids_evidence(self, cfg, ids: Tensor) -> list[int]:
        return sorted(set((ids - cfg.shaw_clip).tolist()))

    def value_term(
        self, attn: nn.Module, pattern: Tensor, query_positions: Tensor, key_positions: Tensor
    ) -> Tensor | None:
        if not attn.cfg.shaw_values:
            return None
        ids = self.relative_ids(attn.cfg, query_positions, key_positions)
        return torch.einsum("bhqk,bqke->bqhe", pattern, attn.W_rel_V[ids])

    def needs_explicit_scores(self, attn: nn.Module) -> bool:
        return True  # the bias depends on q, and a^V needs the pattern itself
