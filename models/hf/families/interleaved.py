"""RoPE on interleaved pairs (x_{2r}, x_{2r+1}) in every layer: GPT-J and CodeGen (``rotary_dim``
of each head, ``rotate_every_two``) and GLM."""

from ..family import Family

FAMILIES = (
    Family(("gptj", "codegen"), method="rope", pairing="interleaved"),
    Family(("glm",), pairing="interleaved"),
)
