"""Learned absolute positions: a trained table ``W_pos [n_ctx, d_model]`` added to the embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import INPUT, PositionMethod


class PosEmbed(nn.Module):
    """The learned table ``W_pos [n_ctx, d_model]`` (TransformerLens' name)."""

    def __init__(self, cfg):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))


class Learned(PositionMethod):
    """Row p of a learned table is added to the embedding of the token at position p (GPT-2; seed 002).

    Audit expectations: absolute (a shift of every position changes the output); ``hook_pos_embed``
    equals ``W_pos`` at the position ids; a position at or past ``n_ctx`` has no row and is refused.
    """

    name = "learned"
    label = "learned"
    acts_on = frozenset({INPUT})
    absolute = True
    convention = "row p of W_pos at position p, p from 0; positions >= n_ctx are refused (no wrapping)"

    def max_positions(self, cfg) -> int:
        return cfg.n_ctx

    def add_input_parameters(self, decoder: nn.Module, cfg) -> None:
        decoder.pos_embed = PosEmbed(cfg)

    def input_vectors(self, decoder: nn.Module, position_ids: Tensor, dtype) -> Tensor:
        return F.embedding(position_ids, decoder.pos_embed.W_pos)

    reference_text = "W_pos rows at the position ids"
    fixed_formula = False

    def reference_vectors(self, decoder: nn.Module, position_ids: Tensor, d_model: int) -> Tensor:
        """What ``hook_pos_embed`` must equal, in float64: the ``W_pos`` rows at the ids."""
        return decoder.pos_embed.W_pos.double()[position_ids]
