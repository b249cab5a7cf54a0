"""Sinusoidal absolute positions (Vaswani et al. 2017), fixed and added to the embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..positions import sinusoidal_table
from .base import INPUT, PositionMethod


class Sinusoidal(PositionMethod):
    """PE[p, 2r] = sin(p / 10000^(2r/d_model)), PE[p, 2r+1] = cos(...) added at position p (seed 000).

    Audit expectations: absolute; ``hook_pos_embed`` equals :func:`sinusoidal_table` at the ids.
    """

    name = "sinusoidal"
    label = "sinusoidal"
    acts_on = frozenset({INPUT})
    absolute = True
    convention = "PE(p) at position p, p from 0; even dims sin, odd dims cos"

    reference_text = "sinusoidal_table(ids)"
    fixed_formula = True

    def reference_vectors(self, decoder: nn.Module, position_ids: Tensor, d_model: int) -> Tensor:
        """What ``hook_pos_embed`` must equal, in float64: the table at the ids."""
        return sinusoidal_table(position_ids, d_model, dtype=torch.float64)

    def input_vectors(self, decoder: nn.Module, position_ids: Tensor, dtype) -> Tensor:
        return sinusoidal_table(position_ids, decoder.cfg.d_model).to(dtype)
