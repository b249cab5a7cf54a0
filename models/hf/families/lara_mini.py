"""Lara Mini: RoPE in its sliding layers only (``lara_mini/modeling_lara_mini.py`` passes
``position_embeddings=None`` to its global layers)."""

from ..family import Family, rope_if_sliding

FAMILIES = (Family(("lara_mini",), method=rope_if_sliding),)
