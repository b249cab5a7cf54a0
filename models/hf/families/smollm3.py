"""SmolLM3: RoPE on the layers ``no_rope_layers`` marks 1, NoPE on the others (``self.use_rope =
config.no_rope_layers[layer_idx]``, ``transformers/models/smollm3/modeling_smollm3.py``; its config
docstring says the same, and the detector measures it)."""

from ..family import Family, no_rope_layers

FAMILIES = (Family(("smollm3",), method=no_rope_layers),)
