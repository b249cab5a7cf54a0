"""RoPE (Su et al. 2021): queries and keys rotated by their positions, pair by pair."""

from __future__ import annotations

import math

from torch import Tensor, nn

from ..positions import apply_rope
from .base import QK_ROTATION, PositionMethod

PAIRINGS = ("half", "interleaved")


class RoPE(PositionMethod):
    """Rotate the first ``rotary_dim`` dims of q and k by p * theta_r (Su et al. 2021, eq. 34).

    Parameters (config fields): ``rotary_fraction`` (partial RoPE, seed 004), ``rotary_base``,
    ``pairing`` (``half`` or ``interleaved``). Hooks: ``attn.hook_rot_q``, ``attn.hook_rot_k``.

    Audit expectations: relative; ``hook_rot_q = R(p) hook_q`` at the declared pairing and fraction;
    rotated q.k depends only on the offset, so a constant shift of every position changes nothing.
    """

    name = "rope"
    label = "RoPE"
    acts_on = frozenset({QK_ROTATION})
    convention = (
        "R(p theta) applied to q and k; (R(m theta) q)^T (R(n theta) k) = q^T R((n - m) theta) k "
        "depends on the offset n - m (seed 002)"
    )
    config_fields = ("rotary_fraction", "rotary_base", "pairing")

    @classmethod
    def validate_config(cls, cfg, used: bool) -> None:
        if cfg.pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {PAIRINGS}, got {cfg.pairing!r}")
        if not 0.0 < cfg.rotary_fraction <= 1.0:
            raise ValueError(f"rotary_fraction must lie in (0, 1], got {cfg.rotary_fraction!r}")
        exact = cfg.rotary_fraction * cfg.d_head
        if used and (abs(exact - round(exact)) > 1e-9 or round(exact) % 2):
            raise ValueError(
                f"rotary_fraction={cfg.rotary_fraction} gives rotary_dim={exact:g} of "
                f"d_head={cfg.d_head}; RoPE rotates pairs, so rotary_dim must be an even "
                "integer"
            )
        if not 1.0 < cfg.rotary_base < math.inf:
            raise ValueError(f"rotary_base must be finite and > 1, got {cfg.rotary_base!r}")

    def describe(self, cfg) -> dict:
        return {"rope": {"rotary_dim": cfg.rotary_dim, "base": cfg.rotary_base, "pairing": cfg.pairing}}

    def rotate(self, attn: nn.Module, x: Tensor, position_ids: Tensor) -> Tensor:
        cfg = attn.cfg
        return apply_rope(x, position_ids, rotary_dim=cfg.rotary_dim, base=cfg.rotary_base, pairing=cfg.pairing)
