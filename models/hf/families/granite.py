"""IBM Granite: ``attention_multiplier`` as the score scale (``GraniteAttention``: ``self.scaling =
config.attention_multiplier``). Granite SWA: each layer's RoPE base from ``layer_rope_theta`` (0:
NoPE, ``granite_swa/configuration_granite_swa.py``) and a learned sink applied as a sigmoid(lse - s_h)
output scale (``eager_attention_forward``). GraniteMoeHybrid: a rotary embedding only for
``position_embedding_type`` "rope"."""

from __future__ import annotations

from typing import Any

from ..family import Family, rope_if


def _multiplier(config: Any, layer: int, d_head: int) -> float:
    return float(config.attention_multiplier)


ROTARY_EMBEDDING_TYPES = frozenset({"rope"})
"""GraniteMoeHybrid's ``position_embedding_type`` values that rotate q and k (else no position)."""

FAMILIES = (
    Family(("granite", "granitemoe"), score_scale=_multiplier),
    Family(("granite_swa", "granitemoe_swa"), score_scale=_multiplier, layer_theta=True, sink="output_scale"),
    Family(
        ("granitemoehybrid",),
        score_scale=_multiplier,
        linear_mixer="ssm",  # its linear_attention layers are Mamba
        method=lambda config, layer: rope_if(
            getattr(config, "position_embedding_type", None) in ROTARY_EMBEDDING_TYPES
        ),
        bridge_refused="TransformerLens 4.3's GraniteMoeHybrid bridge cannot run its forward pass "
        "(its rotary_emb component is never set)",
    ),
)
