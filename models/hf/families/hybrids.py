"""Hybrids of attention and state-space or linear-attention mixers whose attention applies no rotary
embedding: Jamba, Kimi Linear (``kimi_linear/modeling_kimi_linear.py`` keeps MLA's ``k_rot`` slice but
never rotates it), Nemotron-H and Zamba; Zamba2 rotates only with ``use_mem_rope``. TransformerLens
4.3 wraps Nemotron-H's and Zamba2's blocks opaquely: they are hooked directly."""

from ..family import Family, rope_if

FAMILIES = (
    Family(("jamba", "kimi_linear", "zamba"), method="nope"),
    Family(("nemotron_h",), method="nope", bridge_refused=(
        "TransformerLens 4.3's Nemotron-H bridge wraps every block's mixer (Mamba, attention or MLP) as one "
        "opaque SSM2MixerBridge, so no hook_pattern fires: its attention blocks are hooked directly")),
    # Zamba2Model: rotary_emb only with use_mem_rope
    Family(("zamba2",), method=lambda config, layer: rope_if(getattr(config, "use_mem_rope", False)), bridge_refused=(
        "TransformerLens 4.3's Zamba2 bridge wraps each hybrid layer as one opaque SSMBlockBridge, so its "
        "shared attention fires no hook_pattern: the attention blocks are hooked directly")),
)
