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
    if not isinstance(ids, (list, tuple)) or not isinstance(kinds, (list, tuple)):
        return
    hybrid = [layer for layer, kind in enumerate(kinds) if kind == "hybrid"]
    if list(ids) != hybrid:
        raise ConfigError(f"hybrid_layer_ids is {list(ids)}: it must list the layers whose layers_block_type is "
                          f"'hybrid' ({hybrid}); remove it (transformers derives it) or correct it")


MAMBA = dict(method="nope", linear_mixer="ssm")

FAMILIES = (
    Family(("jamba", "zamba"), **MAMBA),
    Family(("kimi_linear",), method="nope"),
    Family(("nemotron_h",), **MAMBA, size_fields=("mamba_head_dim", "mamba_num_heads", "ssm_state_size"),
           bridge_refused=(
               "TransformerLens 4.3's Nemotron-H bridge wraps every block's mixer (Mamba, attention or MLP) as one "
               "opaque SSM2MixerBridge, so no hook_pattern fires: its attention blocks are hooked directly")),
    # Zamba2Model: rotary_emb only with use_mem_rope
    Family(("zamba2",), method=lambda config, layer: rope_if(getattr(config, "use_mem_rope", False)),
           linear_mixer="ssm", check=_zamba2_check,
           size_fields=("attention_head_dim", "mamba_headdim", "n_mamba_heads", "mamba_d_state", "num_mem_blocks"),
           bridge_refused=(
               "TransformerLens 4.3's Zamba2 bridge wraps each hybrid layer as one opaque SSMBlockBridge, so its "
               "shared attention fires no hook_pattern: the attention blocks are hooked directly")),
)
