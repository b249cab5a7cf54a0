"""Hybrids of attention and state-space or linear-attention mixers whose attention applies no rotary
embedding: Jamba, Kimi Linear (``kimi_linear/modeling_kimi_linear.py`` keeps MLA's ``k_rot`` slice but
never rotates it), Nemotron-H and Zamba; Zamba2 rotates only with ``use_mem_rope``. transformers
calls their Mamba blocks ``linear_attention`` (Kimi Linear's are KDA linear attention). TransformerLens
4.3 wraps Nemotron-H's and Zamba2's blocks opaquely: they are hooked directly."""

from typing import Any

from ..description import ConfigError
from ..family import Family, rope_if


def _zamba2_check(config: Any) -> None:
    """``Zamba2Model`` places its shared attention by ``hybrid_layer_ids`` (``layer_block_map``), which
    must be the layers whose ``layers_block_type`` is ``hybrid`` (its config derives them so; a
    config.json that gives others makes the forward pass look up a block that is not there)."""
    ids, kinds = getattr(config, "hybrid_layer_ids", None), getattr(config, "layers_block_type", None)
    if not isinstance(kinds, (list, tuple)):
        return
    hybrid = [layer for layer, kind in enumerate(kinds) if kind == "hybrid"]
    if not isinstance(ids, (list, tuple)) or list(ids) != hybrid:
        raise ConfigError(
            f"hybrid_layer_ids is {ids if ids is None else list(ids)!r}: it must list the layers whose "
            f"layers_block_type is 'hybrid' ({hybrid}); remove it (transformers derives it) or correct it"
        )


def _jamba_check(config: Any) -> None:
    """``JambaConfig`` places attention and experts by ``i % attn_layer_period == attn_layer_offset`` (and
    the same with ``expert_layer_*``, ``jamba/configuration_jamba.py``): each period a whole number of at
    least 1, each offset one from 0 to period - 1."""
    for kind in ("attn", "expert"):
        period, offset = (getattr(config, f"{kind}_layer_{name}", None) for name in ("period", "offset"))
        for name, value, low in ((f"{kind}_layer_period", period, 1), (f"{kind}_layer_offset", offset, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} is {value!r}: it must be a whole number, at least {low}")
        if offset >= period:
            raise ConfigError(f"{kind}_layer_offset is {offset}: it must be below {kind}_layer_period ({period})")


MAMBA = dict(method="nope", linear_mixer="ssm")

FAMILIES = (
    # JambaConfig divides by the periods as it is built: refused from config.json (check_sizes) before that
    Family(("jamba",), **MAMBA, check=_jamba_check, size_fields=("attn_layer_period", "expert_layer_period")),
    Family(("zamba",), **MAMBA),
    Family(("kimi_linear",), method="nope"),
    Family(
        ("nemotron_h",),
        **MAMBA,
        size_fields=("mamba_head_dim", "mamba_num_heads", "ssm_state_size"),
        bridge_refused=(
            "TransformerLens 4.3's Nemotron-H bridge wraps every block's mixer (Mamba, attention or MLP) as one "
            "opaque SSM2MixerBridge, so no hook_pattern fires: its attention blocks are hooked directly"
        ),
    ),
    # Zamba2Model: rotary_emb only with use_mem_rope
    Family(
        ("zamba2",),
        method=lambda config, layer: rope_if(getattr(config, "use_mem_rope", False)),
        linear_mixer="ssm",
        check=_zamba2_check,
        size_fields=("attention_head_dim", "mamba_headdim", "n_mamba_heads", "mamba_d_state", "num_mem_blocks"),
        bridge_refused=(
            "TransformerLens 4.3's Zamba2 bridge wraps each hybrid layer as one opaque SSMBlockBridge, so its "
            "shared attention fires no hook_pattern: the attention blocks are hooked directly"
        ),
    ),
)
